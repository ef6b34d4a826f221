export PYTHONPATH=$PWD; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 95 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_gemv.py -k "mma or gluon or regs" -x 2>&1 | tail -12
timeout 115 python3 -m mini.bench.kernels --only decode_gemv_fp8 --json $OUT/gemv_fp8.json > $OUT/bench.log 2>&1
grep -E "^\{" $OUT/bench.log | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(f\"{r['kernel'][15:]:34s} {r['config'][:34]:34s} {r['us']:6.1f} {r['frac_copy_peak']:.2f} {r['same_as_copy']:.3f} {r['max_rel_err']:.0e}\")"
grep -iE "error|Traceback" $OUT/bench.log | head -5
timeout 30 python3 tools/wo_a_study.py --rows 6,16 --json $OUT/wo_a.json 2>&1 | tail -14
