#!/usr/bin/env bash
# Download the wheels a device call carries (`.whl`, ignored by git; scripts/gpu.sh installs them there): the GPU
# image (Python 3.12, x86_64, torch 2.11) has neither the optional kernel libraries nor the server's packages.
#   .whl/gpu    humming-kernels, sgl-flash-mla (docs/kernels.md)
#   .whl/serve  the server and grammar engine (fastapi, uvicorn, llguidance) and jsonschema, with what they need
# WITH_OPENAI=1 adds the openai client (the server's CPU tests import it; no gpu test does): a call's carry is at
# most 64 MiB, and the tracked files (~45 MB) + these wheels (~18 MB) leave no room for it and an A/B's tarballs.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q "${TARGET[@]}" --no-deps -d .whl/gpu humming-kernels==0.1.19 sgl-flash-mla==1.0.0
python3 -m pip download -q "${TARGET[@]}" -d .whl/serve fastapi uvicorn "llguidance>=1.6" jsonschema \
    ${WITH_OPENAI:+openai}
du -sh .whl/gpu .whl/serve
