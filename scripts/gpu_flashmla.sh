#!/usr/bin/env bash
# FlashMLA backend of the sparse attention core (mini/kernels/flashmla_attention.py; notes:
# docs/perf/notes-attention.md, round 3), one device call of ~60-90 s (capped at BUDGET=95 s): install
# sgl-flash-mla from .whl/gpu (carry .whl) into /tmp/site; its gpu tests (parity vs the reference op and our Triton
# kernel, dispatch, auto's first-call check); the rank4-shape micro-benchmark (flashmla vs triton, median ms); then,
# with the time left, the in-model fast-path check with MINI_SPARSE_ATTN=flashmla.
# Two files under $OUT (./out by hand), so that it can share a call with other scripts: flashmla.log (everything)
# and kernels_flashmla.json (the bench rows). Usage, from anywhere: bash scripts/gpu_flashmla.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/flashmla.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-95}
left() { echo $(( BUDGET - SECONDS )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : (l > 1 ? l : 1) )); }
step() { echo "=== $* (at ${SECONDS} s)" | tee -a "$LOG"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/sgl_flash_mla-*.whl \
    2>&1 | tee -a "$LOG" && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import torch, triton, flash_mla; from mini.kernels.flashmla_attention import available; \
print('torch', torch.__version__, 'triton', triton.__version__, 'flash_mla', flash_mla.__version__, \
'legacy', flash_mla.has_legacy(), 'available', available())" 2>&1 | tee -a "$LOG"
AVAILABLE=$(grep -c "available True" "$LOG")
step "gpu tests"
timeout "$(cap 60)" python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/kernels/test_flashmla_attention.py \
    2>&1 | tee -a "$LOG"
step "bench"
timeout "$(cap 30)" python3 -m mini.bench.kernels --only flashmla --json "$OUT/kernels_flashmla.json" \
    2>&1 | tee -a "$LOG"
if [ "$AVAILABLE" = 1 ] && [ "$(left)" -ge 25 ]; then
    step "in-model fast path check, MINI_SPARSE_ATTN=flashmla"
    MINI_SPARSE_ATTN=flashmla timeout "$(cap 60)" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/model/test_fast_path_gpu.py 2>&1 | tee -a "$LOG"
else
    step "in-model fast path check skipped: flash_mla available=$AVAILABLE, $(left) s left"
fi
step "done"
