#!/usr/bin/env bash
# Set up a fresh CPU machine and run the whole test suite. torch is pinned to the CPU build of 2.13 here;
# the GPU image brings its own torch 2.11.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e '.[test]'
OMP_NUM_THREADS=1 python3 -m pytest -q -n 2 "$@"
