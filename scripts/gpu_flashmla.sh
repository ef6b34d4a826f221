#!/usr/bin/env bash
# FlashMLA backend of the sparse attention core (mini/kernels/flashmla_attention.py; notes:
# docs/perf/notes-attention.md), one device call, ~60-90 s: install sgl-flash-mla from .whl/gpu (carry .whl) into
# /tmp/site, its gpu tests (parity vs the reference op and our Triton kernel, dispatch, auto's first-call check),
# the rank4-shape micro-benchmark (flashmla vs triton, median ms), then, with the time left, the in-model fast-path
# check with MINI_SPARSE_ATTN=flashmla. Logs and JSON under $OUT (./out when run by hand).
# Usage, from the repo root: bash scripts/gpu_flashmla.sh      (BUDGET=seconds for the whole script, default 95)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-95}
left() { echo $(( BUDGET - SECONDS )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : (l > 1 ? l : 1) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/sgl_flash_mla-*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/smi.txt"
python3 -c "import torch, triton, flash_mla; from mini.kernels.flashmla_attention import available; \
print('torch', torch.__version__, 'triton', triton.__version__, 'flash_mla', flash_mla.__version__, \
'legacy', flash_mla.has_legacy(), 'available', available())" 2>&1 | tee -a "$OUT/smi.txt"
AVAILABLE=$(grep -c "available True" "$OUT/smi.txt")
echo "setup: ${SECONDS} s" | tee "$OUT/times.txt"
timeout "$(cap 60)" python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/kernels/test_flashmla_attention.py \
    2>&1 | tee "$OUT/tests.log"
echo "tests done at ${SECONDS} s" | tee -a "$OUT/times.txt"
timeout "$(cap 30)" python3 -m mini.bench.kernels --only flashmla --json "$OUT/kernels_flashmla.json" \
    2>&1 | tee "$OUT/bench.log"
echo "bench done at ${SECONDS} s" | tee -a "$OUT/times.txt"
if [ "$AVAILABLE" = 1 ] && [ "$(left)" -ge 25 ]; then
    MINI_SPARSE_ATTN=flashmla timeout "$(cap 60)" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/model/test_fast_path_gpu.py 2>&1 | tee "$OUT/fast_path_flashmla.log"
    echo "fast path done at ${SECONDS} s" | tee -a "$OUT/times.txt"
else
    echo "fast path check skipped: flash_mla available=$AVAILABLE, $(left) s left" | tee -a "$OUT/times.txt"
fi
