#!/usr/bin/env bash
# Issue #5's device call on 2 H200s (kind nvidia-h200-x2): (1) ep-exact — greedy decoding on 2 EP/DP ranks over
# NCCL against one rank with every expert on the same GPU, fast and reference backends; (2) ep-prefill at the most
# layers that fit one H200 at EP2 (LAYERS, default 32: 128.5 GiB peak per GPU, see docs/perf/004), with its
# per-stage profile incl. communication; if that run dies, FALLBACK layers. The build needs expandable segments at
# this size (without them 30 and 34 layers ran out of memory in the build: report 004). Everything lands in $OUT;
# the whole script stays inside BUDGET_S seconds. Run from a clean tree (`git archive HEAD` into the ignored
# .cache/ep2run, carried), so that nobody's uncommitted edits travel with it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LAYERS=${LAYERS:-32}; FALLBACK=${FALLBACK:-28}; BUDGET_S=${BUDGET_S:-235}; EXACT_S=${EXACT_S:-90}
log="$OUT/log.txt"
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$log" 2>&1
left() { echo $((BUDGET_S - SECONDS)); }

timeout "$EXACT_S" torchrun --nproc-per-node 2 -m mini bench ep-exact --json "$OUT/ep_exact.json" \
    >"$OUT/ep_exact.log" 2>&1
echo "ep-exact rc=$? at ${SECONDS}s" >>"$log"

prefill() {  # $1 layers, $2 seconds
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$2" torchrun --nproc-per-node 2 -m mini bench \
        ep-prefill --layers "$1" --steps 5 --warmup 1 --profile-steps 2 --json "$OUT/ep2_L$1.json" \
        >"$OUT/ep2_L$1.log" 2>&1
    local rc=$?; echo "ep-prefill layers=$1 rc=$rc at ${SECONDS}s" >>"$log"; return $rc
}
prefill "$LAYERS" "$(left)" || { [ "$(left)" -gt 60 ] && prefill "$FALLBACK" "$(left)"; }
nvidia-smi --query-gpu=memory.used --format=csv >>"$log" 2>&1
cat "$log"; grep -v "^W[0-9]\|^\*\*\*" "$OUT"/ep_exact.log | tail -60; for f in "$OUT"/ep2_L*.log; do tail -40 "$f"; done
