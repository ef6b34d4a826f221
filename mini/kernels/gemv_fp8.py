"""Dense projections at decode row counts (T <= 16) from the checkpoint's FP8 weights, on Hopper's FP8 tensor cores:
y[T, N] = fp8_act_quant(x)[T, K] @ W[N, K]^T with W as stored (e4m3 bytes, one E8M0 scale per QB x QB tile).

At 1-16 rows a projection is one read of its weight. The bf16 GEMV (mini/kernels/gemv.py) reads the weight's
dequantized bf16 copy, twice the checkpoint's bytes; a first FP8 variant that decoded each e4m3 byte to bf16 in
registers was slower than it at every V4.1 shape (docs/perf/018: a conversion, a NaN select and a scale multiply
per element, ALU- and layout-bound). This kernel decodes nothing: it multiplies the FP8 bytes as they are.
- The activation's FP8 fake quant (1 x QB groups, mini/kernels/quant.py's formulas: the same values as
  fp8_act_quant) is done on each x tile as it is loaded, keeping its e4m3 values and power-of-two scales apart.
- Each QB-deep block of K is one MMA of e4m3 x e4m3 with fp32 output (wgmma k32 on Hopper: the weight's 64 rows
  are M, x's rows padded to 16 are N), started from zero; its result is scaled by the weight tile's scale times
  the row's activation scale (both powers of two: exact) and added to the fp32 accumulator in K order. That is
  the official blockwise arithmetic (mini.ops.linear.blockwise_gemm, and the official FP8 GEMM kernels, which run
  the same block sums on FP8 tensor cores), so the result differs from the fp32 reference only in how the tensor
  core sums a block's QB exact products, and, with a split over K, in the order the pieces are added.
- Programs own BLOCK_N weight rows and a piece of K (gemv.split_k, the same plan as the bf16 GEMV), walking it in
  BLOCK_K steps of whole QB blocks, software-pipelined over `num_stages`; pieces' fp32 partials are summed by the
  bf16 GEMV's `_sum_pieces_kernel` in a tree fixed by the shape.
A row's MMAs never mix rows and the split depends on N and K only, so row t's bits do not depend on T. The result
is not the bf16 GEMV's bits (other block sums); it is checked against the fp32 blockwise reference.
The deterministic mode never reaches this kernel (mini.ops.linear keeps its batch-invariant GEMMs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mini.kernels.device_info import sm_count
from mini.kernels.gemv import DEFAULT, MAX_ROWS, GemvConfig, _sum_pieces_kernel, split_k
from mini.kernels.quant import e4m3_round, e4m3_value, e8m0_value, fp8_group_codes

# the tilings `mini bench kernels --only decode_gemv` times for this kernel (DEFAULT: 64 x 128, 4 stages)
CANDIDATES = {"64x128 s4": DEFAULT, "64x128 s6": GemvConfig(64, 128, 4, 6), "64x256 s4": GemvConfig(64, 256, 4, 4),
              "64x128 s3 4/SM": GemvConfig(64, 128, 4, 3, programs_per_sm=4)}
TUNED: dict[tuple[int, int], GemvConfig] = {}  # [N, K] -> a faster build than DEFAULT, once measured


def config_for(N: int, K: int) -> GemvConfig:
    return TUNED.get((N, K), DEFAULT)


@triton.jit(do_not_specialize=["T"])
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, T, N, K, stride_x, stride_w, stride_s, stride_y, K_PIECE,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QB: tl.constexpr, TP: tl.constexpr,
                     SPLIT: tl.constexpr, FP8_DOT: tl.constexpr):
    """Program (n block, K piece): acc[BLOCK_N, TP] = sum over the piece's QB blocks kb of
    (W[n, kb] . q[t, kb]) * sw[n // QB, kb] * sx[t, kb]; SPLIT: fp32 to part[piece, t, n], else to y[t, n].
    W: e4m3 bytes; s: E8M0 bytes; x: bf16, quantized here. FP8_DOT False (the interpreter): the same exact values
    multiplied in fp32."""
    pid_n, piece = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    t = tl.arange(0, TP)
    t_ok = t < T
    kk = tl.arange(0, QB)
    k_lo = piece * K_PIECE
    k_hi = tl.minimum(k_lo + K_PIECE, K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_w + kk[None, :]
    x_ptrs = x_ptr + t[:, None].to(tl.int64) * stride_x + kk[None, :]
    s_ptrs = s_ptr + (n // QB).to(tl.int64) * stride_s
    acc = tl.zeros([BLOCK_N, TP], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        for j in tl.static_range(BLOCK_K // QB):
            k = k0 + j * QB
            k_in = (k + kk < K)[None, :]  # K is a multiple of QB (the wrapper checks): a block is wholly in or out
            w = tl.load(w_ptrs + k, mask=n_ok[:, None] & k_in, other=0)
            x = tl.load(x_ptrs + k, mask=t_ok[:, None] & k_in, other=0.0).to(tl.float32)
            sw = e8m0_value(tl.load(s_ptrs + k // QB, mask=n_ok & (k + 0 * n < K), other=127).to(tl.int32))
            a, e = fp8_group_codes(x, 1, QB, TP)  # e4m3-range values [TP, 1, QB], scale bytes [TP, 1]
            sx = tl.reshape((e << 23).to(tl.float32, bitcast=True), [TP])
            if FP8_DOT:  # the hardware's conversion rounds as e4m3_round does (to nearest, ties to even)
                q = tl.reshape(a, [TP, QB]).to(tl.float8e4nv)
                d = tl.dot(w.to(tl.float8e4nv, bitcast=True), tl.trans(q))
            else:  # the interpreter casts with ties away from zero: the bit-arithmetic rounding
                d = tl.dot(e4m3_value(w), tl.trans(tl.reshape(e4m3_round(a), [TP, QB])))
            acc += d * (sw[:, None] * sx[None, :])
    ok = n_ok[:, None] & t_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + piece.to(tl.int64) * T * N + t[None, :].to(tl.int64) * N + n[:, None], acc, mask=ok)
    else:
        tl.store(y_ptr + t[None, :].to(tl.int64) * stride_y + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=ok)


def gemv_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int, out: torch.Tensor | None = None,
             config: GemvConfig | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [T, K] bf16 (T <= 16), w float8_e4m3fn [N, K] row-major, w_scale E8M0 [ceil(N / block), K / block] (uint8 or
    float8_e8m0fnu), block 32-128 (a power of two: the weight tile and the activation quant group) -> [T, N] in
    `out_dtype` (into `out` when given): the FP8 linear of mini.ops.linear (x fake-quantized in 1 x block groups)
    as blockwise sums on FP8 tensor cores (module docstring). `config` None: `config_for` the weight's shape."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv_fp8: x [T, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != torch.bfloat16 or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"gemv_fp8: bf16 x and float8_e4m3fn w expected, got {x.dtype} and {w.dtype}")
    T, K = x.shape
    N = w.shape[0]
    if block not in (32, 64, 128):
        raise ValueError(f"gemv_fp8: block must be 32, 64 or 128 (one FP8 MMA depth or more), got {block}")
    if K % block:
        raise ValueError(f"gemv_fp8: K {K} is not a multiple of the block {block}")
    want = (triton.cdiv(N, block), K // block)
    if tuple(w_scale.shape) != want or w_scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise ValueError(f"gemv_fp8: w_scale must be E8M0 bytes {list(want)} for w {list(w.shape)} in {block} x "
                         f"{block} tiles, got {w_scale.dtype} {list(w_scale.shape)}")
    if T > MAX_ROWS:
        raise ValueError(f"gemv_fp8: at most {MAX_ROWS} rows, got {T}")
    config = config or config_for(N, K)
    if config.one_launch or config.block_k % block:
        raise ValueError(f"gemv_fp8: {config} cannot take {block}-deep blocks in two passes")
    if out is None:
        out = torch.empty(T, N, dtype=out_dtype, device=x.device)
    if out.shape != (T, N) or out.dtype not in (torch.bfloat16, torch.float32) or out.stride(1) != 1:
        raise ValueError(f"gemv_fp8: out must be a bf16 or fp32 [{T}, {N}] tensor with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    # the kernel reads bytes (Triton takes no float8_e4m3fn / e8m0 pointers on CPU) and bitcasts them itself
    w = (w if w.stride(1) == 1 else w.contiguous()).view(torch.uint8)
    w_scale = w_scale.contiguous().view(torch.uint8)
    pieces, k_piece = split_k(N, K, config, sm_count(x.device))
    n_blocks = triton.cdiv(N, config.block_n)
    part = torch.empty(pieces if pieces > 1 else 0, T, N, dtype=torch.float32, device=x.device)
    _gemv_fp8_kernel[(n_blocks, pieces)](
        x, w, w_scale, out, part, T, N, K, x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0), k_piece,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, QB=block, TP=MAX_ROWS, SPLIT=pieces > 1,
        FP8_DOT=x.device.type != "cpu",
        num_warps=config.num_warps, num_stages=config.num_stages)
    if pieces > 1:
        _sum_pieces_kernel[(triton.cdiv(T * N, 256),)](part, out, T, N, out.stride(0), PIECES=pieces,
                                                       PP=triton.next_power_of_2(pieces), BLOCK=256)
    return out
