"""Builds the dispatched attention-side kernels, the decode GEMVs, the activation quant and EP wire passes, mHC and the
MoE side's gate, route plan, grouped MXFP4 GEMMs and combine for sm_90a (Triton -> PTX -> cubin, no GPU needed) at
the launch configurations the wrappers use for the models' shapes, so that a kernel that only fails to compile for
Hopper (the interpreter accepts more) is caught on CPU. Run as a script without TRITON_INTERPRET; prints one line
each, with ptxas's registers and stack bytes a thread. A build that spills (stack > 0) fails unless its call says
`spills=True`: the CUDA-core FP8 read at several rows spilled from 2-4 rows on (docs/perf/025), a cost no CPU test
saw. A build specializes its arguments as Triton's launcher does for a launch at the model's shape: the pointers
16-byte aligned, and each integer in `ints` (what such a launch passes) marked 16-divisible when it is, a constant
when it is 1. That decides whether loads are vectorized and pipelined: the GEMVs built without their strides' marks
loaded bytes one at a time in 200-255 registers, against 40-113 as launched (docs/perf/045). Row and token counts
and lengths that vary from step to step stay unmarked (a launch compiles one build per class of them). Registers
still differ between Triton versions (the marks cover 3.6, the GPU image's and CI's oldest, and 3.9); a build marked
here is one to check on a device (phase `kernel_resources`, docs/kernels.md)."""
import itertools
import os
import re
import subprocess
import tempfile
from dataclasses import replace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from mini.kernels.engram_gate import _engram_gate_kernel
from mini.kernels.gemv import CANDIDATES as GEMV_CANDIDATES
from mini.kernels.gemv import DEFAULT as GEMV_DEFAULT
from mini.kernels.gemv import MMA_CANDIDATES as GEMV_MMA_CANDIDATES
from mini.kernels.gemv import MMA_DEFAULT as GEMV_MMA_DEFAULT
from mini.kernels.gemv import ROW_CANDIDATES as GEMV_ROW_CANDIDATES
from mini.kernels.gemv import ROW_DEFAULT as GEMV_ROW_DEFAULT
from mini.kernels.gemv import _gemv_fp8_mma_kernel, _gemv_fp8_row_kernel, _gemv_kernel, _sum_pieces_kernel, split_k
from mini.kernels.gemv_mma_registers import _gemv_fp8_mma_registers_kernel
from mini.kernels.fp8_act_quant import TILE_ROWS as ACT_TILE_ROWS
from mini.kernels.fp8_act_quant import _act_quant_kernel, _wire_decode_kernel, _wire_encode_kernel
from mini.kernels.indexer_scores import _index_scores_kernel
from mini.kernels.mhc_expand import _mhc_expand_kernel
from mini.kernels.moe_combine import _combine_kernel as _moe_combine_kernel
from mini.kernels.moe_gate import CONFIGS as GATE_CONFIGS
from mini.kernels.moe_gate import FEW_ROWS_BY_TOKENS, _gate_kernel, _gate_logits_kernel, _gate_pick_kernel
from mini.kernels.moe_gate import column_blocks as gate_column_blocks
from mini.kernels.moe_route import WIDE_STEP as ROUTE_WIDE_STEP
from mini.kernels.moe_route import WIDE_STEP_WARPS as ROUTE_WIDE_STEP_WARPS
from mini.kernels.moe_route import _plan_one_kernel
from mini.kernels.moe_route import launch_sizes as route_launch_sizes
from mini.kernels.mxfp4_grouped_gemm import BLOCK_M as MXFP4_BLOCK_M
from mini.kernels.mxfp4_grouped_gemm import CONFIG as MXFP4_CONFIG
from mini.kernels.mxfp4_grouped_gemm import _grouped_mxfp4_kernel
from mini.kernels.mhc_norm import _mhc_finish_kernel, _mhc_partial_copies_kernel, _mhc_partial_kernel
from mini.kernels.order_keys import BLOCK as ORDER_KEYS_BLOCK
from mini.kernels.order_keys import _order_keys_kernel
from mini.kernels.rms_norm import _rms_norm_kernel, tiles as norm_tiles
from mini.kernels.rope_quant import _rope_quant_kernel
from mini.kernels.top_ids import RADIX_BITS as TOP_IDS_RADIX
from mini.kernels.top_ids import WARPS as TOP_IDS_WARPS
from mini.kernels.top_ids import _chunk_candidates_kernel, _merge_candidates_kernel, _top_ids_kernel, merge_warps
from mini.kernels.sparse_attention import _combine_kernel, _sparse_mla_kernel, _sparse_mla_split_kernel


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SM90_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may take on sm_90


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) a thread of a cubin's kernel, as ptxas left them (Triton's bundled cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert found, f"cuobjdump gave no resource usage: {out[-500:]}"
    return int(found[1]), int(found[2])


def build(kernel, ptr_types: dict, consts: dict, floats=(), num_warps=4, num_stages=2, spills=False,
          ints: dict | None = None, shared: int | None = None, max_cubin_kb: int | None = None) -> None:
    names = kernel.arg_names
    fixed = {n for i, n in enumerate(names) if i in kernel.do_not_specialize or n in kernel.do_not_specialize}
    ints = ints or {}
    assert not set(ints) - set(names) and not set(ints) & fixed, f"{kernel.__name__}: ints {ints}"
    consts = {**consts, **{n: 1 for n, v in ints.items() if v == 1}}  # the launcher makes a 1 a constant
    types = {n: "constexpr" if n in consts else ptr_types.get(n, "*bf16") if n.endswith("_ptr")
             else "fp32" if n in floats else "i32" for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n.endswith("_ptr") or (n in ints and ints[n] % 16 == 0 and ints[n] != 1)}
    source = GluonASTSource if getattr(kernel, "is_gluon", lambda: False)() else ASTSource
    src = source(fn=kernel, signature=types, constexprs={(names.index(k),): v for k, v in consts.items()},
                 attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    took = compiled.metadata.shared  # a launch of more than an H100 / H200 block's shared memory would fail
    assert took <= SM90_SHARED_BYTES, f"{kernel.__name__} {consts}: {took} bytes of shared memory"
    assert shared is None or took == shared, f"{kernel.__name__} {consts}: {took} bytes of shared memory, not {shared}"
    regs, stack = resources(compiled.asm["cubin"])
    assert spills or stack == 0, f"{kernel.__name__} {consts}: {regs} registers, {stack} stack bytes a thread (spills)"
    kb = len(compiled.asm["cubin"]) // 1024
    # code a step fetches cold: a latency-bound kernel's unrolled loops cost their fetch in a model step, not in a
    # micro-benchmark that replays it alone (docs/perf/049: top_ids 70 -> 33 us a call in the step, 582K -> 94K)
    assert max_cubin_kb is None or kb <= max_cubin_kb, f"{kernel.__name__} {consts}: a {kb}K cubin (> {max_cubin_kb}K)"
    print(kernel.__name__, consts, ints, f"REG:{regs} STACK:{stack} CUBIN:{kb}K", "ok", flush=True)


def _gemv_ints(N: int, K: int, cfg, split: bool = True, w_block: int = 0) -> dict:
    """The integers a GEMV launch passes for a contiguous x [T, K] and w [N, K] (mini.kernels.gemv.gemv), for the
    kernel `cfg` selects; T is not specialized. `w_block`: an FP8 weight's (its scale rows' stride)."""
    k_piece = split_k(N, K, cfg)[1] if split else K
    if cfg.cuda_cores:
        return dict(N=N, K=K, stride_w=K, stride_s=triton.cdiv(K, w_block), K_PIECE=k_piece, GROUP_N=N)
    ints = dict(N=N, K=K, stride_x=K, stride_w=K, stride_y=N, K_PIECE=k_piece)
    return {**ints, "stride_s": triton.cdiv(K, w_block), "stride_e": 0} if cfg.fp8_mma else ints


def _mla_ints(heads: int, d: int, window: int) -> dict:
    """A sparse MLA launch's strides and heads for q and out [T, heads, d] and rings [slots, window, d]; the block
    table's and index lists' widths and the groups a block holds vary with the config: unmarked."""
    return dict(stride_qt=heads * d, stride_qh=d, stride_ot=heads * d, stride_oh=d, stride_win=window * d,
                n_heads=heads)


def main() -> None:
    idx = {n: "*i64" for n in ("pos_ptr", "seq_ptr", "slot_ptr", "start_ptr", "cidx_ptr", "rows_ptr", "nvis_ptr",
                               "prog_seq_ptr", "prog_t0_ptr", "seq_end_ptr")}
    f32 = {n: "*fp32" for n in ("sink_ptr", "rope_ptr", "fn_ptr", "scale_ptr", "base_ptr", "pre_in_ptr", "pre_ptr", "post_ptr",
                                "comb_ptr", "table_ptr", "part_ptr")}
    ptrs = {**idx, **f32, "btab_ptr": "*i32", "width_ptr": "*i32", "cand_ptr": "*u8"}
    # (head dim, rope dim, heads -> BLOCK_H, window) of V4.1 / tiny-v4.1 / tiny-v4 / the official fixtures;
    # 0 compressed tiles = window-only layers; RD > 0: the output RoPE in the epilogue (what the model runs),
    # RD = 0: the plain op
    # D_SPLIT 2: the dispatched build (half the output columns per program); 1: the one-program build (selectable)
    for split in (2, 1):
        for d, rd, bh, w in ((512, 64, 64, 128), (64, 16, 16, 128), (128, 64, 16, 128), (128, 32, 16, 16)):
            for tiles, rope in ((0, 0), (8, rd)):
                build(_sparse_mla_kernel, ptrs, dict(W=w, N_COMP_TILES=tiles, D=d, RD=rope, BLOCK_H=bh, BLOCK_N=64,
                                                     PREFILL_LISTS=True, D_SPLIT=split),
                      ("scale_log2",), num_warps=8, ints=_mla_ints(bh, d, w),
                      # under Triton 3.9 all but D = 64 with D_SPLIT 2; under 3.6 (the GPU image's): D_SPLIT 1
                      # at 512 and 128
                      spills=True)
    # the split-key decode path (k_split > 1): its walk at V4.1 / tiny width, then the combine with the epilogue
    for split in (2, 1):
        for d, bh in ((512, 64), (64, 16)):
            build(_sparse_mla_split_kernel, {**ptrs, "nvalid_ptr": "*i32", "stat_ptr": "*fp32"},
                  dict(W=128, N_COMP_TILES=0, D=d, RD=0, BLOCK_H=bh, BLOCK_N=64, PREFILL_LISTS=True,
                       D_SPLIT=split),
                  ("scale_log2",), num_warps=8, spills=True, ints=_mla_ints(bh, d, 128))  # (as above)
            build(_combine_kernel, {**ptrs, "stat_ptr": "*fp32"},
                  dict(N_PIECES=5 - split, D=d, RD=64 if d == 512 else 16, BLOCK_H=bh, BLOCK_D=64),
                  ints=dict(stride_ot=bh * d, stride_oh=d, n_heads=bh))
    for h, di, bt in ((32, 128, 2), (64, 128, 2), (4, 32, 4), (4, 64, 4)):
        for cand in (False, True):  # the tiles per program are an argument: one build for every count
            build(_index_scores_kernel, {**ptrs, "out_ptr": "*fp32"},
                  dict(H=h, DI=di, BLOCK_T=bt, BLOCK_N=128, HAS_CAND=cand, LOOP_STAGES=3),
                  spills=(h, di, cand) == (4, 32, False))  # a tiny model's, under Triton 3.9
    # mHC pre-norm, split-K pass + finishing pass: V4.1 (delayed pre, + FP8 quant), V4 (own pre), mixes only
    for d, delayed, collapse, quant in ((5120, True, True, 1), (64, False, True, 0), (128, False, False, 0)):
        build(_mhc_partial_kernel, ptrs, dict(D=d, HC=4, NM=24, CHUNK=512 if d == 5120 else 64, BLOCK_T=64,
                                              BLOCK_K=64, COLLAPSE=delayed and collapse, SPLIT_BF16=True,
                                              OP=triton.language.bfloat16, PRECISION="tf32x3"),
              spills=d == 5120)  # prefill's V4.1 tile
        build(_mhc_finish_kernel, ptrs, dict(D=d, HC=4, ITERS=20, NSPLIT=10 if d == 5120 else 1,
                                             SP=16 if d == 5120 else 1, BLOCK_T=8,
                                             BLOCK_D=512, DELAYED=delayed, COLLAPSE=collapse, QUANT=quant, QBLOCK=32,
                                             D_PIECES=1),
              ("norm_eps", "hc_eps"))
    # decode tiles (partial_tiles, finish_tiles at T <= 16): 16-token blocks, 2-step chunks, 160 partials to sum
    build(_mhc_partial_kernel, ptrs, dict(D=5120, HC=4, NM=24, CHUNK=32, BLOCK_T=16, BLOCK_K=16, COLLAPSE=True,
                                          SPLIT_BF16=True, OP=triton.language.bfloat16, PRECISION="tf32x3"),
          num_stages=3)
    # the 128- and 256-token blocks `mini bench kernels --only decode_small` times at 256-384 rows (split 80, 160)
    for block_t, chunk in ((128, 64), (256, 32)):
        build(_mhc_partial_kernel, ptrs, dict(D=5120, HC=4, NM=24, CHUNK=chunk, BLOCK_T=block_t, BLOCK_K=16,
                                              COLLAPSE=True, SPLIT_BF16=True, OP=triton.language.bfloat16,
                                              PRECISION="tf32x3"), num_stages=3, spills=block_t == 256)
    # (the normalisation in its own programs beside the mixes' at decode: finish_pieces; B = 1 and B = 64's tiles)
    for block_t, block_d, pieces in ((1, 2048, 3), (4, 1024, 5)):
        build(_mhc_finish_kernel, ptrs, dict(D=5120, HC=4, ITERS=20, NSPLIT=160 if block_t == 1 else 40,
                                             SP=256 if block_t == 1 else 64, BLOCK_T=block_t, BLOCK_D=block_d,
                                             DELAYED=True, COLLAPSE=True, QUANT=1, QBLOCK=32, D_PIECES=pieces),
              ("norm_eps", "hc_eps"))
    for d, delayed in ((5120, True), (64, False)):  # the one-tile-per-copy split-K pass (layout="copies")
        build(_mhc_partial_copies_kernel, ptrs, dict(D=d, HC=4, NM=24, CHUNK=640 if d == 5120 else 64, BLOCK_T=64,
                                                     BLOCK_K=16, COLLAPSE=delayed, OP=triton.language.bfloat16),
              num_stages=3)
    for d, rd, quant, qb in ((512, 64, 0, 32), (512, 64, 1, 32), (512, 64, 3, 16), (128, 64, 2, 32), (64, 16, 0, 32),
                             (32, 16, 0, 32), (64, 64, 0, 32)):
        build(_rope_quant_kernel, ptrs, dict(D=d, RD=rd, NOPE_P=triton.next_power_of_2(max(d - rd, 1)), BLOCK_R=16,
                                             NORM=quant == 1, QUANT=quant, QBLOCK=qb), ("eps", "sin_sign"),
              ints=dict(stride_n=8 * d, stride_h=d))  # rows of 8 heads (the heads themselves vary: unmarked)
    # the decode GEMV: each candidate tiling split over K with V4.1's activation quant in its loads (and the default
    # unsplit without it), then fp32 output, V4's quant blocks, the pieces' sum; at wo_b's [5120, 8192] (every
    # integer 16-divisible), the defaults also at wq_b | indexer wq_b's [36864, 1280] (scale rows of 40 bytes)
    for cfg in GEMV_CANDIDATES.values():
        for split in (True, False) if cfg == next(iter(GEMV_CANDIDATES.values())) else (True,):
            build(_gemv_kernel, {**ptrs, "count_ptr": "*i32"},
                  dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TP=16, SPLIT=split, ONE_LAUNCH=cfg.one_launch,
                       EVEN_K=True, ACT_BLOCK=32 if split else 0, DOT_DTYPE=triton.language.bfloat16),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, ints=_gemv_ints(5120, 8192, cfg, split))
    build(_gemv_kernel, {**ptrs, "count_ptr": "*i32", "y_ptr": "*fp32"},  # fp32 output (the compressor's GEMM)
          dict(BLOCK_N=64, BLOCK_K=128, TP=16, SPLIT=False, ONE_LAUNCH=False, EVEN_K=True, ACT_BLOCK=0,
               DOT_DTYPE=triton.language.bfloat16), num_stages=4, ints=_gemv_ints(1024, 5120, GEMV_DEFAULT, False))
    build(_gemv_kernel, {**ptrs, "count_ptr": "*i32"},  # V4's 128-wide activation quant blocks
          dict(BLOCK_N=64, BLOCK_K=128, TP=16, SPLIT=True, ONE_LAUNCH=False, EVEN_K=True, ACT_BLOCK=128,
               DOT_DTYPE=triton.language.bfloat16), num_stages=4, ints=_gemv_ints(1536, 7168, GEMV_DEFAULT))
    fp8 = {**ptrs, "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "e_ptr": "*u8"}
    for cfg in GEMV_ROW_CANDIDATES.values():  # the FP8 read of one row on the CUDA cores (V4.1's 32 x 32 blocks)
        for n, k in ((5120, 8192), (36864, 1280)) if cfg == GEMV_ROW_DEFAULT else ((5120, 8192),):
            build(_gemv_fp8_row_kernel, {**fp8, "count_ptr": "*i32"},
                  dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=True, ONE_LAUNCH=cfg.one_launch,
                       PP=triton.next_power_of_2(split_k(n, k, cfg)[0]) if cfg.one_launch else 1, EVEN_K=True,
                       ACT_BLOCK=32, W_BLOCK=32,
                       INTERPRET=False), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  ints=_gemv_ints(n, k, cfg, w_block=32))
    build(_gemv_fp8_row_kernel, {**fp8, "count_ptr": "*i32"},  # V4's 128 x 128, unsplit
          dict(BLOCK_N=32, BLOCK_K=256, SPLIT=False, ONE_LAUNCH=False, PP=1, EVEN_K=True, ACT_BLOCK=128, W_BLOCK=128,
               INTERPRET=False),
          ints=_gemv_ints(1536, 7168, replace(GEMV_ROW_DEFAULT, block_k=256), False, w_block=128))
    for cfg in GEMV_MMA_CANDIDATES.values():  # the FP8 read of 2-16 rows on the tensor cores, split and not
        if cfg.gluon_k_width:  # its Gluon build (no shared memory: its operands are loaded into the MMA's registers)
            # x quantized in the loads (1), its codes given (2), and as it is (0) at V4.1's wo_a (8 groups of 1,024
            # rows); and at V4's 128-wide blocks (128 x 128 byte tiles a step)
            for tp, mode, w_block, split in ((8, 1, 32, True), (16, 1, 32, False), (8, 2, 32, True),
                                             (16, 0, 32, True), (16, 1, 128, True)):
                if cfg.gluon_ahead and w_block != 32:  # 32-wide blocks only (gemv.blocks_ahead)
                    continue
                shape = (1536, 7168) if w_block == 128 else (8192, 4096) if mode == 0 else (5120, 8192)
                ints = _gemv_ints(*shape, replace(cfg, block_k=w_block), split, w_block=w_block)
                ints.update(GROUP_N=1024 if mode == 0 else shape[0], stride_e=shape[1] // w_block if mode == 2 else 0)
                if mode == 0:
                    ints["stride_x"] = 8 * shape[1]
                build(_gemv_fp8_mma_registers_kernel, {**fp8, "x_ptr": "*fp8e4nv"} if mode == 2 else fp8,
                      dict(BLOCK_N=cfg.block_n, TP=tp, SPLIT=split, W_BLOCK=w_block, K_WIDTH=cfg.gluon_k_width,
                           X_MODE=mode, AHEAD=cfg.gluon_ahead), num_warps=cfg.num_warps,
                      ints=ints, shared=0)
            continue
        for n, k in ((5120, 8192), (36864, 1280)) if cfg == GEMV_MMA_DEFAULT else ((5120, 8192),):
            for split in (True, False):
                build(_gemv_fp8_mma_kernel, fp8,
                      dict(BLOCK_N=cfg.block_n, TP=16, SPLIT=split, W_BLOCK=32, DOT_FP32=False,
                           X_CODES=False),
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      ints=_gemv_ints(n, k, replace(cfg, block_k=32), split, w_block=32))
        # x given as its FP8 codes (FP8Rows: codes [T, K], E8M0 bytes [T, K / 32])
        ints = {**_gemv_ints(5120, 8192, replace(cfg, block_k=32), w_block=32), "stride_e": 8192 // 32}
        build(_gemv_fp8_mma_kernel, {**fp8, "x_ptr": "*fp8e4nv"},
              dict(BLOCK_N=cfg.block_n, TP=16, SPLIT=True, W_BLOCK=32, DOT_FP32=False, X_CODES=True),
              num_warps=cfg.num_warps, num_stages=cfg.num_stages, ints=ints)
    build(_gemv_fp8_mma_kernel, fp8,  # V4's 128 x 128
          dict(BLOCK_N=64, TP=16, SPLIT=True, W_BLOCK=128, DOT_FP32=False, X_CODES=False),
          num_stages=4, ints=_gemv_ints(1536, 7168, replace(GEMV_MMA_DEFAULT, block_n=64, block_k=128), w_block=128))
    build(_sum_pieces_kernel, ptrs, dict(PIECES=14, PP=16, BLOCK=256), ints=dict(N=5120, stride_y=5120))
    # the norm as the op dispatches it (no quant) at V4.1's and V4-Pro's widths up to MAX_D, and with the fp8 quant
    for d, quant in ((5120, 0), (1280, 0), (512, 0), (128, 0), (64, 0), (7168, 0), (16384, 0), (5120, 1), (1280, 1)):
        bd, br, warps = norm_tiles(d)
        build(_rms_norm_kernel, ptrs, dict(D=d, BLOCK_D=bd, BLOCK_R=br, QUANT=quant, QBLOCK=32), ("eps",),
              num_warps=warps, ints=dict(stride_x=d))  # rows: unmarked
    # Engram's gate + update at V4.1-Flash's shape (hc 4, D 5,120; the wrapper's 1,024-wide chunks), with a mask
    for masked in (False, True):
        build(_engram_gate_kernel, {"w_ptr": "*fp32", "mask_ptr": "*i1"},
              dict(HC=4, D=5120, BLOCK_D=1024, HAS_MASK=masked), ("eps", "scale", "floor"))
    # the indexer top-k's keys (bf16 bits in, int32 keys out)
    build(_order_keys_kernel, {"x_ptr": "*i16", "out_ptr": "*i32"}, dict(BLOCK=ORDER_KEYS_BLOCK))
    # the MoE side at V4.1-Flash's shapes (384 experts x D 5,120, top 6; moe_inter_dim 2,304; EP4's 96 local experts):
    # the few-rows gate's logits at each decode tiling of FEW_ROWS_BY_TOKENS and their pick, the fused gate
    # (prefill: CONFIGS' first), the one-program route plan (decode steps, both step widths), the routed experts'
    # grouped MXFP4 GEMMs (swiglu and down, BLOCK_M rows) and the combine (shared output added)
    gate_ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "part_ptr": "*fp32", "debug_ptr": "*fp32", "bias_ptr": "*fp32",
                 "bias_img_ptr": "*fp32", "img_ptr": "*u8", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                 "logits_ptr": "*fp32", "scores_ptr": "*fp32"}
    na, nb = gate_column_blocks(384)
    for _, tiles in FEW_ROWS_BY_TOKENS:
        bt = tiles.rows_per_program(tiles.BT_MAX)
        build(_gate_logits_kernel, gate_ptrs,
              dict(D=5120, E=384, BT=bt, BE=tiles.BE, BK=tiles.BK, K_PIECE=tiles.K_PIECE,
                   TENSOR_CORES=tiles.tensor_cores, DOT_DTYPE=triton.language.bfloat16),
              num_warps=tiles.num_warps, ints=dict(stride_x=5120))
        pieces = triton.cdiv(5120, tiles.K_PIECE)
        build(_gate_pick_kernel, gate_ptrs, dict(E=384, K=6, KP=8, NA=na, NB=nb, NORMALIZE=True, HAS_IMG=False,
                                                 DEBUG=False, LIBDEVICE=True, BM=tiles.BM, PIECES=pieces,
                                                 PP=triton.next_power_of_2(pieces)),
              ("temp", "route_scale", "eps"), num_warps=tiles.pick_warps)
    cfg = GATE_CONFIGS[0]
    build(_gate_kernel, gate_ptrs, dict(D=5120, E=384, K=6, KP=8, NA=na, NB=nb, NORMALIZE=True, HAS_IMG=False,
                                        DEBUG=False, LIBDEVICE=True, DOT_DTYPE=triton.language.bfloat16, BM=cfg.BM,
                                        BK=cfg.BK, STEPS=cfg.steps, INNER_LOOP=cfg.inner_loop),
          ("temp", "route_scale", "eps"), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
          ints=dict(stride_x=5120), spills=True)  # 64 bytes a thread under Triton 3.6, 288 under 3.9
    route_ptrs = {n: "*i32" for n in ("offset_ptr", "token_ptr", "slot_row_ptr", "tile_expert_ptr", "tile_start_ptr",
                                      "tile_end_ptr")}
    route_ptrs.update(ids_ptr="*i64", weights_ptr="*fp32", weight_ptr="*fp32")
    eb, sub, step = route_launch_sizes(96)
    for sub_, warps in ((sub, 4), (ROUTE_WIDE_STEP, ROUTE_WIDE_STEP_WARPS)):
        build(_plan_one_kernel, route_ptrs, dict(E=96, K=6, SUB=sub_, EB=eb, TILE_M=0, TB=step), num_warps=warps,
              spills=sub_ == ROUTE_WIDE_STEP)  # the wide step: 64 bytes a thread under Triton 3.9, none under 3.6
    experts = {"a_ptr": "*bf16", "token_ptr": "*i32", "route_w_ptr": "*fp32", "out_ptr": "*bf16", "w_ptr": "*u8",
               "ws_ptr": "*u8", "v_ptr": "*u8", "vs_ptr": "*u8", "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32",
               "tile_end_ptr": "*i32"}
    for kind, n, k, swiglu in (("swiglu", 2304, 5120, True), ("down", 5120, 2304, False)):
        cfg = MXFP4_CONFIG[kind]
        build(_grouped_mxfp4_kernel, experts,
              dict(K=k, GATHER=swiglu, SWIGLU=swiglu, ROUND_BF16=True, QUANT_BLOCK=32 if swiglu else 0,
                   EVEN_K=k % cfg["BK"] == 0, DOT_DTYPE=triton.language.bfloat16, DOT_PRECISION=None, SWAP_AB=False,
                   BM=MXFP4_BLOCK_M, BN=cfg["BN"], BK=cfg["BK"]),
              ("limit",), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
              spills=swiglu,  # 104 bytes a thread under Triton 3.6, none under 3.9
              ints=dict(N=n, stride_a=k, stride_out=n, stride_we=n * k // 2, stride_wn=k // 2, stride_se=n * k // 32,
                        stride_sn=k // 32))
    build(_moe_combine_kernel, {"y_ptr": "*bf16", "ids_ptr": "*i64", "slot_row_ptr": "*i32", "add_ptr": "*bf16",
                                "out_ptr": "*bf16"},
          dict(K=6, HAS_ADD=True, ROUND_BF16=True, BD=1024),
          ints=dict(D=5120, stride_y=5120, stride_ids=6, stride_slot=6, stride_add=5120, stride_out=5120))
    # the activation quant at V4.1's width (the routed experts' gathered rows: a wave that loops to the device's
    # count), the EP exchange's wire encode (with the routing, and without) and its decode (gathered and not), and
    # mHC's expand (hc 4, D 5,120, the wrapper's 2 x 512 tiles)
    groups = min(512 // 32, triton.next_power_of_2(5120 // 32))
    for gather in (False, True):
        build(_act_quant_kernel, {"out_ptr": "*bf16", "src_row_ptr": "*i32", "n_valid_ptr": "*i32"},
              dict(BLOCK=32, GROUPS=groups, ROWS=ACT_TILE_ROWS, GATHER=gather, QUANT=True),
              ints=dict(n_cols=5120, stride_x=5120, stride_out=5120))
        build(_wire_decode_kernel, {"codes_ptr": "*u8", "scales_ptr": "*u8", "src_row_ptr": "*i32",
                                    "n_valid_ptr": "*i32"},
              dict(BLOCK=32, GROUPS=groups, ROWS=ACT_TILE_ROWS, GATHER=gather),
              ints=dict(n_cols=5120, stride_codes=5120, stride_scales=160, stride_out=5120))
    wire = {"codes_ptr": "*u8", "scales_ptr": "*u8", "ids_ptr": "*i64", "wts_ptr": "*fp32", "ids_out_ptr": "*i32",
            "wts_out_ptr": "*fp32"}
    for routing in (True, False):
        build(_wire_encode_kernel, wire, dict(BLOCK=32, GROUPS=groups, ROWS=ACT_TILE_ROWS, KP=8, ROUTING=routing),
              # the send buffer's rows (mini.parallel.exchange): 6 ids and 6 weights, 5,120 codes, 160 scale bytes
              ints=dict(n_cols=5120, k=6 if routing else 0, stride_x=5120, stride_codes=5328, stride_scales=5328,
                        stride_ids=6 if routing else 0, stride_wts=6 if routing else 0,
                        stride_ids_out=5328 // 4 if routing else 0, stride_wts_out=5328 // 4 if routing else 0))
    build(_mhc_expand_kernel, {"post_ptr": "*fp32", "comb_ptr": "*fp32"}, dict(D=5120, HC=4, BLOCK_T=2, BLOCK_D=512))
    # the index top-k's ids in one pass (one build for every row width)
    # the default search and the 4-bit histogram one (REG 64 / 128, 0-64 stack bytes under 3.6; 8 bits: 374K)
    for block, warps in TOP_IDS_WARPS.items():  # both builds, bounded or not by n_visible
        for bounded, radix in itertools.product((False, True), dict.fromkeys((TOP_IDS_RADIX, 0))):
            build(_top_ids_kernel, {"x_ptr": "*i16", "ids_ptr": "*i64", "count_ptr": "*i32", "n_visible_ptr": "*i64"},
                  dict(BLOCK=block, BOUNDED=bounded, RADIX=radix), num_warps=warps,
                  spills=True,  # (the bisection spilled 16 / 8 bytes once; the 4-bit search's wide build 64)
                  max_cubin_kb={1024: 128, 4096: 320}[block])  # the bisection: 92K / 200K (unrolled 582K / 1,120K)
    # the split candidate (`top_ids(split=True)`): 4,096-column chunks' candidates, then their merge (up to 8,192)
    build(_chunk_candidates_kernel, {"x_ptr": "*i16", "cand_ptr": "*i32", "n_visible_ptr": "*i64"},
          dict(CHUNK=4096, RADIX=TOP_IDS_RADIX), num_warps=TOP_IDS_WARPS[4096], max_cubin_kb=320)
    for merge in (4096, 8192):
        build(_merge_candidates_kernel, {"x_ptr": "*i16", "cand_ptr": "*i32", "ids_ptr": "*i64", "count_ptr": "*i32"},
              dict(BLOCK=merge, RADIX=TOP_IDS_RADIX), num_warps=merge_warps(merge), max_cubin_kb=320,
              spills=True)  # (none under Triton 3.6, the GPU image's; 32 bytes at 8,192 under 3.9)


if __name__ == "__main__":
    main()
