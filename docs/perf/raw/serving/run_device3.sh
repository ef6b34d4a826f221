#!/usr/bin/env bash
# Third device call (one H200): overlapped decode steps (EngineOptions.overlap). decode-host at batch 64:
# tiny-v4.1 in the three modes (Engram: the in-flight ids are read back before each step's Engram lookup), and
# graphs+overlap again with one host torch thread; tiny-v4 graphs vs graphs+overlap (no Engram: ids fed on the
# device, no read-back before a launch); the gpu tests of the engine (graphs+overlap == graphs == eager) and of
# the suite; tiny-goodput with graphs (overlap on by default). Each command is capped (560 s in all); one
# failing does not stop the others. Results in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 MINI_MOE_GEMM=triton
if ls .whl/serve/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/serve/*.whl
    export PYTHONPATH=/tmp/site
fi
log="$OUT/log.txt"
{ nvidia-smi --query-gpu=name --format=csv; cat COMMIT 2>/dev/null; } >>"$log" 2>&1
timeout 150 python3 -m mini bench decode-host --json "$OUT/decode_host_v41.json" >>"$log" 2>&1
echo "decode-host tiny-v4.1 eager,graphs,graphs+overlap rc=$?" >>"$log"
timeout 90 python3 -m mini bench decode-host --model tiny-v4 --modes graphs,graphs+overlap \
    --json "$OUT/decode_host_v4.json" >>"$log" 2>&1
echo "decode-host tiny-v4 graphs,graphs+overlap rc=$?" >>"$log"
timeout 60 python3 -m mini bench decode-host --modes graphs+overlap --host-threads 1 \
    --json "$OUT/decode_host_v41_threads1.json" >>"$log" 2>&1
echo "decode-host tiny-v4.1 graphs+overlap host-threads 1 rc=$?" >>"$log"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_overlap.py \
    tests/engine/test_decode_graphs.py tests/bench/test_decode_host.py >"$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?" >>"$log"; tail -5 "$OUT/pytest_gpu.log" >>"$log"
timeout 60 python3 -m mini bench tiny-goodput --backend fast --num-requests 64 --input-len 128 --output-len 64 \
    --json "$OUT/goodput_overlap.json" >>"$log" 2>&1
echo "goodput rc=$?" >>"$log"
cat "$log"
