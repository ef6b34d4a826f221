#!/usr/bin/env bash
# The lead's device calls (one H200), carry [".whl", ".cache/bench_rev"]. Everything lands in $OUT.
#   PHASE=checks   every gpu-marked test (4 workers), gate + route plan old vs new, the moe-layer suite (Humming),
#                  the FlashMLA sparse attention micro-benchmark, the decode host share (eager / graphs / graphs +
#                  overlap; tiny-v4.1 and tiny-v4) and the tiny goodput benchmark
#   PHASE=measure  A/B of the rank4 suite between the packed base revision and HEAD (`tools/bench_rev.py pack
#                  BASE HEAD` first: tarballs in .cache/bench_rev), then the per-stage profile of HEAD
# Durations on the H200 (session 3): gpu tests ~200 s on 4 workers, the checks phase ~390 s in all; the rank4 A/B
# ~100 s per revision (build ~35 s + 6 steps), the profile ~50 s. Run from a clean tree (`git archive HEAD`,
# extracted on the device) so that nobody's uncommitted work travels. Backends are chosen by the environment
# (MINI_MOE_GEMM, MINI_SPARSE_ATTN, ...), so a failed check can be routed around in the next call without a code
# change.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HUMMING_CACHE_DIR=/tmp/humming_cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
log="$OUT/log.txt"
# carried wheels (kernels-and-deps.md): the server's pure-Python deps and the optional GPU libraries
wheels=$(ls .whl/serve/*.whl .whl/gpu/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels >>"$log" 2>&1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$HUMMING_CACHE_DIR"; [ -f .whl/humming_cache.tgz ] && tar xzf .whl/humming_cache.tgz -C "$HUMMING_CACHE_DIR"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  env | grep '^MINI_' ; } >>"$log" 2>&1

bundle() {  # at most 8 files come back from a device call: everything else travels in one bundle
    (cd "$OUT" && tar czf bundle.tgz --exclude bundle.tgz --exclude humming_cache.tgz --exclude '*.gz' . 2>/dev/null)
}
DEADLINE=${DEADLINE:-570}  # seconds of this script, under the call's 600 s limit; later steps' caps shrink to fit
step() {  # step NAME SECONDS CMD...: run with a time cap, log its exit status, re-bundle
    local name=$1 cap=$2; shift 2
    local left=$((DEADLINE - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
    [ "$cap" -le 5 ] && { echo "$name skipped (deadline)" >>"$log"; return; }
    timeout "$cap" "$@" >"$OUT/$name.log" 2>&1; echo "$name rc=$? (${SECONDS}s)" >>"$log"
    tail -4 "$OUT/$name.log" >>"$log"; bundle
}

if [ "${PHASE:-checks}" = checks ]; then
    step pytest_gpu "${T_TESTS:-250}" python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -rfE --durations=25 \
        --timeout=150 tests
    step fastpath_decode 60 bash -c 'for fq in "" --decode-no-fake-quant; do python3 -m mini.cli bench fastpath-check \
        --decode-only $fq --json "$0/fastpath_decode${fq:+_nofq}.json" || exit 1; done' "$OUT"
    step gate_plan 45 python3 -m mini.cli bench moe-layer --only-gate-plan --old-gate-plan --gate-configs \
        --gate-sweep-tokens 1 64 256 1024 4096 16384 --route-blocks 256 512 --json "$OUT/gate_plan.json"
    step moe_layer 50 python3 -m mini.cli bench moe-layer --json "$OUT/moe_layer.json"
    step flashmla 25 python3 -m mini.bench.kernels --only flashmla --json "$OUT/kernels_flashmla.json"
    step decode_host_v41 75 python3 -m mini.cli bench decode-host --json "$OUT/decode_host_v41.json"
    step decode_host_v4 40 python3 -m mini.cli bench decode-host --model tiny-v4 --modes graphs,graphs+overlap \
        --json "$OUT/decode_host_v4.json"
    step goodput 45 python3 -m mini.cli bench tiny-goodput --backend fast --num-requests 64 --input-len 128 \
        --output-len 64 --json "$OUT/goodput.json"
else
    a=$(ls .cache/bench_rev/*.tar.gz | grep -v HEAD | head -1); b=.cache/bench_rev/HEAD.tar.gz  # no .git there
    step ab "${T_AB:-230}" python3 tools/bench_rev.py run "$a" "$b" --suite rank4 --repeat 1 --out "$OUT/ab" \
        -- --steps 5 --warmup 1
    step profile "${T_PROFILE:-130}" python3 -m mini.cli profile --suite rank4 --steps 5 --warmup 1 \
        --out "$OUT/profile"
fi
tar czf "$OUT/humming_cache.tgz" -C "$HUMMING_CACHE_DIR" . 2>/dev/null
bundle
tail -40 "$log"
