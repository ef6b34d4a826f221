#!/usr/bin/env bash
# Download the wheels a device call carries (`.whl`, ignored by git; scripts/gpu.sh installs them there): the GPU
# image (Python 3.12, x86_64, torch 2.11) has neither the optional kernel libraries nor the server's packages.
#   .whl/gpu    humming-kernels, sgl-flash-mla (docs/kernels.md)
#   .whl/serve  the server and grammar engine (fastapi, uvicorn, llguidance) and jsonschema, with what they need
# WITH_OPENAI=1 adds the openai client (the server's CPU tests import it; no gpu test does): a call's carry is at
# most 64 MiB, and the tracked files (~49 MB) + these wheels (~14 MB) leave no room for it and an A/B's tarballs.
# sgl-flash-mla's two libraries ship their debug info (9.6 MB of wheel; 6 MB without): stripped here (`strip
# --strip-debug`, symbols kept; the wheel's RECORD rewritten), so that `.whl` whole fits a call beside the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q "${TARGET[@]}" --no-deps -d .whl/gpu humming-kernels==0.1.19 sgl-flash-mla==1.0.0
python3 -m pip download -q "${TARGET[@]}" -d .whl/serve fastapi uvicorn "llguidance>=1.6" jsonschema \
    ${WITH_OPENAI:+openai}
command -v strip >/dev/null && python3 - .whl/gpu/sgl_flash_mla-*.whl <<'PY'
import base64, hashlib, io, subprocess, sys, tempfile, zipfile
from pathlib import Path
for wheel in map(Path, sys.argv[1:]):
    with zipfile.ZipFile(wheel) as z:
        files = {i.filename: z.read(i) for i in z.infolist()}
    if not any(n.endswith(".so") for n in files) or b"stripped-debug" in files.get("STRIPPED", b""):
        continue
    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in files if n.endswith(".so")]:
            so = Path(tmp, "lib.so")
            so.write_bytes(files[name])
            subprocess.run(["strip", "--strip-debug", str(so)], check=True)
            files[name] = so.read_bytes()
    files["STRIPPED"] = b"stripped-debug\n"
    record = next(n for n in files if n.endswith(".dist-info/RECORD"))
    lines = []
    for name, data in files.items():
        if name != record:
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={digest},{len(data)}")
    files[record] = ("\n".join(lines + [f"{record},,"]) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, data in files.items():
            z.writestr(name, data)
    wheel.write_bytes(buf.getvalue())
    print(f"{wheel.name}: debug info stripped, {len(buf.getvalue()) / 2**20:.1f} MiB")
PY
du -sh .whl/gpu .whl/serve
