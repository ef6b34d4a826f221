#!/usr/bin/env bash
# One device call for the fused MoE gate (mini/kernels/moe_gate.py) and the Triton routing plan
# (mini/kernels/moe_route.py), from the repo root, under 2 minutes: their GPU tests (real V4.1-Flash shape: 16,384
# tokens x 384 experts x D 5120, plans bit-identical to the torch plan), then `mini bench moe-layer` timing the new
# gate / plan against the old ones in the same process (--old-gate-plan), the gate kernel's configs and the
# fused-vs-unfused gate at small token counts (the dispatch threshold, mini.ops.moe.FUSED_GATE_MIN_TOKENS).
# Logs and the JSON go to $OUT (the device tool's result folder; ./out when run by hand). Humming is not needed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv 2>&1 | tee "$OUT/gate_smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 \
    | tee -a "$OUT/gate_smi.txt"
timeout 55 python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/kernels/test_moe_gate.py \
    tests/kernels/test_moe_route.py 2>&1 | tee "$OUT/gate_pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gate_pytest.log"
timeout 60 python3 -m mini.cli bench moe-layer --only-gate-plan --old-gate-plan --gate-configs \
    --gate-sweep-tokens 1 64 256 1024 4096 --route-blocks 256 512 --json "$OUT/gate_bench.json" 2>&1 \
    | tee "$OUT/gate_bench.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gate_bench.log"
