#!/bin/bash
# device job (240 s): the mhc gpu tests (2 background processes) while 12 processes compile every A/B config and run
# the gpu test's check per config; then the A/B timing alone; then the kernels suite's mhc sweep.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
D=.cache/mhc2
T0=$(date +%s)
left() { echo $(( $1 - $(date +%s) + T0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $OUT/compile.log 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/compile.log 2>&1
P="python3 -m pytest -q -p no:cacheprovider -m gpu"
(timeout 150 $P tests/kernels/test_mhc_norm.py > $OUT/t1.log 2>&1; echo "rc=$?" >> $OUT/t1.log) &
(timeout 150 $P tests/ops/test_mhc.py > $OUT/t2.log 2>&1; echo "rc=$?" >> $OUT/t2.log) &
timeout $(left 125) python3 $D/ab.py $D/mhc_norm_old.py $OUT/checks.json --compile 12 2>&1 | grep -v Warning >> $OUT/compile.log
echo "compile+checks done: $(( $(date +%s) - T0 ))s" >> $OUT/compile.log
wait
cat $OUT/t1.log $OUT/t2.log > $OUT/pytest_gpu.log; rm $OUT/t1.log $OUT/t2.log
echo "tests done: $(( $(date +%s) - T0 ))s" | tee -a $OUT/compile.log; tail -n 4 $OUT/pytest_gpu.log
timeout $(left 190) python3 $D/ab.py $D/mhc_norm_old.py $OUT/ab.json 2>&1 | grep -v Warning > $OUT/ab.log
echo "ab done: $(( $(date +%s) - T0 ))s" | tee -a $OUT/compile.log
grep best $OUT/ab.log
timeout $(left 232) python3 -m mini.bench.kernels --only mhc --sweep --json $OUT/kernels_mhc.json > $OUT/kernels_mhc.log 2>&1
echo "total: $(( $(date +%s) - T0 ))s" | tee -a $OUT/compile.log
tail -n 14 $OUT/kernels_mhc.log
