# scripts/gpu.sh phases, area rank4: one EP4 rank at real V4.1-Flash shape (mini bench rank4 / rank4-decode /
# long-context, mini profile).
# Sourced by scripts/gpu.sh (the driver): each phase_NAME writes under $PHASE_DIR (= $OUT/NAME).

phase_rank4_ab() {  # rank4 A/B of two revisions, interleaved (~100 s a run): first `python3 tools/bench_rev.py
    # pack BASE HEAD` here, then carry .cache/bench_rev (no .git on the device). AB_REPEAT runs per revision;
    # AB_SUITE another suite (e.g. rank4-decode, ~75 s a run at --batch 1,16,64 --context 4096) with AB_ARGS its
    # options. AB_REV_ARGS: bench_rev's own flags, e.g. "--env-b MINI_MOE_GEMM=triton" (a switch's A/B: with only
    # HEAD.tar.gz carried, both sides run HEAD). AB_A / AB_B: the two tarballs' names (several packed revisions).
    local a b=.cache/bench_rev/${AB_B:-HEAD}.tar.gz
    a=$(ls .cache/bench_rev/*.tar.gz 2>/dev/null | grep -v '/HEAD\.tar\.gz$' | head -1)
    [ -n "${AB_A:-}" ] && a=.cache/bench_rev/$AB_A.tar.gz
    [ -z "$a" ] && [ -n "${AB_REV_ARGS:-}" ] && a=$b
    if [ -z "$a" ] || [ ! -f "$b" ]; then
        echo "rank4_ab: no tarballs; run 'python3 tools/bench_rev.py pack BASE HEAD' and carry .cache/bench_rev"
        return 2
    fi
    # shellcheck disable=SC2086
    python3 tools/bench_rev.py run "$a" "$b" --suite "${AB_SUITE:-rank4}" --repeat "${AB_REPEAT:-1}" \
        --out "$PHASE_DIR" ${AB_REV_ARGS:-} -- ${AB_ARGS:---steps 5 --warmup 1}
}

phase_profile() {  # rank4 per stage (~60 s at 5 steps): rank4.json, profile.json (the bundle leaves out trace.json.gz)
    python3 -m mini.cli profile --suite rank4 --steps "${PROFILE_STEPS:-5}" --warmup 1 --out "$PHASE_DIR"
}

phase_profile_skewed() {  # issue 13 item 4 (<= 80 s): rank4 per stage with --routing skewed (GPU Engram tables, one
    # reused batch): with a default-mode stage table of the same call (phase det_final's "default" column, or
    # phase_profile) it says which stages the skewed routing of the realistic mode slows (routed experts' Humming
    # GEMMs, expected: the busiest local expert takes 709 pairs vs 504 uniform). Look at: profile.json stages.
    timeout 75 python3 -m mini.cli profile --suite rank4 --routing skewed --steps 5 --warmup 1 --out "$PHASE_DIR" \
        >"$PHASE_DIR/profile.log" 2>&1
    local rc=$?
    grep -E "Error|error:" "$PHASE_DIR/profile.log" | tail -3
    tail -30 "$PHASE_DIR/profile.log"
    return $rc
}

phase_rank4_modes() {  # issue 13 items 2-3 (<= 4 min): rank4 with --routing uniform, then skewed (RoutingSkew in
    # mini/testing/emulated_ep.py: hot experts at 2.5x the mean, this rank 16 of the 48 hot ones), each its own process
    # (~35 s build + 12 steps). MINI_MOE_GEMM=humming unless set: a run without the carried wheels refuses (exit 2,
    # naming what is missing) instead of reporting Triton GEMMs under the same name. Look at: rank4_*.json metrics
    # mean/median_step_ms and pairs_per_local_expert_{min,median,mean,max} (skewed: max ~700, mean ~274 at seed 0),
    # definition.routing, env.backends (moe_gemm humming, sparse_attn flashmla).
    local rc=0 mode
    for mode in uniform skewed; do
        MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 115 python3 -m mini.cli bench rank4 --routing "$mode" \
            --steps 10 --warmup 2 --json "$PHASE_DIR/rank4_$mode.json" >"$PHASE_DIR/rank4_$mode.log" 2>&1 || rc=1
        tail -12 "$PHASE_DIR/rank4_$mode.log"
    done
    return $rc
}

phase_rank4_decode() {  # issue 13 item 5 (<= 200 s): decode of one EP4 rank at real V4.1-Flash shape, CUDA graphs,
    # B in {64, 256} x contexts {4K, 32K} (random cache contents; RANK4_DECODE_BATCH / RANK4_DECODE_CONTEXT pick
    # others), one build (~35 s) for the four. Look at:
    # rank4_decode.json metrics b256_c32768.{ms_per_step, tok_per_s_per_gpu, floor_ms, vs_floor} (target vs_floor
    # <= 1.5; the floor is ~21-23 ms at B = 256), stage_ms.* (eager steps), peak_mem_gb, touched_local_experts.
    MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 190 python3 tools/rank4_decode_floor.py --batch "${RANK4_DECODE_BATCH:-64,256}" \
        --context "${RANK4_DECODE_CONTEXT:-4096,32768}" --steps 10 --warmup 3 --profile-steps 2 --json "$PHASE_DIR/rank4_decode.json" \
        >"$PHASE_DIR/rank4_decode.log" 2>&1
    local rc=$?
    grep -E "Error|error:|^tools/rank4_decode_floor.py:" "$PHASE_DIR/rank4_decode.log" | tail -5
    grep -E "^  (setup_s|built_mem_gb|b[0-9]+_c[0-9]+\.(peak_mem_gb|touched_local_experts)) " \
        "$PHASE_DIR/rank4_decode.log" | tr -s ' ' | paste -sd' '
    grep "^rank4-decode B=" "$PHASE_DIR/rank4_decode.log"  # one line per shape: ms/step, tok/s/GPU, vs the floor
    return $rc
}

phase_spec_decode() {  # issue 27 item 6 (<= 200 s, not yet run): speculation's speed at real V4.1-Flash width, one
    # emulated EP4 rank, random weights, so acceptance is EMULATED (2.0 / 2.8 / 3.5 tokens per verify step). One
    # build (~35 s + DSpark's 3 stages), then per B in SPEC_DECODE_BATCH (1,64,16,256: the targets first; a run cut
    # by the cap keeps the lines printed so far, but no JSON) at 4K: the plain decode graph (B rows), the verify
    # step's graph (B sequences x 6 rows), the verify PROXY's graph (B x 6 sequences; over-counts attention),
    # DSpark's draft step (propose in a CUDA graph where capture works: draft_graph 1, else eager and
    # raw.*.draft.draft_graph_refused says why); each graph an eager warm-up, a capture, 2 + 6 replays (~10-20 s a
    # shape, guessed from rank4_decode's 86 s for B = 1, 16 with its build: the four B may not all fit; then run
    # SPEC_DECODE_BATCH=1,64 and 16,256 apart, or SPEC_DECODE_ARGS=--no-proxy). Look at: the "spec-decode B=" lines
    # (decode / draft / verify / verify_proxy ms and the speed-ups per user; targets B = 1 >= 2.0x at 2.8, B = 64
    # >= 1.3x, B = 256 >= 1x),
    # spec_decode.json metrics b*_c4096.{verify_over_decode, draft_ms, draft_graph, verify.emulated_accept_*.speedup,
    # meets_target} and the same for verify_proxy.
    MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 190 python3 -m mini.cli bench spec-decode \
        --batch "${SPEC_DECODE_BATCH:-1,64,16,256}" --context "${SPEC_DECODE_CONTEXT:-4096}" --steps 6 --warmup 2 \
        ${SPEC_DECODE_ARGS:-} --json "$PHASE_DIR/spec_decode.json" >"$PHASE_DIR/spec_decode.log" 2>&1
    local rc=$?
    grep -E "Error|error:|^mini bench:" "$PHASE_DIR/spec_decode.log" | tail -5
    grep -E "^  (setup_s|built_mem_gb|b[0-9]+_c[0-9]+\.(peak_mem_gb|draft_graph)) " "$PHASE_DIR/spec_decode.log" \
        | tr -s ' ' | paste -sd' '
    grep "^spec-decode B=" "$PHASE_DIR/spec_decode.log"  # one line per B: its steps and the speed-ups
    return $rc
}

phase_capture_time() {  # issue 28 (on an H100 with the build: decode only 103 s, docs/perf/042; K = 5 145-220 s,
    # docs/perf/043: cap it at 300): the engine's start-up graph capture at V4.1 width (tools/graph_capture_time.py:
    # every bucket of max_num_seqs 64, widths 1..6, the five spans of a 1M max_model_len; CAPTURE_ARGS adds flags,
    # e.g. "--ep 8" on an H100, "--spec-tokens 0" for decode only), one span at a time, the longest first (with
    # K = 5 the 1M span's verify graphs ran an H100's EP8 rank out of memory before 2799a77, and fit after it).
    # Look at: the "graph-capture-time span" lines (graphs and seconds per span), the total, the pool's GiB and the
    # B = 64 replay per span.
    MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout $(( ${PHASE_CAP:-150} - 5 )) python3 tools/graph_capture_time.py \
        --spec-tokens 5 --steps 5 ${CAPTURE_ARGS:-} --json "$PHASE_DIR/capture_time.json" \
        >"$PHASE_DIR/capture_time.log" 2>&1
    local rc=$?
    grep -E "Error|error:" "$PHASE_DIR/capture_time.log" | tail -5
    grep "^graph-capture-time" "$PHASE_DIR/capture_time.log"
    return $rc
}

phase_draft_census() {  # issue 27 (<= 150 s, one build ~35 s + DSpark's stages): DSpark's draft step by kernel
    # (tools/draft_census.py: spec-decode's DraftStep, the ring write and the proposal in CUDA graphs, the proposal
    # under torch.profiler) at B in DRAFT_CENSUS_BATCH, 4K. Look at: the "draft-census B=" lines (write / propose ms,
    # the proposal's 25 longest kernels with launches per step), draft_census.json's b*.propose.kernel_ms.*.
    MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 140 python3 tools/draft_census.py \
        --batch "${DRAFT_CENSUS_BATCH:-1,64}" --context 4096 --steps 10 --warmup 3 ${DRAFT_CENSUS_ARGS:-} \
        --json "$PHASE_DIR/draft_census.json" >"$PHASE_DIR/draft_census.log" 2>&1
    local rc=$?
    grep -E "Error|error:" "$PHASE_DIR/draft_census.log" | tail -5
    grep "^draft-census B=" "$PHASE_DIR/draft_census.log"
    return $rc
}

phase_step_census() {  # issues 27/28 (65-128 s on an H100 at --ep 8, docs/perf/049; cap it at 150): every kernel
    # of the B = 1 verify (6 rows) and decode steps at 4K by the source line that launched it, and each Triton kernel's
    # time in the step's graph against its launches replayed alone (tools/decode_op_census.py --alone; a kernel far
    # slower in the step has its code or operands fetched cold there). STEP_CENSUS_ARGS adds flags, e.g. "--ep 8" on
    # an H100. Look at: the "rank 0:" lines (kernels counted against the profiler's eager and graph counts, the
    # replay's ms), the "in step ... alone" table, the "by caller" tables (fusion's worklist), step_census.json.
    MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout $((PHASE_CAP - 5)) python3 tools/decode_op_census.py \
        --shapes "${STEP_CENSUS_SHAPES:-1x4096}" --widths "${STEP_CENSUS_WIDTHS:-6,1}" --top 70 --alone ${STEP_CENSUS_ARGS:-} \
        --json "$PHASE_DIR/step_census.json" >"$PHASE_DIR/step_census.log" 2>&1
    local rc=$?
    grep -E "Error|error:" "$PHASE_DIR/step_census.log" | tail -5
    grep "rank 0:" "$PHASE_DIR/step_census.log"
    return $rc
}

phase_rank4_decode_split() {  # issue 13 item 5 (<= 90 s): where the B = 256 x 32K decode step's time goes: the
    # shape alone (one build), its graph replays under torch.profiler, kernels grouped into parts (kernel_ms.*:
    # moe_experts, sparse_attention, indexer, gemm, gate_route, mhc_norm, quant_rope, copies, other; they add up to
    # the step less its gaps). 13:05 run: 90.3 ms/step vs a 22.3 ms floor. Look at: the kernel lines (8 longest) and kernel_ms.*.
    MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 85 python3 tools/rank4_decode_floor.py --batch 256 \
        --context 32768 --steps 10 --warmup 3 --profile-steps 0 --kernel-split-steps 2 \
        --json "$PHASE_DIR/rank4_decode_split.json" >"$PHASE_DIR/rank4_decode_split.log" 2>&1
    local rc=$?
    grep -E "Error|error:|^tools/rank4_decode_floor.py:|kernel split|saw no kernel" \
        "$PHASE_DIR/rank4_decode_split.log" | tail -5
    grep "^rank4-decode B=" "$PHASE_DIR/rank4_decode_split.log"
    grep -E "^  b256_c32768\.kernel_ms\." "$PHASE_DIR/rank4_decode_split.log" | tr -s ' ' | paste -sd' '
    return $rc
}

phase_attn_sweep() {  # issue 13 item 5 (<= 140 s): the Triton sparse attention's d_split=2 build (the default since
    # 7298590's run: two programs per token and head tile, each with half the fp32 accumulator; sm_90a: 0 spills vs
    # ~2 KB/thread for d_split=1) and launch shapes, BLOCK_N fixed (the softmax block), at decode B = 256 / 64 x 32K
    # and prefill 4,096 with the model's RoPE epilogue (tools/attn_sweep.py). First the gpu tests (<= 40 s):
    # d_split=2 == d_split=1 bit for bit at 7 shapes (decode, prefill, odd heads / windows / top-k, D 128), near
    # the reference op. At 7298590: 7 passed; d_split=2 vs 1: 1.51x at B=256, 1.23x at B=64, 1.61x prefill, same bits.
    # Look at: "N passed" (7); per case the "d_split=1 (8 warps, 2 stages)" line (speedup < 1, same_bits=True) and
    # the "best same-bits config" lines. Only same_bits=True configs that are faster may become defaults.
    timeout 40 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -rfE tests/kernels/test_sparse_attention.py \
        -k d_split >"$PHASE_DIR/tests.log" 2>&1
    local trc=$?
    grep -E "passed|failed|FAILED|Error" "$PHASE_DIR/tests.log" | tail -6
    timeout 100 python3 tools/attn_sweep.py --json "$PHASE_DIR/attn_sweep.json" >"$PHASE_DIR/attn_sweep.log" 2>&1
    local rc=$?
    grep -E "^best|^d_split=1|Error" "$PHASE_DIR/attn_sweep.log" | tail -12
    [ $trc -ne 0 ] && return $trc
    return $rc
}

phase_long_context() {  # issue 13 item 6 (<= 200 s): one 131,072-token prompt prefilled in 4,096-token chunks on one
    # EP4 rank at real V4.1-Flash shape, all 40 layers (~35 s build + 32 chunks); at chunk 2,048 if 4,096 fails
    # (not on the time limit). Look at: long_context.json total_s, tok_per_s, first/median/last_chunk_ms,
    # peak_mem_gb, written_bytes_per_token vs predicted_bytes_per_token (3,240 bf16: 3,200 per token + the rings),
    # pools_with_unexpected_rows (0), full_kv_over_predicted (~12.6).
    local rc chunk
    for chunk in 4096 2048; do
        MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 150 python3 tools/long_context_cache.py --chunk "$chunk" \
            --json "$PHASE_DIR/long_context.json" >"$PHASE_DIR/long_context_$chunk.log" 2>&1
        rc=$?
        grep -E "Error|error:|^tools/long_context_cache.py:" "$PHASE_DIR/long_context_$chunk.log" | tail -3
        grep -E "^  (prompt_tokens|total_s|tok_per_s|(first|median|last)_chunk_ms|peak_mem_gb|built_mem_gb|\
predicted_bytes_per_token|written_bytes_per_token|pools_with_unexpected_rows|full_kv_over_predicted) " \
            "$PHASE_DIR/long_context_$chunk.log" | tr -s ' ' | paste -sd' '
        { [ $rc -eq 0 ] || [ $rc -eq 124 ]; } && break
    done
    return $rc
}

phase_rank4_real() {  # issue 13 items 1-3 (~120 s): the host-table gpu test (~20 s: prefetched rows through the
    # side-stream copy == the in-place lookup, bitwise; expect 1 passed), then rank4's workloads on ONE build
    # (tools/rank4_modes.py: the model is drawn once, ~35 s; each workload 10 steps after 2 warm-up):
    # uniform (GPU Engram 2^20 rows, one reused batch: the workload of earlier revisions), uniform_host (the same
    # with the Engram tables on the host: the placement's A/B alone), realistic (host Engram tables pinned, 2 x 96M
    # rows = 53.1 GB, a fresh batch every step, skewed routing). RANK4_REAL_MODES picks workloads,
    # RANK4_ENGRAM_ROWS the host tables' rows. Look at the summary lines: median_step_ms (uniform ~325-330; target
    # realistic <= 300), engram_wait_ms (target <= 2 ms: the forward's host wait for the rows + the GPU stream's
    # stall for their copy), uniform_host - uniform (the visible Engram cost, all of it), host_build_ms and
    # forward_host_ms (fresh batches: the build hides behind the GPU when forward_host_ms + host_build_ms < the step),
    # engram_pin_s / fill_s (setup), engram_pinned 1.
    local rc=0
    timeout 30 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/model/test_engram_host.py \
        --junitxml="$PHASE_DIR/junit.xml" >"$PHASE_DIR/test.log" 2>&1 || rc=1
    tail -3 "$PHASE_DIR/test.log"
    MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 150 python3 tools/rank4_modes.py \
        --modes "${RANK4_REAL_MODES:-uniform,uniform_host,realistic}" --out "$PHASE_DIR" --steps 10 --warmup 2 \
        ${RANK4_ENGRAM_ROWS:+--host-engram-rows $RANK4_ENGRAM_ROWS} >"$PHASE_DIR/rank4.log" 2>&1 || rc=1
    tail -5 "$PHASE_DIR/rank4.log"
    python3 - "$PHASE_DIR" <<'PY' || rc=1
import json, pathlib, sys
keys = ("median_step_ms", "wall_step_ms_median", "engram_wait_ms_median", "engram_wait_ms_max",
        "engram_gpu_wait_ms_median", "engram_host_wait_ms_median", "engram_gather_ms_median", "host_build_ms_median",
        "forward_host_ms_median", "engram_gb", "engram_pinned", "engram_pin_s", "engram_fill_s", "setup_s",
        "peak_mem_gb")
for name in ("uniform", "uniform_host", "realistic"):
    f = pathlib.Path(sys.argv[1]) / f"rank4_{name}.json"
    if not f.exists():
        print(f"{name}: no result (see rank4.log)")
        continue
    m = json.loads(f.read_text())["metrics"]
    print(name + ": " + " ".join(f"{k}={m[k]:.4g}" for k in keys if k in m))
PY
    return $rc
}

phase_decode_parts() {  # issue 28 item 4 (<= 240 s, one build ~35 s): issue 28's target shapes in one process,
    # each with its graph replay's kernels by part (kernel_ms.*) against its floor: B = 256 x 32K, 64 x 4K, 16 x 4K,
    # 1 x 4K (DECODE_PARTS_SHAPES picks others; DECODE_PARTS_ARGS adds flags to both runs, e.g. "--ep 8 --tbps 3.35"
    # on an H100, where EP4's experts do not fit), the largest first.
    # Then the verify step of B = 64 x 6 rows (its own build; DECODE_PARTS_VERIFY=0 skips it,
    # DECODE_PARTS_VERIFY_SHAPES picks others, e.g. 1x4096,64x4096) by part: where a verify row costs more than a
    # decode row.
    # Look at: the "rank4-decode B=" lines, decode_parts.json metrics b*_c*.{ms_per_step, floor_ms, vs_floor,
    # kernel_ms.*}, verify_parts.json b64_c4096.kernel_ms.*.
    local rc=0
    MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 170 python3 tools/rank4_decode_floor.py \
        --shapes "${DECODE_PARTS_SHAPES:-256x32768,64x4096,16x4096,1x4096}" --steps 10 --warmup 3 --profile-steps 0 \
        --kernel-split-steps 2 ${DECODE_PARTS_ARGS:-} --json "$PHASE_DIR/decode_parts.json" >"$PHASE_DIR/decode_parts.log" 2>&1 || rc=1
    grep -E "Error|error:|^tools/rank4_decode_floor.py:" "$PHASE_DIR/decode_parts.log" | tail -5
    grep "^rank4-decode B=" "$PHASE_DIR/decode_parts.log"
    grep -E "^  b[0-9]+_c[0-9]+\.(kernel_ms|kernels_per_step)\." "$PHASE_DIR/decode_parts.log" | tr -s ' ' | paste -sd' '
    if [ "${DECODE_PARTS_VERIFY:-1}" = 1 ]; then
        MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 100 python3 tools/rank4_decode_floor.py \
            --shapes "${DECODE_PARTS_VERIFY_SHAPES:-64x4096}" \
            --width 6 --steps 10 --warmup 3 --profile-steps 0 --kernel-split-steps 2 ${DECODE_PARTS_ARGS:-} \
            --json "$PHASE_DIR/verify_parts.json" >"$PHASE_DIR/verify_parts.log" 2>&1 || rc=1
        grep -E "Error|error:|^rank4-decode B=" "$PHASE_DIR/verify_parts.log" | tail -5
        grep -E "^  b[0-9]+_c[0-9]+\.kernel_ms\." "$PHASE_DIR/verify_parts.log" | tr -s ' ' | paste -sd' '
    fi
    return $rc
}
