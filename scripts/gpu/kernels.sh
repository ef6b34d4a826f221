# scripts/gpu.sh phases, area kernels: kernels and libraries at real shape: MoE layer, gate, Humming, FlashMLA,
# attention side, mHC; fast path.
# Sourced by scripts/gpu.sh (the driver): each phase_NAME writes under $PHASE_DIR (= $OUT/NAME).

phase_moe_layer() {  # one MoE layer at real shape (~50 s; MOE_LAYER_ARGS=--sweep adds the Triton tile sweep, through
    # tools/moe_layer_studies.py)
    if [ -n "${MOE_LAYER_ARGS:-}" ]; then
        python3 tools/moe_layer_studies.py $MOE_LAYER_ARGS --json "$PHASE_DIR/moe_layer.json"
    else
        python3 -m mini.cli bench moe-layer --json "$PHASE_DIR/moe_layer.json"
    fi
}

phase_looped_rows() {  # issue 28 (not yet run; guess <= 90 s): the routed experts' gathered passes (act quant,
    # SwiGLU epilogue, wire decode) looping to the device's row count: their gpu tests (one wave, 1 and 0 programs
    # an SM), then tools/looped_rows_study.py at decode / verify / prefill shapes, a program per capacity tile
    # (per_sm_1000000: the grid before) vs one wave (16, the default), 8, 4. Look at: the us lines per case and
    # bit_equal=True.
    local rc=0
    python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_fp8_act_quant.py \
        tests/kernels/test_mxfp4_grouped_gemm.py tests/ops/test_op_hoist.py -k "gather or wire or swiglu" \
        2>&1 | tail -4 || rc=1
    python3 tools/looped_rows_study.py --json "$PHASE_DIR/looped_rows.json" || rc=1
    return $rc
}

phase_gate() {  # fused gate + Triton routing plan (~100 s): their gpu tests, then new vs old in one process,
    # the gate kernel's configs and fused vs unfused by token count (mini.ops.moe.FUSED_GATE_MIN_TOKENS)
    local rc=0
    python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_moe_gate.py \
        tests/kernels/test_moe_route.py --junitxml="$PHASE_DIR/junit.xml" || rc=$?
    python3 tools/moe_layer_studies.py --only-gate-plan --old-gate-plan --gate-configs \
        --gate-sweep-tokens 1 64 256 1024 4096 16384 --route-blocks 256 512 \
        --json "$PHASE_DIR/gate_plan.json" || rc=$?
    return $rc
}

phase_humming() {  # routed experts on Humming (~270 s on a cold kernel cache): the moe-layer suite with its tile
    # variants, its gpu tests, the suite on our Triton kernels for comparison; the compiled kernels come back as
    # humming_cache.tgz (put it in .whl/ and carry .whl: install_wheels unpacks it)
    local rc=0
    python3 tools/moe_layer_studies.py --moe-gemm humming \
        --humming-tiles ${HUMMING_TILES:-128x4 128x6 192x4 208x3 176x5} \
        --json "$PHASE_DIR/moe_layer_humming.json" || rc=$?
    python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_humming_experts.py \
        tests/ops/test_moe.py -k "humming" --junitxml="$PHASE_DIR/junit.xml" || rc=$?
    python3 -m mini.cli bench moe-layer --moe-gemm triton --json "$PHASE_DIR/moe_layer_triton.json" || rc=$?
    tar czf "$PHASE_DIR/humming_cache.tgz" -C "$HUMMING_CACHE_DIR" . || rc=$?
    return $rc
}

phase_humming_decode() {  # issue 28 (~60-120 s): Humming's expert GEMMs at decode row counts under its heuristic
    # config and hand-made variants (tools/humming_decode_study.py; HUMMING_DECODE_ARGS adds flags). Look at: the
    # us / GB/s lines per case (4x4 ~ B = 1, 96x4 ~ B = 16, 384x4 ~ B = 64 on one emulated EP4 rank) and
    # max_abs_diff (~0: the same sums in another order). A variant that faults ends the phase: run it last.
    python3 tools/humming_decode_study.py ${HUMMING_DECODE_ARGS:-} --json "$PHASE_DIR/humming_decode.json"
}

phase_humming_step() {  # issue 28 (B = 64: 182 s with 10 + 4 variants; B = 1: 125 s with 8, docs/perf/026):
    # Humming's tile variants on the routing a real step records (docs/perf/025: synthetic spreads misled twice).
    # mini bench spec-decode at B = HUMMING_STEP_BATCH (default 64) records each MoE layer's rows per local expert of
    # its decode and verify steps, and DSpark's draft MoE's rows per expert (128); tools/humming_decode_study.py
    # replays them (cases step:b64_c4096.decode / .verify / .draft) under HUMMING_STEP_NAMES' variants, then
    # HUMMING_STEP_MORE's in a second process. Look at: the study's us per case and variant, bit_equal.
    # HUMMING_STEP_SHAPES (e.g. 256x4096,128x4096): rank4-decode's decode steps at those shapes instead (cases
    # step:b256_c4096, ...), for batch sizes no spec-decode run covers
    # HUMMING_STEP_ROUTING: replay a JSON recorded before (e.g. docs/perf/raw/038/verify_parts_b64x6_ep8_h100.json,
    # decode_parts' verify step at one emulated EP8 rank) instead of recording a step (2 + 5 variants: 37 s, H100);
    # HUMMING_STEP_CASES: only those of its cases (e.g. "step:b64_c4096.draft step:b64_c4096.verify")
    local rc=0 routing=${HUMMING_STEP_ROUTING:-$PHASE_DIR/step.json}
    if [ -n "${HUMMING_STEP_ROUTING:-}" ]; then
        echo "humming_step: the routing recorded in $HUMMING_STEP_ROUTING"
    elif [ -n "${HUMMING_STEP_SHAPES:-}" ]; then
        MINI_MOE_GEMM=humming timeout 200 python3 -m mini.cli bench rank4-decode --shapes "$HUMMING_STEP_SHAPES" \
            --steps 2 --warmup 1 --profile-steps 0 --json "$PHASE_DIR/step.json" >"$PHASE_DIR/step.log" 2>&1 || rc=1
        grep "ms/step\|^rank4-decode" "$PHASE_DIR/step.log" | tail -5
    else
        MINI_MOE_GEMM=humming timeout 150 python3 -m mini.cli bench spec-decode --batch "${HUMMING_STEP_BATCH:-64}" \
            --context 4096 --steps 2 --warmup 1 --no-proxy --json "$PHASE_DIR/step.json" >"$PHASE_DIR/step.log" 2>&1 \
            || rc=1
        grep "^spec-decode B=" "$PHASE_DIR/step.log"
    fi
    # shellcheck disable=SC2086
    local cases=${HUMMING_STEP_CASES:+--cases $HUMMING_STEP_CASES}
    python3 tools/humming_decode_study.py --pairs "" --step-routing "$routing" $cases \
        --names ${HUMMING_STEP_NAMES:-stages6 ctas2 bucket16 bucket32 bucket64 bucket512 bucket1024 bucket2048} \
        --json "$PHASE_DIR/humming_step.json" || rc=1
    # hand-made tiles the heuristic never picks (a fault would end the study above): a process of their own
    [ -n "${HUMMING_STEP_MORE:-}" ] && { python3 tools/humming_decode_study.py --pairs "" --step-routing \
        "$routing" $cases --names $HUMMING_STEP_MORE --json "$PHASE_DIR/humming_step_more.json" || rc=1; }
    return $rc
}

phase_wo_a() {  # issue 28 (~30 s): V4.1's block-diagonal wo_a at decode rows (tools/wo_a_study.py): cuBLAS's bmm on
    # the bf16 copy, the one-row grouped FP8 read, the FP8 read's Gluon build (every candidate); us per call, weights
    # from HBM.
    # Look at: us and GB/s per path and row count, "bound ok"
    python3 tools/wo_a_study.py --rows "${WO_A_ROWS:-1,2,6,16}" --json "$PHASE_DIR/wo_a.json"
}

phase_pdl_study() {  # issues 27/28 (23 s on an H100, docs/perf/050): programmatic dependent launch at decode's sizes
    # (tools/pdl_study.py): 40 layers x V4.1's five FP8 read shapes, each after a one-program norm of the previous
    # read's output, in one CUDA graph: plain launches, PDL, PDL with each read's weights prefetched to L2 before its
    # griddepcontrol.wait; then its gpu test (the three give the same bits).
    # Look at: the "pdl-study" lines (us a step and a norm + read, x the reads' byte floor, same bits).
    python3 tools/pdl_study.py --layers "${PDL_LAYERS:-40}" --json "$PHASE_DIR/pdl_study.json"
    local rc=$?
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/tools/test_pdl_study.py 2>&1 | tail -3
    return $rc
}

phase_flashmla() {  # FlashMLA sparse prefill (~90 s): its gpu tests, the rank4-shape micro-benchmark, then the
    # in-model fast-path check with FlashMLA forced
    local rc=0
    python3 -c "import flash_mla; from mini.kernels.flashmla_attention import available; \
print('flash_mla', flash_mla.__version__, 'available', available())" || return 2
    python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/kernels/test_flashmla_attention.py \
        --junitxml="$PHASE_DIR/junit.xml" || rc=$?
    python3 tools/flashmla_core.py --json "$PHASE_DIR/kernels_flashmla.json" || rc=$?
    MINI_SPARSE_ATTN=flashmla python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_fast_path_gpu.py \
        || rc=$?
    return $rc
}

phase_kernels() {  # attention-side kernel micro-benchmarks (~35 s); KERNELS names them, KERNELS_SWEEP=1 adds
    # their tile sweeps (tools/kernel_tile_sweep.py); then the finished before/after studies
    # (tools/attention_before_after.py; STUDIES names them, STUDIES=none runs none)
    local rc=0
    python3 -m mini.bench.kernels --only ${KERNELS:-attention indexer mhc norm order_keys top_ids} \
        --json "$PHASE_DIR/kernels.json" || rc=$?
    if [ -n "${KERNELS_SWEEP:-}" ]; then
        python3 tools/kernel_tile_sweep.py --json "$PHASE_DIR/kernels_tile_sweep.json" || rc=$?
    fi
    [ "${STUDIES:-}" = none ] && return $rc  # (STUDIES=none: the benches alone)
    python3 tools/attention_before_after.py --only ${STUDIES:-attention_rope indexer_topk rope_chains attn_glue} \
        --json "$PHASE_DIR/kernels_before_after.json" || rc=$?
    return $rc
}

phase_attn_split() {  # issue 28, sparse attention split over the key list at decode (~100 s on a cold kernel cache,
    # not yet measured; cap it at 240): the kernel's split gpu tests and its one-program parity test at V4.1 shape
    # (tests.log: the split and the one-program walk each within 5e-3 of the reference op, both distances printed;
    # a fixed k_split keeps a row alone == batched), then decode B = 1..256 at 4K and 32K, k_split 1 vs the
    # wrapper's choice vs 2/4/10 (bench.log, kernels_attn_split.json: ms, GB/s and the byte floor)
    local rc=0
    timeout 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE tests/kernels/test_sparse_attention_split.py \
        tests/kernels/test_sparse_attention.py::test_sparse_attention_matches_reference_op \
        --junitxml="$PHASE_DIR/junit.xml" >"$PHASE_DIR/tests.log" 2>&1 || rc=1
    grep -E "one-program .* split|passed|failed" "$PHASE_DIR/tests.log" | tail -40
    timeout 80 python3 -m mini.bench.kernels --only attention_decode --json "$PHASE_DIR/kernels_attn_split.json" \
        >"$PHASE_DIR/bench.log" 2>&1 || rc=1
    grep -E "^sparse_attention|ERROR" "$PHASE_DIR/bench.log" || tail -15 "$PHASE_DIR/bench.log"
    return $rc
}

phase_route_combine() {  # issue 28 item 2 (24 s on an H100, docs/perf/039): the routing plan's count / place kernels
    # over other block sizes and the combine over other column blocks and warps, at decode / verify / prefill pair
    # counts (tools/route_combine_study.py). Look at: us per shape and case; same_plan / bit_equal all true.
    python3 tools/route_combine_study.py --json "$PHASE_DIR/route_combine.json"
}

phase_mhc_rows() {  # issue 28 item 2 (36 s on an H100, docs/perf/039): mhc_norm at a verify step's rows (384, 96, 6)
    # and a decode step's (64) in CUDA graphs, the default tiles against ROWS_GRIDS' (tools/mhc_split.py). Look at:
    # us per config and size; a grid well under the default's is a candidate for `partial_tiles` (its bits move).
    python3 tools/mhc_split.py --only mhc_rows --json "$PHASE_DIR/mhc_rows.json" >"$PHASE_DIR/study.log" 2>&1
    local rc=$?
    grep -A80 "^kernel " "$PHASE_DIR/study.log"
    return $rc
}

phase_mhc_ab() {  # issue 13 item 4 (<= 80 s): the mHC site input's split-K pass, default vs candidates.
    # (The fused expand + next site's input of 8cfc3bd lost on the H200 at 1db3041: 0.257 ms vs 0.233 for the two
    # passes; removed, docs/kernels.md.) 1. gpu tests of the mHC kernels and ops (tests.log): expect all passed,
    # incl. test_mhc_norm_gpu[...] with layout "copies" (one tile per copy) and split 40. 2. bench.log /
    # kernels_mhc_split.json: mhc_norm at [4096|256|64, 4, 5120], default vs layout "copies" (2 stages, 12 chunks,
    # 32-token blocks) and split 40 at decode sizes: ms, tbs (h read + y written), bits (y elements and the mixes'
    # max relative change vs the default). At 56388c4 the default took 136 us at 4,096 tokens (80 sites: ~11 ms
    # per rank4 step) and 39 us at 256: a candidate well under those is worth a new default (its bits move).
    local rc=0
    timeout 45 python3 -m pytest -q -m gpu -n 2 -p no:cacheprovider -rfE --timeout=40 tests/kernels/test_mhc_norm.py \
        tests/kernels/test_mhc_expand.py tests/ops/test_mhc.py --junitxml="$PHASE_DIR/junit.xml" \
        >"$PHASE_DIR/tests.log" 2>&1 || rc=1
    tail -6 "$PHASE_DIR/tests.log"
    timeout 30 python3 tools/mhc_split.py --json "$PHASE_DIR/kernels_mhc_split.json" \
        >"$PHASE_DIR/bench.log" 2>&1 || rc=1
    grep -E "^mhc_norm|ERROR" "$PHASE_DIR/bench.log" || tail -15 "$PHASE_DIR/bench.log"  # cut short: the rows so far
    return $rc
}

phase_fastpath() {  # fast vs reference path: tiny-v4.1 greedy decode with and without fake quant (~60 s);
    # FASTPATH_LAYERS=1 also runs the real-width layer check first (~100 s more); FASTPATH_ARGS e.g. --device cpu
    local rc=0
    if [ "${FASTPATH_LAYERS:-0}" = 1 ]; then
        python3 -m mini.cli check fastpath ${FASTPATH_ARGS:-} --json "$PHASE_DIR/fastpath.json" || rc=$?
    fi
    python3 -m mini.cli check fastpath --decode-only ${FASTPATH_ARGS:-} \
        --json "$PHASE_DIR/fastpath_decode.json" || rc=$?
    python3 -m mini.cli check fastpath --decode-only --decode-no-fake-quant ${FASTPATH_ARGS:-} \
        --json "$PHASE_DIR/fastpath_decode_nofq.json" || rc=$?
    return $rc
}

phase_gemv() {  # issue 28, the dense projections at decode (cap it at 260): `mini bench kernels
    # --only decode_gemv` (bench.log, kernels_decode_gemv.json): us per call in a CUDA graph, cuBLAS at B = 1, 16, 64
    # on V4.1's projection shapes against the decode GEMV's candidate tilings at B = 1, 16 (frac_copy_peak,
    # same_as_cublas), and an FP8 linear's quant pass + cuBLAS against the GEMV with the quant fused; then the GEMV's
    # gpu tests (tests.log: V4.1 shapes at T = 1, 3, 16, every candidate, CUDA-graph replays)
    local rc=0
    timeout 130 python3 -m mini.bench.kernels --only decode_gemv --json "$PHASE_DIR/kernels_decode_gemv.json" \
        >"$PHASE_DIR/bench.log" 2>&1 || rc=1
    grep -E "^dense_gemm|ERROR" "$PHASE_DIR/bench.log" || tail -15 "$PHASE_DIR/bench.log"
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_gemv.py \
        --junitxml="$PHASE_DIR/junit.xml" >"$PHASE_DIR/tests.log" 2>&1 || rc=1
    tail -6 "$PHASE_DIR/tests.log"
    return $rc
}

phase_gemv_rows_ab() {  # issues 27/28 (cap it at 580; 225 s on an H100 in report 046): the FP8 read of 2-16
    # rows on the tensor cores, its forms against each other and the bf16 copy's GEMV. First the GEMV's gpu tests
    # (tests.log), then `mini bench kernels --only decode_gemv_fp8` (bench.log: us per call at B = 1, 6, 16 on V4.1's
    # FP8 projections, same_as_copy, max_rel_err; each candidate also on x's codes, alone and after their quant
    # pass), then spec-decode (GEMV_AB_BATCH, default 1,16, --no-proxy; one
    # emulated EP4 rank, acceptance EMULATED; GEMV_AB_ARGS adds flags, e.g. "--ep 8" on an H100) under each
    # MINI_GEMV_WEIGHTS of GEMV_AB_READS (default "fp8_row fp8") in one job (spec_<reads>.log / .json)
    local rc=0
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_gemv.py \
        --junitxml="$PHASE_DIR/junit.xml" >"$PHASE_DIR/tests.log" 2>&1 || rc=1
    tail -4 "$PHASE_DIR/tests.log"
    timeout 180 python3 -m mini.bench.kernels --only decode_gemv_fp8 --json "$PHASE_DIR/kernels_gemv_fp8.json" \
        >"$PHASE_DIR/bench.log" 2>&1 || rc=1
    grep -E "^\{|ERROR|Error" "$PHASE_DIR/bench.log" | python3 -c "
import json, sys
for line in sys.stdin:
    if not line.startswith('{'):
        print(line.rstrip()); continue
    r = json.loads(line)
    print(f\"{r['kernel']:48s} {r['config']:48s} {r['us']:7.1f} us  frac {r['frac_copy_peak']:.2f}\",
          f\"same {r['same_as_copy']:.3f}  err {r['max_rel_err']:.1e}\")"
    for reads in ${GEMV_AB_READS:-fp8_row fp8}; do
        MINI_GEMV_WEIGHTS=$reads MINI_MOE_GEMM="${MINI_MOE_GEMM:-humming}" timeout 140 python3 -m mini.cli bench \
            spec-decode --batch "${GEMV_AB_BATCH:-1,16}" --context 4096 --steps 6 --warmup 2 --no-proxy \
            ${GEMV_AB_ARGS:-} --json "$PHASE_DIR/spec_$reads.json" >"$PHASE_DIR/spec_$reads.log" 2>&1 || rc=1
        grep -E "Error|error:" "$PHASE_DIR/spec_$reads.log" | tail -3
        grep "^spec-decode B=" "$PHASE_DIR/spec_$reads.log" | sed "s/^/$reads: /"
    done
    return $rc
}

phase_gemv_regs() {  # issues 27/28 (61 s on an H100, docs/perf/048): the FP8 read's Gluon build
    # (mini/kernels/gemv_mma_registers.py) first checked, then timed. Its gpu tests and the read's (tests.log: every
    # candidate against the exact products' sums at V4.1's shapes, x quantized, as codes and as it is, wo_a's groups,
    # the switch's dispatch), then `mini bench kernels --only decode_gemv_fp8` (bench.log, one line per row: us,
    # share of the copy rate, same_as_copy, max_rel_err; the Triton build's candidates beside it), then
    # tools/wo_a_study.py at 6 and 16 rows (wo_a.log). The step A/B is phase gemv_rows_ab with
    # GEMV_AB_READS="fp8_triton fp8".
    local rc=0
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_gemv.py \
        -k "mma or gluon or regs" --junitxml="$PHASE_DIR/junit.xml" >"$PHASE_DIR/tests.log" 2>&1 || rc=1
    tail -6 "$PHASE_DIR/tests.log"
    timeout 120 python3 -m mini.bench.kernels --only decode_gemv_fp8 --json "$PHASE_DIR/kernels_gemv_fp8.json" \
        >"$PHASE_DIR/bench.log" 2>&1 || rc=1
    grep -E "^\{" "$PHASE_DIR/bench.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(f\"{r['kernel'][15:]:34s} {r['config'][:34]:34s} {r['us']:6.1f} {r['frac_copy_peak']:.2f}\",
          f\"{r['same_as_copy']:.3f} {r['max_rel_err']:.0e}\")"
    grep -iE "error|Traceback" "$PHASE_DIR/bench.log" | head -5
    timeout 40 python3 tools/wo_a_study.py --rows 6,16 --json "$PHASE_DIR/wo_a.json" >"$PHASE_DIR/wo_a.log" 2>&1 \
        || rc=1
    tail -14 "$PHASE_DIR/wo_a.log"
    return $rc
}

phase_decode_small() {  # issue 28, decode latency's small kernels (84 s before the GEMV rows; cap it
    # at 300): the gpu tests of the one-program routing plan (decode T = 1..171, == the torch plan), of the mHC
    # site input at decode sizes (T = 1, 3, 16, 65, tiles chosen by T; the deterministic mode's tiles: a token alone
    # == among 1, 16, 333), of the few-rows gate (T = 1, 3, 16, 64 at V4.1 shape) and of the decode GEMV (V4.1's
    # projection shapes at T = 1, 3, 16, every candidate tiling) (tests.log), after `mini bench kernels
    # --only decode_small` (bench.log, kernels_decode_small.json): us per call in a CUDA graph at B = 1, 16, 64,
    # the route plan in one program vs three kernels vs torch sort, the gate's few-rows kernels vs the unfused
    # gate's torch ops vs the fused kernel, mhc_norm by T vs the 4,096-token tiles vs other splits, then cuBLAS on
    # the dense projections' shapes against their weight bytes' floor (item 3: which small GEMMs are far from it)
    # beside the decode GEMV's candidate tilings at B = 1, 16 (mini/kernels/gemv.py), and an FP8 linear's quant pass
    # + cuBLAS against the GEMV with the quant fused
    local rc=0
    timeout 180 python3 -m mini.bench.kernels --only decode_small --json "$PHASE_DIR/kernels_decode_small.json" \
        >"$PHASE_DIR/bench.log" 2>&1 || rc=1
    grep -E "^(route_plan|gate|mhc_norm|dense_gemm)|ERROR" "$PHASE_DIR/bench.log" || tail -15 "$PHASE_DIR/bench.log"
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_moe_route.py \
        tests/kernels/test_mhc_norm.py tests/kernels/test_moe_gate.py tests/kernels/test_gemv.py \
        -k "decode_plan or small_steps or invariant or few_rows or gemv" \
        --junitxml="$PHASE_DIR/junit.xml" >"$PHASE_DIR/tests.log" 2>&1 || rc=1
    tail -6 "$PHASE_DIR/tests.log"
    return $rc
}

phase_decode_gate() {  # issue 28, the gate at decode alone (not yet measured; guess ~60 s on a cold kernel cache,
    # cap it at 150): `mini bench kernels --only decode_gate` (bench.log, kernels_decode_gate.json: us per call in a
    # CUDA graph at B = 1, 2, 4, 8, 16, 32, 64, the unfused gate's torch ops vs the fused kernel vs each few-rows
    # candidate tiling, with ids_same / max_dw against the unfused gate), then the gpu tests of every tiling at
    # V4.1 shape (T = 1, 3, 16, 64) (tests.log). FEW_ROWS_GATE_MAX_TOKENS follows from the bench rows.
    local rc=0
    timeout 90 python3 -m mini.bench.kernels --only decode_gate --json "$PHASE_DIR/kernels_decode_gate.json" \
        >"$PHASE_DIR/bench.log" 2>&1 || rc=1
    grep -E "^(\{\"kernel\": \"gate|gate/)|ERROR|Error" "$PHASE_DIR/bench.log" || tail -15 "$PHASE_DIR/bench.log"
    timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_moe_gate.py -k few_rows \
        --junitxml="$PHASE_DIR/junit.xml" >"$PHASE_DIR/tests.log" 2>&1 || rc=1
    tail -6 "$PHASE_DIR/tests.log"
    return $rc
}

phase_kernel_resources() {  # registers and spills of every kernel this call compiled, as launched (~5 s; name it
    # after the phases that build them, e.g. `decode_parts:235 kernel_resources:30`): ptxas's REG / STACK a thread
    # from each cubin in the Triton cache, read with Triton's bundled cuobjdump (tests/kernels/sm90_build.py checks
    # offline builds, which mark fewer arguments than a launch; docs/perf/043). Look at: resources.txt (count,
    # kernel, warps, stages, REG, STACK), and the lines printed here: the builds with STACK above 0.
    local cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache} cuobjdump
    cuobjdump=$(python3 -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump'))")
    find "$cache" -name '*.cubin' | while read -r cubin; do
        meta="${cubin%.cubin}.json"
        warps=$(grep -o '"num_warps": [0-9]*' "$meta" 2>/dev/null | grep -o '[0-9]*$')
        stages=$(grep -o '"num_stages": [0-9]*' "$meta" 2>/dev/null | grep -o '[0-9]*$')
        "$cuobjdump" --dump-resource-usage "$cubin" \
            | awk -v w="${warps:-?}" -v s="${stages:-?}" '/Function /{name=$2} /REG:/{print name, "warps=" w, "stages=" s, $1, $2}'
    done | tr -d ':' | sed 's/REG/REG:/; s/STACK/STACK:/' | sort | uniq -c >"$PHASE_DIR/resources.txt"
    echo "kernel_resources: $(wc -l <"$PHASE_DIR/resources.txt") builds; those that spill:"
    grep -v "STACK:0$" "$PHASE_DIR/resources.txt" || echo "  none"
}
