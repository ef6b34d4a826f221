#!/usr/bin/env bash
# Second device call (one H200), after the input-prep change: decode-host with graphs at the serving context
# (max_model_len 4096, the model's) and at 256 (what padding the index tensors to the context costs), the
# graphs == eager gpu test again, tiny-goodput with graphs. Run from a `git archive` snapshot; results in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 MINI_MOE_GEMM=triton
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/serve/*.whl
export PYTHONPATH=/tmp/site
log="$OUT/log.txt"
{ nvidia-smi --query-gpu=name --format=csv; cat COMMIT; } >>"$log" 2>&1
timeout 60 python3 -m mini bench decode-host --modes graphs --json "$OUT/decode_host_graphs.json" >>"$log" 2>&1
echo "decode-host graphs rc=$?" >>"$log"
timeout 30 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_decode_graphs.py >"$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?" >>"$log"; tail -3 "$OUT/pytest_gpu.log" >>"$log"
timeout 40 python3 -m mini bench tiny-goodput --backend fast --num-requests 64 --input-len 128 --output-len 64 \
    --json "$OUT/goodput_graphs.json" >>"$log" 2>&1
echo "goodput rc=$?" >>"$log"
timeout 30 python3 -m mini bench decode-host --modes graphs --max-model-len 256 \
    --json "$OUT/decode_host_graphs_len256.json" >>"$log" 2>&1
echo "decode-host graphs len256 rc=$?" >>"$log"
cat "$log"
