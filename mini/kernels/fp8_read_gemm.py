"""Dense projections of a few dozen rows read as the checkpoint stores them: y[T, N] = x[T, K] @ W[N, K]^T with W
in FP8 e4m3 and its E8M0 scale per 32 x 32 block, bf16 x (already fake-quantized), fp32 sums, bf16 out.

Between the decode GEMV's 16 rows (mini/kernels/gemv.py) and prefill, a decode step of B = 17-64 sequences (and a
B = 16 verify step's 96 rows) multiplies every dense weight by a few dozen rows: still one read of the weight,
which cuBLAS ran on the dequantized bf16 copies at ~47% of the copy rate at B = 64 on the H200 (5.2 ms of the
29.2 ms rank4 step, docs/perf/raw/025). This kernel reads the e4m3 bytes instead, half the copy's, and widens
each weight tile in registers before the bf16 tensor-core MMA:
- w (e4m3, exact in fp32) times its block's scale 2^(s - 127) (exact: a power of two), rounded to bf16: exactly
  the value the bf16 copy holds (mini.formats.dequant_fp8 computes the same product in fp32 and rounds once), so
  each product x * w is the copy's, and only the order of the fp32 sum differs from cuBLAS's (and, on Hopper,
  the tensor cores' truncated partial sums, as cuBLAS's);
- a program owns BN weight rows and one piece of K for BM rows of x (split-K where the N blocks alone would not
  fill the GPU, as the GEMV's `split_k`), walking it in BK steps; the pieces' fp32 partials are added by the
  GEMV's `_sum_pieces_kernel` as one tree fixed by the piece count, then rounded once to bf16;
- the scales of a tile are one byte per (weight row, 32 columns): loaded as [BN, BK / 32] and broadcast over each
  group's 32 columns by a reshape that splits K (no data movement).
Not a fast path's default until measured against cuBLAS (`mini bench kernels --only decode_gemv_fp8` at 32 and 64
rows; the switch MINI_FP8_READ_ROWS in mini.ops.linear). The deterministic mode never reaches it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mini.kernels.device_info import H200_SMS, sm_count
from mini.kernels.gemv import _sum_pieces_kernel

W_BLOCK = 32  # the FP8 weight's scale block (V4.1; V4's 128 x 128 blocks are not taken)
MAX_ROWS = 128  # beyond, a prefill GEMM's compute, not the weight read, sets the time
# The smallest E8M0 byte taken (the caller checks a weight's once): with s >= 2^-117 every widened weight, e4m3's
# subnormals (>= 2^-9) included, is a normal bf16, so no tensor core or interpreter meets a subnormal operand that
# the bf16 copy's GEMM would not (a checkpoint's scales are near 2^-8, byte ~119).
MIN_SCALE_BYTE = 10


@dataclass(frozen=True)
class Fp8ReadConfig:
    """One build: BN weight rows x BK columns a step for BM rows of x, warps, pipeline stages, and the programs
    per SM the K split aims for."""
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 2
    # the product swapped, [BN, BM] = W x^T: the widened tile is the wgmma's A operand from registers (on sm_90a no
    # shared-memory store of it; the x tile goes through shared memory transposed instead); BN a multiple of 64
    swap: bool = False


DEFAULT = Fp8ReadConfig()
# the builds `mini bench kernels --only decode_gemv_fp8` times beside DEFAULT at 32 and 64 rows
CANDIDATES = {"128x128 s4": DEFAULT, "64x128 s4": Fp8ReadConfig(64, 128), "128x64 s5": Fp8ReadConfig(128, 64, 4, 5),
              "128x128 s3 8w": Fp8ReadConfig(128, 128, 8, 3), "128x128 s4 4/SM": Fp8ReadConfig(programs_per_sm=4),
              "128x128 s4 swap": Fp8ReadConfig(swap=True), "64x128 s4 swap": Fp8ReadConfig(64, 128, swap=True)}


def rows_per_program(T: int) -> int:
    """BM: the rows of x a program multiplies, a power of two from 16 (one MMA operand) up to 64."""
    return min(max(triton.next_power_of_2(T), 16), 64)


@triton.jit(do_not_specialize=["T"])
def _fp8_read_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, T, N, K, stride_x, stride_w, stride_s, stride_y,
                          K_PIECE, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                          EVEN_K: tl.constexpr, SWAP: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Program (n block, K piece, row block): acc[BM, BN] = sum over its piece of x_tile @ (w_tile * scale)^T
    (SWAP: its transpose, (w_tile * scale) @ x_tile^T, the same products and sums)."""
    pid_n, piece, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    row_ok, n_ok = rows < T, n < N
    k_lo = piece * K_PIECE
    k_hi = tl.minimum(k_lo + K_PIECE, K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :]
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_w + kk[None, :]
    G: tl.constexpr = BK // 32
    s_ptrs = s_ptr + (n // 32)[:, None].to(tl.int64) * stride_s + tl.arange(0, G)[None, :]
    acc = tl.zeros([BN, BM] if SWAP else [BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = (kk < BK) if EVEN_K else (k0 + kk < K)
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        g_ok = (k0 // 32 + tl.arange(0, G)) < tl.cdiv(K, 32)
        s = tl.load(s_ptrs + k0 // 32, mask=n_ok[:, None] & g_ok[None, :], other=127).to(tl.int32)
        f = (s << 23).to(tl.float32, bitcast=True)  # E8M0 byte -> 2^(s - 127), exact for bytes >= 1
        wf = tl.reshape(tl.reshape(w.to(tl.float32), [BN, G, 32]) * f[:, :, None], [BN, BK])
        if SWAP:  # [BN, BM]: the widened weight as the MMA's A operand, straight from registers
            acc = tl.dot(wf.to(tl.bfloat16).to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), acc)
        else:  # [BM, BN]: the widened weight through shared memory as the B operand
            acc = tl.dot(x.to(DOT_DTYPE), tl.trans(wf.to(tl.bfloat16).to(DOT_DTYPE)), acc)
    if SWAP:
        acc = tl.trans(acc)
    out = rows[:, None] < T
    if SPLIT:
        tl.store(part_ptr + (piece * T + rows[:, None].to(tl.int64)) * N + n[None, :], acc, mask=out & n_ok[None, :])
    else:
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=out & n_ok[None, :])


def split_k(N: int, K: int, T: int, config: Fp8ReadConfig = DEFAULT, sms: int = H200_SMS) -> tuple[int, int]:
    """(pieces, K per piece): the fewest pieces of whole BK steps that give about `programs_per_sm` programs per SM
    across the N blocks and row blocks (1 piece when those alone fill them)."""
    blocks = triton.cdiv(N, config.block_n) * triton.cdiv(T, rows_per_program(T))
    steps = triton.cdiv(K, config.block_k)
    want = max(1, min(steps, triton.cdiv(config.programs_per_sm * sms, blocks)))
    per_piece = triton.cdiv(steps, want)
    return triton.cdiv(steps, per_piece), per_piece * config.block_k


def supports(T: int, N: int, K: int, block: int) -> bool:
    """Whether the kernel takes this projection: 1-MAX_ROWS rows of a V4.1-style FP8 weight (32 x 32 blocks) whose
    K is whole scale groups."""
    return 0 < T <= MAX_ROWS and block == W_BLOCK and K % W_BLOCK == 0 and N > 0


def fp8_read_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8ReadConfig | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] bf16 (T <= MAX_ROWS, fake-quantized already where the layer quantizes), w [N, K] float8_e4m3fn,
    scale E8M0 bytes [ceil(N / 32), K / 32], none below MIN_SCALE_BYTE (not checked here: it would read the scale
    back) -> [T, N] bf16: F.linear(x, dequant_fp8(w, scale, 32, bf16)) with fp32 sums in this kernel's order."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_read_gemm: x [T, K] and w [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    T, K = x.shape
    N = w.shape[0]
    if x.dtype != torch.bfloat16 or w.dtype != torch.float8_e4m3fn or not supports(T, N, K, W_BLOCK):
        raise ValueError(f"fp8_read_gemm: bf16 x of 1-{MAX_ROWS} rows and an e4m3 w with K a multiple of "
                         f"{W_BLOCK} expected, got {x.dtype} {tuple(x.shape)} and {w.dtype} {tuple(w.shape)}")
    grid_s = (triton.cdiv(N, W_BLOCK), K // W_BLOCK)
    if tuple(scale.shape) != grid_s or scale.element_size() != 1 or scale.stride(1) != 1:
        raise ValueError(f"fp8_read_gemm: E8M0 scale [{grid_s[0]}, {grid_s[1]}] bytes with unit column stride "
                         f"expected, got {scale.dtype} {tuple(scale.shape)}")
    config = config or DEFAULT
    if out is None:
        out = torch.empty(T, N, dtype=torch.bfloat16, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    bm = rows_per_program(T)
    pieces, k_piece = split_k(N, K, T, config, sm_count(x.device))
    part = torch.empty(pieces if pieces > 1 else 0, T, N, dtype=torch.float32, device=x.device)
    _fp8_read_gemm_kernel[(triton.cdiv(N, config.block_n), pieces, triton.cdiv(T, bm))](
        x, w, scale.view(torch.uint8), out, part, T, N, K, x.stride(0), w.stride(0), scale.stride(0), out.stride(0),
        k_piece, BM=bm, BN=config.block_n, BK=config.block_k, SPLIT=pieces > 1, EVEN_K=K % config.block_k == 0,
        SWAP=config.swap,
        # the interpreter's bf16 dot is broken: the same (exact) values multiplied in fp32 there
        DOT_DTYPE=tl.float32 if x.device.type == "cpu" else tl.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if pieces > 1:
        _sum_pieces_kernel[(triton.cdiv(T * N, 256),)](part, out, T, N, out.stride(0), PIECES=pieces,
                                                       PP=triton.next_power_of_2(pieces), BLOCK=256)
    return out
