#!/bin/bash
# device job: gpu tests of the mhc kernels (in the background, 4 processes) while the A/B configs compile in 8
# processes; then the A/B timing alone on the GPU.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/nvidia_smi.txt 2>&1
T0=$(date +%s)
P="python3 -m pytest -q -p no:cacheprovider"
($P tests/kernels/test_mhc_norm.py -k "gpu and not rms" > $OUT/t1.log 2>&1; echo "rc=$?" >> $OUT/t1.log) &
($P tests/kernels/test_mhc_norm.py -k "gpu and rms" tests/kernels/test_mhc_expand.py > $OUT/t2.log 2>&1; echo "rc=$?" >> $OUT/t2.log) &
($P tests/ops/test_mhc.py -m gpu > $OUT/t3.log 2>&1; echo "rc=$?" >> $OUT/t3.log) &
python3 .cache/mhc_ab/ab.py .cache/mhc_ab/mhc_norm_old.py x --compile 8 2>&1 | grep -v Warning
wait
echo "tests+compile: $(( $(date +%s) - T0 ))s"; tail -n 3 $OUT/t1.log $OUT/t2.log $OUT/t3.log
cat $OUT/t1.log $OUT/t2.log $OUT/t3.log > $OUT/pytest_gpu.log; rm $OUT/t1.log $OUT/t2.log $OUT/t3.log
python3 .cache/mhc_ab/ab.py .cache/mhc_ab/mhc_norm_old.py $OUT/ab.json 2>&1 | tee $OUT/ab.log | grep -v Warning
echo "total: $(( $(date +%s) - T0 ))s"
