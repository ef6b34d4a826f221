#!/usr/bin/env bash
# Attention-side kernels on the H200 (device tool): gpu parity tests, then the micro-benchmarks. Logs under $OUT.
# Usage: bash scripts/gpu_attention.sh [bench options, e.g. --sweep --only attention]
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_attention}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_{sparse_attention,indexer_topk,mhc_norm,rope_quant}.py 2>&1 | tee "$OUT/tests.log"
python3 -m mini.bench.kernels --json "$OUT/kernels.json" "$@" 2>&1 | tee "$OUT/bench.log"
