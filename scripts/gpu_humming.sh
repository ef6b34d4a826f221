#!/usr/bin/env bash
# One device call for the Humming backend of the routed experts (notes: docs/perf/notes-moe.md): install the
# humming-kernels wheel (carry .whl), the moe-layer suite with Humming (its tile configs compiled side by side, a
# tile-config alternative), its GPU tests (parity against the reference), and the suite
# with our Triton kernels for comparison. JSON and logs go to $OUT (./out when run by hand); Humming's compiled
# kernels come back as humming_cache.tgz (put it in .whl/ and carry .whl: it is unpacked into $HUMMING_CACHE_DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/tmp/humming_cache}
mkdir -p "$HUMMING_CACHE_DIR"
[ -f .whl/humming_cache.tgz ] && tar xzf .whl/humming_cache.tgz -C "$HUMMING_CACHE_DIR"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/humming_kernels-*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/smi.txt"
python3 -c "import torch, triton, humming; print('torch', torch.__version__, 'triton', triton.__version__, \
'humming', humming.__version__)" 2>&1 | tee -a "$OUT/smi.txt"
BENCH="python3 -m mini.cli bench moe-layer"
timeout ${T_HUMMING:-150} $BENCH --moe-gemm humming ${HUMMING_TILES:---humming-tiles 128x4 128x6 192x4 208x3 176x5} \
    --json "$OUT/moe_layer_humming.json" 2>&1 | tee "$OUT/bench_humming.log"
MINI_MOE_GEMM=triton timeout ${T_TESTS:-120} python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels/test_humming_experts.py tests/ops/test_moe.py tests/kernels/test_fp8_act_quant.py \
    tests/kernels/test_moe_route.py tests/kernels/test_mxfp4_grouped_gemm.py \
    -k "humming or gathers or swiglu_rows or (test_swiglu_gpu and None) or test_fast_moe or test_plan_on_gpu" \
    2>&1 | tee "$OUT/pytest_humming.log"
[ "${SKIP_TRITON:-0}" = 1 ] || timeout ${T_TRITON:-90} $BENCH --moe-gemm triton ${TRITON_ARGS:-} \
    --json "$OUT/moe_layer_triton.json" 2>&1 | tee "$OUT/bench_triton.log"
tar czf "$OUT/humming_cache.tgz" -C "$HUMMING_CACHE_DIR" . && ls -la "$OUT"
