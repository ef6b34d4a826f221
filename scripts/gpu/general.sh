# scripts/gpu.sh phases, area general: what machine, every gpu-marked test, the moves and seams of issue 16.
# Sourced by scripts/gpu.sh (the driver): each phase_NAME writes under $PHASE_DIR (= $OUT/NAME).

phase_env() {  # what machine and software the results come from
    { nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
      # the device's .git may predate the tree it was sent (calls carry the working tree, not the commits): the
      # tree's own identity is the hash of its code, `bash scripts/tree_hash.sh` here and on this machine
      echo "git (may be older than the tree): $(git log --oneline -1 2>/dev/null)"
      echo "tree hash: $(bash scripts/tree_hash.sh)"; env | grep '^MINI_'; } >"$PHASE_DIR/env.txt" 2>&1
    cat "$PHASE_DIR/env.txt"
}

phase_gpu_tests() {  # every gpu-marked test (GPU_TEST_PATHS: only those files or folders): GPU_TEST_WORKERS
    # side by side, then the gpu_alone ones (they need the GPU's memory to themselves) one at a time.
    # GPU_TEST_WORKERS (unset: 8 on a card of >= 120 GB, else 3): at most 8 on one H200 (10 ran 11 tests out of GPU
    # memory, docs/perf/027); on an H100 (79 GB) 8 ran 21 out of memory, three workers holding ~24 GB each at once
    # (docs/perf/033). At 8 the whole suite had run 99% in 446 s (docs/perf/026): give it DEADLINE=596 and a cap near
    # 590. At 3 (an H100) it takes two calls split by GPU_TEST_PATHS (docs/perf/034): tests/fuzz (229 s) | every other
    # folder (259 s, then the gpu_alone tests). GPU_TESTS_K: a pytest -k expression (spaces kept), e.g. the fuzzer's
    # seeds a cut run left: GPU_TEST_PATHS=tests/fuzz GPU_TESTS_K="gpu[19] or gpu[20]" (its seeds are 0-31).
    # -v: each result is printed as it completes, so a phase cut by its cap still says what failed; an interrupt
    # 20 s before the cap (PHASE_CAP, set by the driver) makes pytest print the failures' tracebacks it has so far;
    # a module that fails to import is reported and the rest still run (--continue-on-collection-errors: 14 server
    # modules that did not collect once stopped the gpu_alone pass before its first test, docs/perf/034)
    local end=$(( SECONDS + (${PHASE_CAP:-600} > 60 ? ${PHASE_CAP:-600} - 20 : ${PHASE_CAP:-600}) )) rc=0
    local mem_mb workers=${GPU_TEST_WORKERS:-}
    if [ -z "$workers" ]; then
        mem_mb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
        workers=$([ "${mem_mb:-0}" -ge 120000 ] && echo 8 || echo 3)
    fi
    echo "gpu_tests: $workers workers (GPU memory ${mem_mb:-?} MiB)"
    local ignore=""  # tests/server's conftest imports the app: without the server's wheels nothing would collect
    if ! python3 -c "import fastapi" 2>/dev/null; then
        ignore="--ignore=tests/server"; echo "gpu_tests: no fastapi (carry .whl/serve): tests/server left out"
    elif ! python3 -c "import openai" 2>/dev/null; then  # (its wheels do not fit a call's carry beside .whl)
        # the server modules that import the openai client, directly or through test_concurrency, and hold no gpu
        # test, are left out by name; one with a gpu test stays, and its import error shows
        local f
        for f in $(grep -lE "^(import openai|from openai|from test_concurrency)" tests/server/*.py); do
            grep -q "mark.gpu" "$f" || ignore="$ignore --ignore=$f"
        done
        echo "gpu_tests: no openai client (WITH_OPENAI=1 bash scripts/wheels.sh): left out$ignore"
    fi
    timeout -s INT -k 10 $(( end - SECONDS )) \
    python3 -m pytest -v -m "gpu and not gpu_alone" -n "$workers" -p no:cacheprovider -rfE \
        --continue-on-collection-errors --durations=25 --timeout=200 ${GPU_TEST_PATHS:-tests} ${GPU_TESTS_ARGS:-} \
        ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} $ignore --junitxml="$PHASE_DIR/junit.xml" \
        >"$PHASE_DIR/tests.log" 2>&1 || rc=$?
    [ "$rc" = 5 ] && rc=0  # 5: no test collected under these paths
    local rc_alone=0
    timeout -s INT -k 10 $(( end - SECONDS > 1 ? end - SECONDS : 1 )) \
    python3 -m pytest -v -m "gpu and gpu_alone" -p no:cacheprovider -rfE --timeout=200 --continue-on-collection-errors \
        ${GPU_TEST_PATHS:-tests} ${GPU_TESTS_ARGS:-} ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} $ignore \
        --junitxml="$PHASE_DIR/junit_alone.xml" \
        >"$PHASE_DIR/tests_alone.log" 2>&1 || rc_alone=$?
    [ "$rc_alone" = 5 ] && rc_alone=0
    grep -hE "FAILED|ERROR" "$PHASE_DIR/tests.log" "$PHASE_DIR/tests_alone.log" | sort | uniq | head -60
    tail -qn 2 "$PHASE_DIR/tests.log" "$PHASE_DIR/tests_alone.log"
    return $(( rc || rc_alone ))
}

phase_house() {  # issue 16 (<= 4 min): the moves and seams on the GPU. The gpu tests of what moved: the quant
    # toolbox (one e4m3 rounding for act quant, RoPE and mHC kernels), FlashMLA's per-step row lists (wheel in
    # .whl/gpu), Humming's layout adapter, the fast path vs reference check (mini check fastpath), CUDA-graph decode
    # (the runner now decides graphs), overlap; then `mini profile` (stages as named ranges) at 2 steps and a tiny
    # generate whose log names the backends. Expect: every test passed or skipped for a missing wheel only;
    # profile.json stages_ms_per_step with the same keys as report 007's and unattributed_fraction < 0.05;
    # backends.log has one "backends: ops fast, MoE GEMMs ..., sparse attention ..." line.
    local rc=0
    python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --timeout=200 --junitxml="$PHASE_DIR/junit.xml" \
        tests/kernels/test_quant.py tests/kernels/test_fp8_act_quant.py tests/kernels/test_rope_quant.py \
        tests/kernels/test_mhc_norm.py tests/kernels/test_mxfp4_grouped_gemm.py tests/kernels/test_humming_experts.py \
        tests/kernels/test_flashmla_attention.py tests/ops/test_moe.py tests/model/test_fast_path_gpu.py \
        tests/engine/test_decode_graphs.py tests/engine/test_overlap.py || rc=1
    python3 -m mini.cli profile --suite rank4 --steps 2 --warmup 1 --profile-steps 2 --out "$PHASE_DIR/profile" \
        || rc=1
    rm -f "$PHASE_DIR/profile/trace.json.gz"
    python3 - >"$PHASE_DIR/backends.log" 2>&1 <<'PY' || rc=1
import logging
logging.basicConfig(level=logging.INFO)
from mini.engine import LLM, SamplingParams
out = LLM("tiny-v4.1", num_blocks=64, block_tokens=128).generate(["hello"], SamplingParams(max_tokens=4))
print("generated", out[0].token_ids)
PY
    grep -h "backends:" "$PHASE_DIR/backends.log"
    return $rc
}
