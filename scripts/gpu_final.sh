#!/usr/bin/env bash
# The lead's device calls (one H200). PHASE=1: every gpu-marked test, then the rank4 suite with its per-stage
# profile. PHASE=2: A/B of the moe-layer suite between two packed revisions (tools/bench_rev.py, tarballs in the
# carried .cache/bench_rev), then the tiny-goodput serving benchmark on the fast backend (server wheels carried in
# .whl/serve). PHASE=3: A/B of the rank4 suite between two packed revisions. Everything lands in $OUT (at most 8 files come back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log="$OUT/log.txt"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv; git log -1 --format=%H 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$log" 2>&1
# optional carried libraries (kernels-and-deps.md): Humming's MXFP4 MoE GEMMs, used when importable
if ls .whl/gpu/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/gpu/*.whl >>"$log" 2>&1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "${PHASE:-1}" = 1 ]; then
    timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/ops tests/model tests/engine \
        tests/checkpoint tests/bench >"$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?" >>"$log"
    tail -5 "$OUT/pytest_gpu.log" >>"$log"
    timeout 320 python3 -m mini.cli profile --suite rank4 --out "$OUT/profile" >>"$log" 2>&1
    echo "profile rc=$?" >>"$log"
elif [ "${PHASE}" = 3 ]; then  # rank4 A/B of two packed revisions, interleaved
    a=$(ls .cache/bench_rev/*.tar.gz | grep -v HEAD | head -1); b=$(ls .cache/bench_rev/*HEAD*.tar.gz | head -1)
    timeout 420 python3 tools/bench_rev.py run "$a" "$b" --suite rank4 --repeat 2 --out "$OUT/ab" \
        -- --steps 5 --warmup 1 >>"$log" 2>&1; echo "bench_rev rc=$?" >>"$log"
else
    if ls .whl/serve/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/serve/*.whl >>"$log" 2>&1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    a=$(ls .cache/bench_rev/*.tar.gz | grep -v HEAD | head -1); b=$(ls .cache/bench_rev/*HEAD*.tar.gz | head -1)
    timeout 200 python3 tools/bench_rev.py run "$a" "$b" --suite moe-layer --repeat 2 --out "$OUT/ab" \
        -- --check-tokens 0 >>"$log" 2>&1; echo "bench_rev rc=$?" >>"$log"
    timeout 150 python3 -m mini.cli bench tiny-goodput --backend fast --num-requests 64 --input-len 128 \
        --output-len 64 --json "$OUT/goodput.json" >>"$log" 2>&1; echo "goodput rc=$?" >>"$log"
fi
tail -60 "$log"
