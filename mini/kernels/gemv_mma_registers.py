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
- each block's bytes are loaded in the loop, none carried ahead: other warps' loads hide a warp's wait (a
  prefetched e4m3 tile carried across iterations costs ~90 byte moves a block; builds with 1-2 blocks carried
  ahead were 18-56% slower on an H100 at every V4.1 shape, docs/perf/048).
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
def _x_block(x_ptrs, e_ptrs, k0, x_ok, t_ok, W_BLOCK: gl.constexpr, X_MODE: gl.constexpr, acc_l: gl.constexpr):
    """One scale block of x in X_QUANT / X_CODES mode: (its e4m3 codes in the MMA's operand layout, each row's scale
    2^(e - 127) in the accumulator's column layout); X_QUANT quantizes bf16 x here (fp8_group_codes' formula)."""
    if X_MODE == 2:
        codes = gl.load(x_ptrs + k0, mask=x_ok, other=0.0)
        s_x = _e8m0_value(gl.load(e_ptrs + k0 // W_BLOCK, mask=t_ok, other=127).to(gl.int32))
    else:
        x = gl.load(x_ptrs + k0, mask=x_ok, other=0.0).to(gl.float32)
        amax = gl.maximum(gl.max(gl.abs(x), axis=0), 1e-4) * (1.0 / 448.0)
        bits = amax.to(gl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(gl.int32)
        inv = ((254 - e) << 23).to(gl.float32, bitcast=True)
        codes = gl.minimum(gl.maximum(x * gl.expand_dims(inv, 0), -448.0), 448.0).to(gl.float8e4nv)
        s_x = _e8m0_value(gl.convert_layout(e, gl.SliceLayout(0, acc_l)))
    return codes, s_x


@gluon.jit
def _gemv_fp8_mma_registers_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, T, N, K, stride_x, stride_w, stride_s,
                                   stride_y, K_PIECE, e_ptr, stride_e, BLOCK_N: gl.constexpr, TP: gl.constexpr,
                                   SPLIT: gl.constexpr, W_BLOCK: gl.constexpr, K_WIDTH: gl.constexpr,
                                   X_MODE: gl.constexpr, GROUP_N):
    """Program (n block, K piece): acc[BLOCK_N, TP] = sum over the piece's scale blocks b of
    (W_q[n, b] @ x_q[t, b]^T) * s_w[n, b] * s_x[t, b]; SPLIT: fp32 to part[piece, t, n], else bf16 to y[t, n].
    The arguments are `_gemv_fp8_mma_kernel`'s (gemv.py); K is a multiple of W_BLOCK. X_BF16: x as it is (the
    e4m3 weight widened to bf16, exact; |x| < 2^119 so that no q x overflows fp32), s_x = 1; then x is [T, G K] and
    the block's rows take group n // GROUP_N of it (x[:, g K:(g + 1) K]: a block-diagonal projection)."""
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

    n_w = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_l))
    k_w = gl.arange(0, W_BLOCK, layout=gl.SliceLayout(0, w_l))
    w_ptrs = w_ptr + gl.expand_dims(n_w.to(gl.int64) * stride_w, 1) + gl.expand_dims(k_w, 0)
    w_ok = gl.expand_dims(n_w < N, 1) & gl.expand_dims(k_w < W_BLOCK, 0)
    k_x = gl.arange(0, W_BLOCK, layout=gl.SliceLayout(1, x_l))
    t_x = gl.arange(0, TP, layout=gl.SliceLayout(0, x_l))
    x_ptrs = x_ptr + gl.expand_dims(t_x.to(gl.int64) * stride_x, 0) + gl.expand_dims(k_x, 1)
    x_ok = gl.expand_dims(k_x < W_BLOCK, 1) & gl.expand_dims(t_x < T, 0)
    n_c = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
    t_c = gl.arange(0, TP, layout=gl.SliceLayout(0, acc_l))
    s_ptrs = s_ptr + (gl.minimum(n_c, N - 1) // W_BLOCK).to(gl.int64) * stride_s  # each row's scale row
    e_ptrs = e_ptr + t_c.to(gl.int64) * stride_e
    t_ok = t_c < T

    zero = gl.zeros([BLOCK_N, TP], gl.float32, acc_l)
    acc = gl.zeros([BLOCK_N, TP], gl.float32, acc_l)
    for k0 in range(k_lo, k_hi, W_BLOCK):
        w = gl.load(w_ptrs + k0, mask=w_ok, other=0.0)
        s_w = _e8m0_value(gl.load(s_ptrs + k0 // W_BLOCK).to(gl.int32))
        if X_MODE == 0:
            x = gl.convert_layout(gl.load(x_ptrs + k0, mask=x_ok, other=0.0), x_dot, assert_trivial=True)
            acc += mma_v2(w.to(gl.bfloat16), x, zero) * gl.expand_dims(s_w, 1)
        else:
            codes, s_x = _x_block(x_ptrs, e_ptrs, k0, x_ok, t_ok, W_BLOCK, X_MODE, acc_l)
            d = mma_v2(w, gl.convert_layout(codes, x_dot, assert_trivial=True), zero)
            acc += d * gl.expand_dims(s_w, 1) * gl.expand_dims(s_x, 0)

    ok = gl.expand_dims(n_c < N, 1) & gl.expand_dims(t_ok, 0)
    if SPLIT:
        at = gl.expand_dims(t_c.to(gl.int64) * N, 0) + gl.expand_dims(n_c, 1)
        gl.store(part_ptr + piece.to(gl.int64) * T * N + at, acc, mask=ok)
    else:
        gl.store(y_ptr + gl.expand_dims(t_c.to(gl.int64) * stride_y, 0) + gl.expand_dims(n_c, 1),
                 acc.to(y_ptr.dtype.element_ty), mask=ok)
