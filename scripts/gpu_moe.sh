#!/usr/bin/env bash
# One device call for the MoE work: GPU tests of the MoE kernels and op, then the moe-layer suite (with a tile
# sweep). Logs and the JSON result go to $OUT (the device tool's result folder; ./out when run by hand).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider ${MOE_TESTS:-tests/kernels/test_moe_route.py \
    tests/kernels/test_moe_combine.py tests/kernels/test_mxfp4_grouped_gemm.py tests/kernels/test_fp8_act_quant.py \
    tests/ops/test_moe.py} 2>&1 | tee "$OUT/pytest_moe.log"
timeout 400 python3 -m mini.cli bench moe-layer ${MOE_BENCH_ARGS:---sweep} --json "$OUT/moe_layer.json" 2>&1 \
    | tee "$OUT/bench_moe_layer.log"
# RANK4=1: also the rank4 suite and its per-stage profile, from one model build (all 40 layers at V4.1-Flash
# shape): $OUT/profile/{rank4.json, profile.json, trace.json.gz}
if [ "${RANK4:-0}" = 1 ]; then
    timeout 540 python3 -m mini.cli profile --suite rank4 --out "$OUT/profile" 2>&1 | tee "$OUT/profile_rank4.log"
fi
