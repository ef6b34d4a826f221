#!/usr/bin/env bash
# Attention side on the H200 (device tool), one call: gpu parity tests of the attention kernels and ops (+ the
# fast path vs reference at real width), the rank4 per-stage profile, then the before/after micro-benchmarks.
# Logs under $OUT. Usage: bash scripts/gpu_attention.sh [extra bench options, e.g. --sweep]
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_attention}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t0=$SECONDS
timeout 40 python3 -m pytest -q -n 4 --dist loadfile -m gpu -p no:cacheprovider \
    tests/kernels/test_{sparse_attention,indexer_topk,rope_quant}.py tests/ops/test_{rope,compressor}.py \
    tests/model/test_fast_path_gpu.py 2>&1 | tee "$OUT/tests.log"
echo "tests: $((SECONDS - t0)) s"; t0=$SECONDS
timeout 75 python3 -m mini.cli profile --suite rank4 --out "$OUT/profile" --steps 2 --warmup 1 --profile-steps 1 \
    2>&1 | tee "$OUT/profile.log"
echo "profile: $((SECONDS - t0)) s"; t0=$SECONDS
timeout 35 python3 -m mini.bench.kernels --only attention indexer rope_chains attn_glue --json "$OUT/kernels.json" "$@" \
    2>&1 | tee "$OUT/bench.log"
echo "bench: $((SECONDS - t0)) s"
