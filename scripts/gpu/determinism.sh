# scripts/gpu.sh phases, area determinism: the deterministic mode's exactness and cost (issue 17).
# Sourced by scripts/gpu.sh (the driver): each phase_NAME writes under $PHASE_DIR (= $OUT/NAME).

phase_determinism() {  # issue 17 (<= 3 min): the mode's gpu tests, then how many of 24 greedy answers change
    # under load without and with the mode (tools/det_drift.py; JSON per mode). Expect the tests to pass and
    # drift_det.json changed_tokens = changed_logprobs = 0; drift_default.json is the default mode's count.
    python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --timeout=150 tests/server/test_deterministic_gpu.py \
        tests/kernels/test_batch_invariant.py --junitxml="$PHASE_DIR/junit.xml"
    timeout 60 python3 tools/det_drift.py --json "$PHASE_DIR/drift_default.json"
    timeout 60 python3 tools/det_drift.py --deterministic --json "$PHASE_DIR/drift_det.json"
}

phase_det_cost() {  # issue 17 (<= 4 min): rank4 and tiny goodput without / with the mode, A/B in one job
    local det="import sys, mini.ops; mini.ops.set_deterministic(True); from mini.cli import main; sys.exit(main())"
    timeout 95 mini bench rank4 --steps 5 --warmup 1 --json "$PHASE_DIR/rank4_default.json"
    timeout 95 python3 -c "$det" bench rank4 --steps 5 --warmup 1 --json "$PHASE_DIR/rank4_det.json"
    timeout 35 mini bench tiny-goodput --json "$PHASE_DIR/goodput_default.json"
    timeout 35 mini bench tiny-goodput --deterministic --json "$PHASE_DIR/goodput_det.json"
}

phase_det_profile() {  # issue 17 item 4 (<= 200 s): where the deterministic mode's cost goes on rank4 (one build):
    # the stage table and top kernels without / with the mode side by side, the GEMMs the mode sends to aten
    # (shape, calls per step), each timed cuBLAS vs the batch-invariant kernel (TFLOP/s), a tile sweep per weight
    # shape (N, K) with the best fixed config and a TUNED table to paste, and whether FlashMLA's sparse prefill is
    # row-invariant (bitwise). Look at out.log: "det-def" column, "per step: cuBLAS X ms, batch-invariant Y ms",
    # the sweep lines; det_profile.json holds all of it.
    timeout 195 python3 tools/det_profile.py --out "$PHASE_DIR"
}

phase_det_final() {  # issue 17 item 4 (<= 280 s): the deterministic mode's cost, A/B in one job (the mode's
    # default now sends multi-token chunks to FlashMLA; TUNED's TMA kernels and the fp32 FMA-chain head kernel from
    # phase det_gemm). 1. gpu tests: every TUNED tile (TMA ones too), the fp32 few-rows kernel and the grouped
    # output projection's bmm (TMA, groups side by side) keep a row's bits alone / among 1..4,096 rows; FlashMLA
    # rows alone == among load == chunked; the overrides.
    # 2. rank4 in ONE process (one build): default and det each profiled (stage tables side by side), then 4
    # interleaved rounds x 2 timed steps of each (8 steps per mode). 3. tiny goodput without / with
    # --deterministic, 5 bursts each (metrics over bursts 2-5). Look at: "passed"; "rank4 A/B interleaved" (det's
    # median per-round ratio to default: target <= 1.10); the stage table; the goodput lines (TPOT p50, req/s,
    # failed 0).
    local rc=0 f
    # -v: each result as it completes (a cut run still says which passed)
    timeout 70 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
        tests/kernels/test_batch_invariant.py::test_every_weight_shape_config_keeps_rows_invariant_gpu \
        tests/kernels/test_batch_invariant.py::test_fp32_small_rows_tile_equals_the_default_tile_gpu \
        tests/kernels/test_batch_invariant.py::test_grouped_out_proj_rows_invariant_gpu \
        tests/ops/test_deterministic_attention.py \
        tests/kernels/test_batch_invariant.py::test_overrides_make_cuda_gemms_batch_invariant \
        --junitxml="$PHASE_DIR/junit.xml" 2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" || rc=1
    # ~100 s at 56388c4 with three modes (a 30 s build; det-triton, 574 ms a step, is left out now)
    timeout 130 python3 tools/det_profile.py --modes default,det --gemms none --steps 2 --profile-steps 1 \
        --ab-rounds 4 --ab-steps 2 --out "$PHASE_DIR" || rc=1
    # 60 s each: a server start with its warm-up takes ~10 s before the bench
    timeout 60 mini bench tiny-goodput --repeat 5 --json "$PHASE_DIR/goodput_default.json" \
        >"$PHASE_DIR/goodput_default.log" 2>&1 || rc=1
    timeout 60 mini bench tiny-goodput --repeat 5 --deterministic --json "$PHASE_DIR/goodput_det.json" \
        >"$PHASE_DIR/goodput_det.log" 2>&1 || rc=1
    for f in "$PHASE_DIR"/goodput_*.json; do
        python3 -c "import json, sys; m = json.load(open(sys.argv[1]))['metrics']; print(sys.argv[1], \
{k: round(v, 3) for k, v in m.items() if k in ('tpot_p50_ms', 'tpot_p99_ms', 'ttft_p50_ms', 'output_tok_s', \
'request_throughput', 'goodput_req_s', 'failed')})" "$f" || rc=1
    done
    return $rc
}

phase_det_ab() {  # issue 17 item 4 (<= 330 s): the mode's decode cost with the scheduling held fixed, then tiny
    # goodput interleaved. 1. decode-host: batch-64 tiny-v4.1 decode steps (graphs + overlap, as `mini serve`),
    # without / with the mode, 3 interleaved rounds, medians (decode_host.json): step_ms and gpu_ms per mode.
    # 2. tiny goodput default, det, default, det (5 bursts each; goodput_{default,det}_{1,2}.json): a burst's TPOT
    # also moves with where the prefill chunks land (the mode fixes them per prompt), so look at request_throughput
    # and at ttft + 63 * tpot beside TPOT p50.
    local rc=0 r f
    timeout 130 mini bench decode-host --modes graphs+overlap,graphs+overlap+det --rounds 3 \
        --json "$PHASE_DIR/decode_host.json" 2>&1 | tail -14 || rc=1
    for r in 1 2; do
        timeout 50 mini bench tiny-goodput --repeat 5 --json "$PHASE_DIR/goodput_default_$r.json" \
            >"$PHASE_DIR/goodput_default_$r.log" 2>&1 || rc=1
        timeout 50 mini bench tiny-goodput --repeat 5 --deterministic --json "$PHASE_DIR/goodput_det_$r.json" \
            >"$PHASE_DIR/goodput_det_$r.log" 2>&1 || rc=1
    done
    for f in "$PHASE_DIR"/goodput_*.json; do
        python3 -c "import json, sys; m = json.load(open(sys.argv[1]))['metrics']; print(sys.argv[1].rsplit('/', 1)[1], \
{k: round(m[k], 3) for k in ('tpot_p50_ms', 'ttft_p50_ms', 'request_throughput', 'failed')}, \
'ttft+63*tpot', round(m['ttft_p50_ms'] + 63 * m['tpot_p50_ms'], 1))" "$f" || rc=1
    done
    return $rc
}

phase_det_gemm() {  # issue 17 item 4 (<= 170 s, no model build): the batch-invariant GEMM's kernel variants at the
    # rank4 step's GEMM shapes (tools/det_profile.py --variants-only: TMA descriptors, persistent, flattened
    # persistent, 128x256 tiles for bf16; 16-row tiles and the FMA-chain "fma-rows" kernel for the fp32 head at 1
    # and 16 rows),
    # each timed (ms, TFLOP/s) next to cuBLAS and the current kernel, with its fp32 sums compared bit for bit with
    # the current kernel's (fp32: with the default 64x64 tile's, rows alone too). First the gpu test of the new
    # fp32 small-row tile. Look at: "passed"; the "shape ..." lines (cuBLAS, current), per "variant ..." one line
    # per shape ("same bits: True/False" or "failed: ..."), the "best per shape with the current kernel's bits"
    # table and the closing "per step over these shapes" line.
    local rc=0
    timeout 40 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
        tests/kernels/test_batch_invariant.py::test_fp32_small_rows_tile_equals_the_default_tile_gpu \
        --junitxml="$PHASE_DIR/junit.xml" 2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" || rc=1
    timeout 150 python3 tools/det_profile.py --variants-only --out "$PHASE_DIR" || rc=1
    return $rc
}
