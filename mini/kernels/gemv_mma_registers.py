"""The FP8 read of 2-16 rows with the operands loaded straight into the MMA's registers (a Gluon kernel; a candidate
build of mini.kernels.gemv's `fp8_mma` read, `GemvConfig.gluon_k_width` > 0).

The Triton build of the same read (`_gemv_fp8_mma_kernel`) runs at 0.2-0.38 of the copy rate in its bytes: Triton
picks Hopper's wgmma, whose x operand must sit in shared memory, and moves both scales into the accumulator's
layout through shared memory, 6 barriers a scale block (docs/perf/045). Here the layouts are stated (Gluon,
`triton.experimental.gluon`, which ships with Triton 3.6): each warp owns 16-row tiles of W and loads its bytes
directly in the register layout of Ampere's mma.sync (m16n8, `DotOperandLayout`), so no byte passes through shared
memory and no barrier is ever taken:
- a warp's lanes hold `K_WIDTH` consecutive bytes of a row each (8: one 64-bit load; 4 lanes cover a 32-wide scale
  block; the MMA's k order is permuted the same way in both operands, which leaves each product where it was);
- x's rows arrive in the MMA's other operand layout, where one scale block of a row is spread over 4 lanes: its
  amax is two warp shuffles, then each lane rounds its own values to e4m3 (mini/kernels/quant.py's
  `fp8_group_codes`, restated here in Gluon: same bits); the x codes form (FP8Rows) loads the codes instead;
- per scale block the MMA sums from zero (on the GPU image's Triton the e4m3 operands are widened to f16, exact,
  and summed in fp32) and the block's [16, 8] sums are scaled by the row's and the token's powers of two (exact)
  into the fp32 accumulator: the bf16 copy's exact products, summed in fp32 in the MMA's order;
- by default each block's bytes are loaded in the loop, none carried ahead: other warps' loads hide a warp's wait
  (a prefetched e4m3 tile carried across iterations costs ~90 byte moves a block; builds with 1-2 blocks carried
  ahead so were 18-56% slower on an H100 at every V4.1 shape, docs/perf/048). A warp then has one block (1 KB) in
  flight. `AHEAD` 1 (`GemvConfig.gluon_ahead`, the default build's) loads the next block while it works on one:
  W and bf16 x as int32 words, carried as such (no byte moves); at use `_w_codes` hands each word to the MMA as
  its 4 bytes without moving one (sm_90a SASS: the loaded registers are the MMA's operands). The loads sit behind
  an always-true branch: in one basic block with the MMAs ptxas issued them after the MMAs. On an H100 it is
  0.5-2.2% faster at 6 rows than loading in the loop; 2 and 3 blocks ahead were not faster (docs/perf/053).
Split-K pieces and their sum are gemv.py's (`_sum_pieces_kernel`); summed instead by each N block's last program, as
the one-row read does, these reads were 1.5-1.8 us slower at wo_b and the shared expert's (88 registers a thread
against 56, and the tail's code) and the B = 1 verify step 12.90 -> 13.13 ms (docs/perf/051). Gluon kernels run on
CUDA only (not under Triton's interpreter): the CPU tests build it for sm_90 (tests/kernels/sm90_build.py) and its
parity tests are `gpu`-marked.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def _e8m0_value(s):
    """E8M0 bytes (int32) -> fp32 2^(s - 127), as mini/kernels/quant.py's e8m0_value (0: 2^-127, 255: NaN)."""
    return gl.where(s == 0, 0x00400000, gl.where(s == 255, 0x7FC00000, s << 23)).to(gl.float32, bitcast=True)


# What x is (X_MODE): bf16 values taken as they are (no activation quant: V4.1's wo_a), bf16 fake-quantized to FP8
# in the weight's blocks as it is loaded (the official FP8 GEMM's act quant), or its FP8 codes and E8M0 bytes given
X_BF16, X_QUANT, X_CODES = 0, 1, 2


@gluon.jit
def _x_load(x_ptrs, e_ptrs, k0, x_ok, t_ok, W_BLOCK: gl.constexpr, X_MODE: gl.constexpr):
    """One scale block of x as loaded (bf16 values, or its codes), and (X_CODES) its rows' E8M0 bytes (else x)."""
    x = gl.load(x_ptrs + k0, mask=x_ok, other=0.0)
    e = x
    if X_MODE == 2:
        e = gl.load(e_ptrs + k0 // W_BLOCK, mask=t_ok, other=127)
    return x, e


@gluon.jit
def _x_codes(x, e, X_MODE: gl.constexpr, acc_l: gl.constexpr):
    """A loaded block of x in X_QUANT / X_CODES mode: (its e4m3 codes in the MMA's operand layout, each row's scale
    2^(e - 127) in the accumulator's column layout); X_QUANT quantizes bf16 x here (fp8_group_codes' formula)."""
    if X_MODE == 2:
        return x, _e8m0_value(e.to(gl.int32))
    x = x.to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(x), axis=0), 1e-4) * (1.0 / 448.0)
    bits = amax.to(gl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(gl.int32)
    inv = ((254 - e) << 23).to(gl.float32, bitcast=True)
    codes = gl.minimum(gl.maximum(x * gl.expand_dims(inv, 0), -448.0), 448.0).to(gl.float8e4nv)
    return codes, _e8m0_value(gl.convert_layout(e, gl.SliceLayout(0, acc_l)))


@gluon.jit
def _block_sums(acc, w, x, e, s_w, x_dot: gl.constexpr, X_MODE: gl.constexpr, acc_l: gl.constexpr):
    """acc + one scale block's sums: W's e4m3 tile w [BLOCK_N, W_BLOCK] against x's loaded block, from zero in the
    MMA, scaled by the rows' scales s_w (fp32 powers of two) and x's."""
    zero = gl.zeros(acc.shape, gl.float32, acc_l)
    if X_MODE == 0:
        x = gl.convert_layout(x, x_dot, assert_trivial=True)
        return acc + mma_v2(w.to(gl.bfloat16), x, zero) * gl.expand_dims(s_w, 1)
    codes, s_x = _x_codes(x, e, X_MODE, acc_l)
    d = mma_v2(w, gl.convert_layout(codes, x_dot, assert_trivial=True), zero)
    return acc + d * gl.expand_dims(s_w, 1) * gl.expand_dims(s_x, 0)


@gluon.jit
def _w_codes(words, BLOCK_N: gl.constexpr, W_BLOCK: gl.constexpr, w_l: gl.constexpr):
    """A block of W carried as int32 words [BLOCK_N, W_BLOCK // 4] -> its e4m3 tile in the MMA's layout, no byte
    moved: each word is copied to its 4 byte slots (two joins: registers) and one asm instance a word returns it as
    their 4 packed bytes, which the MMA then takes as the same 32-bit register (a carried e4m3 tile is moved byte by
    byte instead)."""
    pair = gl.join(words, words)
    wide = gl.reshape(gl.join(pair, pair), [BLOCK_N, W_BLOCK])
    codes = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [wide], dtype=gl.int8, is_pure=True, pack=4)
    return gl.convert_layout(codes.to(gl.float8e4nv, bitcast=True), w_l, assert_trivial=True)


@gluon.jit
def _fetch(w_ptrs, w_ok, s_ptrs, x_ptrs, e_ptrs, x_ok, t_ok, k0, W_BLOCK: gl.constexpr, X_MODE: gl.constexpr):
    """The loads of the scale block at k0 for a loop that works on them later: W's words, the rows' E8M0 bytes, x
    (bf16 x as words, its codes as they are) and (X_CODES) x's E8M0 bytes."""
    w = gl.load(w_ptrs + k0 // 4, mask=w_ok, other=0)
    s = gl.load(s_ptrs + k0 // W_BLOCK)
    if X_MODE == 2:
        x, e = _x_load(x_ptrs, e_ptrs, k0, x_ok, t_ok, W_BLOCK, X_MODE)
    else:
        x = gl.load(x_ptrs + k0 // 2, mask=x_ok, other=0)
        e = x
    return w, s, x, e


@gluon.constexpr_function
def _x_words_layout(w_block, tp, warps):
    """bf16 x's block as int32 words [W_BLOCK // 2, TP] where x's operand layout holds their bf16 pairs: 4 words (8
    values) of a token's row a lane, lane % 4 the 8-value chunk of each 32-wide span, lane // 4 the token, further
    spans and tokens in registers, every warp the same (x_l less its lowest bit of k)."""
    log2 = lambda v: v.bit_length() - 1
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0]] + [[16 << i, 0] for i in range(log2(w_block // 32))]
        + [[0, 8 << i] for i in range(log2(tp // 8))],
        lane_bases=[[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[[0, 0]] * log2(warps), block_bases=[],
        shape=[w_block // 2, tp])


@gluon.jit
def _w_words(w_ptr, pid_n, N, stride_w, BLOCK_N: gl.constexpr, W_BLOCK: gl.constexpr, acc_l: gl.constexpr):
    """(pointers, mask) of a block's W as int32 words [BLOCK_N, W_BLOCK // 4] at k = 0, in the accumulator's layout:
    a lane's two words are the 8 bytes of a row the MMA's A operand takes from it (`_w_codes`)."""
    n_w = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
    j_w = gl.arange(0, W_BLOCK // 4, layout=gl.SliceLayout(0, acc_l))
    ptrs = (w_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + gl.expand_dims(n_w.to(gl.int64) * (stride_w // 4), 1)
            + gl.expand_dims(j_w, 0))
    return ptrs, gl.expand_dims(n_w < N, 1) & gl.expand_dims(j_w < W_BLOCK // 4, 0)


@gluon.jit
def _x_words(x_ptr, T, stride_x, W_BLOCK: gl.constexpr, TP: gl.constexpr, WARPS: gl.constexpr):
    """(pointers, mask) of a block of bf16 x as int32 words [W_BLOCK // 2, TP] at k = 0 (`_x_words_layout`)."""
    xw_l: gl.constexpr = _x_words_layout(W_BLOCK, TP, WARPS)
    j_x = gl.arange(0, W_BLOCK // 2, layout=gl.SliceLayout(1, xw_l))
    t_x = gl.arange(0, TP, layout=gl.SliceLayout(0, xw_l))
    ptrs = (x_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + gl.expand_dims(t_x.to(gl.int64) * (stride_x // 2), 0)
            + gl.expand_dims(j_x, 1))
    return ptrs, gl.expand_dims(j_x < W_BLOCK // 2, 1) & gl.expand_dims(t_x < T, 0)


@gluon.jit
def _x_values(words, W_BLOCK: gl.constexpr, TP: gl.constexpr, x_l: gl.constexpr):
    """A block of bf16 x carried as int32 words [W_BLOCK // 2, TP] -> its values [W_BLOCK, TP] in x's layout, as
    `_w_codes` does for W (two bf16 a word)."""
    wide = gl.reshape(gl.permute(gl.join(words, words), (0, 2, 1)), [W_BLOCK, TP])
    x = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [wide], dtype=gl.bfloat16, is_pure=True, pack=2)
    return gl.convert_layout(x, x_l, assert_trivial=True)


@gluon.jit
def _gemv_fp8_mma_registers_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, T, N, K, stride_x, stride_w, stride_s,
                                   stride_y, K_PIECE, e_ptr, stride_e, BLOCK_N: gl.constexpr, TP: gl.constexpr,
                                   SPLIT: gl.constexpr, W_BLOCK: gl.constexpr, K_WIDTH: gl.constexpr,
                                   X_MODE: gl.constexpr, GROUP_N, AHEAD: gl.constexpr = 0):
    """Program (n block, K piece): acc[BLOCK_N, TP] = sum over the piece's scale blocks b of
    (W_q[n, b] @ x_q[t, b]^T) * s_w[n, b] * s_x[t, b]; SPLIT: fp32 to part[piece, t, n], else bf16 to y[t, n].
    The arguments are `_gemv_fp8_mma_kernel`'s (gemv.py); K is a multiple of W_BLOCK. X_BF16: x as it is (the
    e4m3 weight widened to bf16, exact; |x| < 2^119 so that no q x overflows fp32), s_x = 1; then x is [T, G K] and
    the block's rows take group n // GROUP_N of it (x[:, g K:(g + 1) K]: a block-diagonal projection).
    AHEAD 1: the loop loads the next block (W and bf16 x as int32 words, the scales) before it works on the one
    loaded before: the same products and sums, one more block of W in flight a warp."""
    WARPS: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    w_l: gl.constexpr = gl.DotOperandLayout(0, acc_l, K_WIDTH)
    # x's operand layout as a linear layout: the same registers, and a reduction over it builds (Triton 3.6 cannot
    # verify one over a dot-operand layout while it builds it)
    x_dot: gl.constexpr = gl.DotOperandLayout(1, acc_l, K_WIDTH)
    x_l: gl.constexpr = gl.to_linear_layout(x_dot, [W_BLOCK, TP])
    pid_n = gl.program_id(0)
    piece = gl.program_id(1)
    x_ptr += (pid_n * BLOCK_N // GROUP_N).to(gl.int64) * K  # the group of x the block's rows take (0: one group)
    k_lo = piece * K_PIECE
    k_hi = gl.minimum(k_lo + K_PIECE, K)

    k_x = gl.arange(0, W_BLOCK, layout=gl.SliceLayout(1, x_l))
    t_x = gl.arange(0, TP, layout=gl.SliceLayout(0, x_l))
    x_ptrs = x_ptr + gl.expand_dims(t_x.to(gl.int64) * stride_x, 0) + gl.expand_dims(k_x, 1)
    x_ok = gl.expand_dims(k_x < W_BLOCK, 1) & gl.expand_dims(t_x < T, 0)
    n_c = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
    t_c = gl.arange(0, TP, layout=gl.SliceLayout(0, acc_l))
    s_ptrs = s_ptr + (gl.minimum(n_c, N - 1) // W_BLOCK).to(gl.int64) * stride_s  # each row's scale row
    e_ptrs = e_ptr + t_c.to(gl.int64) * stride_e
    t_ok = t_c < T

    acc = gl.zeros([BLOCK_N, TP], gl.float32, acc_l)
    if AHEAD == 0:
        n_w = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_l))
        k_w = gl.arange(0, W_BLOCK, layout=gl.SliceLayout(0, w_l))
        w_ptrs = w_ptr + gl.expand_dims(n_w.to(gl.int64) * stride_w, 1) + gl.expand_dims(k_w, 0)
        w_ok = gl.expand_dims(n_w < N, 1) & gl.expand_dims(k_w < W_BLOCK, 0)
        for k0 in range(k_lo, k_hi, W_BLOCK):
            w = gl.load(w_ptrs + k0, mask=w_ok, other=0.0)
            s_w = _e8m0_value(gl.load(s_ptrs + k0 // W_BLOCK).to(gl.int32))
            x, e = _x_load(x_ptrs, e_ptrs, k0, x_ok, t_ok, W_BLOCK, X_MODE)
            acc = _block_sums(acc, w, x, e, s_w, x_dot, X_MODE, acc_l)
    else:
        # W and (bf16) x as int32 words: a word pair a lane where the MMA's operands take their 8 bytes (_w_codes)
        w_ptrs, w_ok = _w_words(w_ptr, pid_n, N, stride_w, BLOCK_N, W_BLOCK, acc_l)
        if X_MODE != 2:
            x_ptrs, x_ok = _x_words(x_ptr, T, stride_x, W_BLOCK, TP, WARPS)
        k_last = k_hi - W_BLOCK  # the load past the piece's end takes its last block again (an L1 hit)
        w_1, s_1, x_1, e_1 = _fetch(w_ptrs, w_ok, s_ptrs, x_ptrs, e_ptrs, x_ok, t_ok, k_lo, W_BLOCK, X_MODE)
        for k0 in range(k_lo, k_hi, W_BLOCK):
            w, s, x, e = w_1, s_1, x_1, e_1
            k_n = gl.minimum(k0 + W_BLOCK, k_last)
            # always true: the branch keeps the loads in their own block, which ptxas issues before this step's
            # MMAs (in one block with them it issued them after: no overlap)
            if k_n >= 0:
                w_1, s_1, x_1, e_1 = _fetch(w_ptrs, w_ok, s_ptrs, x_ptrs, e_ptrs, x_ok, t_ok, k_n, W_BLOCK, X_MODE)
            if X_MODE != 2:
                x = _x_values(x, W_BLOCK, TP, x_l)
            acc = _block_sums(acc, _w_codes(w, BLOCK_N, W_BLOCK, w_l), x, e, _e8m0_value(s.to(gl.int32)), x_dot,
                              X_MODE, acc_l)

    ok = gl.expand_dims(n_c < N, 1) & gl.expand_dims(t_ok, 0)
    if SPLIT:
        at = gl.expand_dims(t_c.to(gl.int64) * N, 0) + gl.expand_dims(n_c, 1)
        gl.store(part_ptr + piece.to(gl.int64) * T * N + at, acc, mask=ok)
    else:
        gl.store(y_ptr + gl.expand_dims(t_c.to(gl.int64) * stride_y, 0) + gl.expand_dims(n_c, 1),
                 acc.to(y_ptr.dtype.element_ty), mask=ok)
