# scripts/gpu.sh phases, area serving: the tiny model served: decode host share, goodput (warm and cold), grammar TPOT.
# Sourced by scripts/gpu.sh (the driver): each phase_NAME writes under $PHASE_DIR (= $OUT/NAME).

phase_decode_host() {  # host vs GPU share of a batch-64 decode step (~115 s): tiny-v4.1 eager / graphs /
    # graphs+overlap, tiny-v4 graphs / graphs+overlap
    local rc=0
    python3 -m mini.cli bench decode-host --json "$PHASE_DIR/decode_host_v41.json" || rc=$?
    python3 -m mini.cli bench decode-host --model tiny-v4 --modes graphs,graphs+overlap \
        --json "$PHASE_DIR/decode_host_v4.json" || rc=$?
    return $rc
}

phase_goodput() {  # tiny-v4.1 behind `mini serve`, 64 requests x 128 in / 64 out, burst (~45 s; the serve wheels)
    python3 -m mini.cli bench tiny-goodput --backend fast --num-requests 64 --input-len 128 --output-len 64 \
        --json "$PHASE_DIR/goodput.json"
}

phase_goodput_cold() {  # issue 15 (<= 2 min): the goodput workload above from a fresh `mini serve` process with an
    # empty Triton cache, 3 bursts: the first burst (first_*) apart from the median of the two after it. The server
    # warms up before /health answers (its start-up line in the log says how long). Expect failed 0 and
    # first_ttft_p50_over_warm <= 1.2 in goodput_cold.json (before warm-up: TTFT p50 1,878 vs 270 ms; the first
    # warm-up 1,056 vs 410 ms; the specialization warm-up at 6deedfb: 231 vs 305, see phase_cold_diag).
    TRITON_CACHE_DIR=$(mktemp -d) timeout 115 python3 -m mini.cli bench tiny-goodput --backend fast \
        --num-requests 64 --input-len 128 --output-len 64 --repeat 3 --json "$PHASE_DIR/goodput_cold.json"
}

phase_cold_diag() {  # issue 15 (<= 2 min): phase_goodput_cold with the server's warm-up trace (MINI_WARMUP_TRACE,
    # mini/engine/warmup_trace.py): Triton JIT compiles (kernel, specialization key, seconds), graph captures, steps
    # (shape, seconds) and allocator growth, in the warm-up and in each burst. The bench prints one line per part
    # and puts the summary under cold_diag in goodput_cold.json: compare bursts[0] (compiled_kernels, compile_keys,
    # slowest_steps, step_s, engine_ttft_p50_s, first_add_after_s, gc_full) with the others; trace.jsonl has every
    # event. 5 bursts: the warm median is of 4. At 28589aa (first warm-up): first/warm 3.82, burst 0 compiled
    # _sparse_mla_kernel (block-table stride 1) in a 0.89 s step; at 6deedfb: 0.76, no compile after the warm-up
    # (7.4 s), a 0.19 s full GC in burst 1 (freeze_heap since c1251f5). Expect first_ttft_p50_over_warm <= 1.2,
    # 0 compiles and 0 full GCs in every burst.
    MINI_WARMUP_TRACE="$PHASE_DIR/trace.jsonl" TRITON_CACHE_DIR=$(mktemp -d) timeout 115 \
        python3 tools/goodput_cold_diag.py --backend fast --num-requests 64 --input-len 128 --output-len 64 --repeat 5 \
        --json "$PHASE_DIR/goodput_cold.json"
}

phase_grammar() {  # issue 14 (<= 2 min): batch-64 decode TPOT of tiny-v4.1 (graphs + overlap): plain, a JSON schema
    # on every request (masks filled on the worker thread), and the same with every fill on the engine's thread (as
    # before the worker), 5 alternating rounds each (tools/grammar_tpot.py; needs the llguidance wheel in
    # .whl/serve). Then the grammar gpu tests. Expect in grammar.json: slowdown <= 0.10 (0.54 before the worker,
    # 0.019 at 28589aa), slowdown_sync ~0.17, schema_grammar_background 1.0, schema_grammar_exposed_ms well under
    # schema_sync_grammar_exposed_ms (0.52 vs 0.83 at 28589aa); then 1 passed. 5 rounds: at 28589aa one round of 3
    # was slow for both schema kinds alike (mask times unchanged), so the median wants more rounds.
    timeout 130 python3 tools/grammar_tpot.py --rounds 5 --json "$PHASE_DIR/grammar.json"
    python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --timeout=40 tests/engine/test_grammar.py \
        --junitxml="$PHASE_DIR/junit.xml"
}

phase_spec_gpu() {  # issue 27 (<= 3 min, not yet run): the eager speculative path on CUDA. The gpu test: tiny-v4.1-dspark
    # in bf16 under the deterministic kernels, speculation with an oracle drafter (every accept length 0..5) and with
    # DSpark == plain decode (graphs + overlap, and eager), tokens and logprobs; rejection sampling's verdicts on CUDA
    # == the CPU's (test_speculative_sampling); expect 2 passed. Then `mini generate`
    # with and without --speculative dspark (random weights accept almost nothing: the tok/s lines show the eager
    # verify's overhead, not a speed-up).
    local rc=0
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_speculative.py \
        tests/engine/test_speculative_sampling.py 2>&1 | tee "$PHASE_DIR/pytest.txt"
    rc=${PIPESTATUS[0]}
    for spec in "" "--speculative dspark"; do
        # shellcheck disable=SC2086
        python3 -m mini.cli generate --model tiny-v4.1-dspark --prompt "Hello, mini" --max-tokens 128 --ignore-eos \
            $spec >>"$PHASE_DIR/generate.txt" 2>&1 || rc=$?
    done
    return $rc
}

phase_verify_graphs() {  # issue 27 item 4 (<= 5 min, not yet run): speculative verify steps replaying CUDA graphs, one
    # per (bucket, 1 + k), and DSpark's draft step after them (a write graph per (bucket, width), a draft graph per
    # bucket). gpu tests: test_verify_graphs (the oracle drafter, draft lengths that differ within a step: verify
    # graphs == enforce_eager == plain decode's tokens; every (bucket, width) captured), test_draft_graphs (DSpark
    # drafting on graphs == enforce_eager == plain decode, draft graphs replayed, the same drafts; under the oracle
    # its rings equal enforce_eager's after every step), test_decode_graphs (decode graphs unchanged),
    # test_speculative's (oracle and DSpark on graphs == plain decode; its engines now replay verify and draft
    # graphs); expect 4 passed. Then `mini generate --speculative dspark` (graphs) for its tok/s.
    local rc=0
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_verify_graphs.py tests/engine/test_draft_graphs.py \
        tests/engine/test_decode_graphs.py tests/engine/test_speculative.py 2>&1 | tee "$PHASE_DIR/pytest.txt"
    rc=${PIPESTATUS[0]}
    python3 -m mini.cli generate --model tiny-v4.1-dspark --prompt "Hello, mini" --max-tokens 128 --ignore-eos \
        --speculative dspark >>"$PHASE_DIR/generate.txt" 2>&1 || rc=$?
    return $rc
}

phase_forced_drafts() {  # issue 27 item 4 (<= 2 min, not yet run): tokens a grammar forces verified as drafts on
    # CUDA, speculation off: decode graphs + overlap with eager verify steps between them == the engine without
    # forced drafts (tiny-v4.1 bf16, deterministic kernels, five forced tool calls: tokens and logprobs, <= 4 steps
    # instead of 40); test_grammar's gpu test (graphs vs overlap, forced drafts off); expect 2 passed.
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_forced_drafts.py \
        tests/engine/test_grammar.py 2>&1 | tee "$PHASE_DIR/pytest.txt"
    return "${PIPESTATUS[0]}"
}

phase_spec_tiny() {  # issue 27 item 6 (<= 150 s, not yet run): tiny-v4.1-dspark behind `mini serve`, goodput's workload
    # (64 requests x 128 in / 64 out, burst) without and with --speculative dspark, one server each (`mini bench
    # spec-decode --tiny`). Its random draft module accepts what it accepts (spec_tokens_per_verify in the JSON):
    # this measures speculation's overhead where drafts fail, not a speed-up. At cf296d6 (no acceptance rule):
    # 0.35x plain's output tok/s, 17,717 drafted / 313 accepted. With the acceptance rule (default on since
    # 3318458) drafts should fall to ~10-12 per request; SPEC_TINY_ARGS=--no-spec-adaptive runs without it.
    # Look at: spec_tiny.json metrics speculative_over_plain.{output_tok_s, goodput_req_s, tpot_p50_ms},
    # speculative.spec_*, and where each server's time went: {plain,speculative}.steps_KIND / step_ms_KIND (KIND
    # prefill, decode, verify: a step() call's mean host ms, with overlap about one step's period).
    python3 -m mini.cli bench spec-decode --tiny --tiny-args "--backend fast --num-requests 64 --input-len 128 \
        --output-len 64 ${SPEC_TINY_ARGS:-}" --json "$PHASE_DIR/spec_tiny.json" >"$PHASE_DIR/spec_tiny.log" 2>&1
    local rc=$?
    grep -E "Error|error:|^mini bench:" "$PHASE_DIR/spec_tiny.log" | tail -5
    grep -E "^  (plain|speculative|speculative_over_plain)\.(output_tok_s|goodput_req_s|tpot_p50_ms|spec_|steps_|step_ms_)" \
        "$PHASE_DIR/spec_tiny.log" | tr -s ' ' | paste -sd' '
    return $rc
}

phase_spec_overhead() {  # issue 27 (<= 200 s, not yet run): where speculation's time goes where drafts fail, offline
    # on tiny-v4.1-dspark (64 x 128 in / 64 out, burst; tools/spec_step_counts.py): plain, dspark as served, and
    # dspark without its ring writes after draft-free steps / without probes / with a fresh α each run (diagnostics),
    # each warmed up as served, then 3 timed runs. Look at: spec_overhead.json runs[].output_tok_s, ms_by_kind,
    # steps_by_kind (per kind: step_ms = ms / steps).
    python3 tools/spec_step_counts.py --device cuda --repeat "${SPEC_OVERHEAD_REPEAT:-3}" \
        --variants "${SPEC_OVERHEAD_VARIANTS:-plain,dspark,no-ring-writes,no-probes,fresh-alpha}" \
        --json "$PHASE_DIR/spec_overhead.json"
}
