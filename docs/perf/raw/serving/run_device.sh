#!/usr/bin/env bash
# The serving helper's device call (one H200): CUDA-graph decode gpu test, decode-host eager vs graphs at batch 64,
# tiny-goodput with graphs. Run from a `git archive` snapshot of the commit under test; results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 MINI_MOE_GEMM=triton
whl=${WHL:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl"/serve/*.whl
export PYTHONPATH=/tmp/site
log="$OUT/log.txt"
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv; cat COMMIT 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >>"$log" 2>&1
for mode in eager graphs; do  # eager first: it also compiles the Triton kernels (on-disk cache) for what follows
    timeout 70 python3 -m mini bench decode-host --modes $mode --json "$OUT/decode_host_$mode.json" >>"$log" 2>&1
    echo "decode-host $mode rc=$?" >>"$log"
done
timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_decode_graphs.py >"$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?" >>"$log"; tail -3 "$OUT/pytest_gpu.log" >>"$log"
timeout 50 python3 -m mini bench tiny-goodput --backend fast --num-requests 64 --input-len 128 --output-len 64 \
    --json "$OUT/goodput_graphs.json" >>"$log" 2>&1
echo "goodput rc=$?" >>"$log"
cat "$log"
