"""Dense projections at decode row counts (T <= 16): y[T, N] = x[T, K] @ W[N, K]^T, bf16 in, fp32 sums, bf16 out.

At 1-16 rows a projection is one read of its weight: 2·N·K bytes against 2·T·N·K FLOP. cuBLAS ran V4.1's decode
projections at 28-43% of the copy rate on the H200 (issue 28; docs/kernels.md, "Dense projections at decode"), so
this kernel is built around the read of W alone:
- each program owns BLOCK_N rows of W and one piece of K (split-K when N / BLOCK_N programs would not fill the
  GPU; `split_k`), and walks its piece in BLOCK_K steps of contiguous [BLOCK_N, BLOCK_K] tiles (W is row-major),
  software-pipelined over `num_stages`;
- the product runs "swapped" on the tensor cores: acc[BLOCK_N, 16] = W_tile @ x_tile^T, so the weight is the MMA's
  wide operand (M = BLOCK_N >= 64 takes Hopper's wgmma) and the T <= 16 rows of x, padded to 16, the narrow one,
  re-read from L1/L2 by every program;
- the pieces' fp32 partials go to a scratch [S, T, N] and a second small pass (`_sum_pieces_kernel`) adds them as
  a tree fixed by S and rounds once to bf16; one piece (S = 1) rounds in the first pass. `one_launch` (a
  candidate here; the default of the one-row FP8 read below) saves that launch: each program counts itself in on its
  N block's counter after storing its partial (an acq_rel atomic), and the one that arrives last adds the S partials
  (here in piece order; the FP8 read loads them as one tile), rounds, and resets the counter for the next call. No
  atomic ever adds a value: the sums' order is fixed by the shape and the config, so a result is the same run to
  run.
Each output is one fp32 sum of the exact bf16 products and one rounding to bf16, as F.linear's bf16 output; only
the order of the sum differs from cuBLAS (and, on Hopper, the tensor cores' truncated fp32 sums, as cuBLAS's). The
split depends on N and K only, and a row's MMAs do not mix rows, so row t's bits do not depend on T (<= 16).
With `act_block` the kernel also applies the FP8 1 x act_block activation fake quant of mini.ops.linear to each x
tile it loads (mini/kernels/quant.py's formulas, as fp8_act_quant's pass: the same bits, and the quantized values
are exact in bf16), so a decode projection is one launch (two with a split) instead of a quant pass before it.
The deterministic mode never reaches this kernel (mini.ops.linear keeps its batch-invariant GEMMs).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from mini.kernels.device_info import H200_SMS, sm_count
from mini.kernels.fp8_act_quant import FP8Rows
from mini.kernels.quant import e4m3_round, e8m0_value, fp8_group_codes, fp8_group_quant

MAX_ROWS = 16  # x's rows are padded to one 16-row MMA operand
# Triton 3.6's interpreter fails on the kernel's scalar loads ("only 0-dimensional arrays can be converted to
# Python scalars"); 3.7's runs it. Compiled (CUDA) it runs on both.
_INTERPRETER_RUNS_IT = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7)


def runs_on(x: torch.Tensor) -> bool:
    """Whether the GEMV can take x here: on CUDA, or on CPU tensors under Triton's interpreter from Triton 3.7 on
    (callers fall back to the GEMM otherwise)."""
    return x.is_cuda or _INTERPRETER_RUNS_IT


@dataclass(frozen=True)
class GemvConfig:
    """One build: BLOCK_N weight rows x BLOCK_K columns per step, warps, pipeline stages, and how many programs per
    SM the split aims for (`split_k`)."""
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 2
    one_launch: bool = False  # split results summed by the last program of each N block, not a second kernel
    # the FP8 read of one row on the CUDA cores (`_gemv_fp8_row_kernel`): block_n divides the weight's scale block,
    # so a program's rows share one scale row
    cuda_cores: bool = False
    # the FP8 read of 1-16 rows on the tensor cores (`_gemv_fp8_mma_kernel`), x quantized in its loads; its steps
    # are the weight's scale blocks (block_k is taken from the weight)
    fp8_mma: bool = False
    # (with fp8_mma) > 0: the Gluon build of that read (mini/kernels/gemv_mma_registers.py), its operands loaded
    # straight into mma.sync's registers, this many consecutive bytes of a weight row a lane; CUDA only
    gluon_k_width: int = 0
    # (with gluon_k_width, at 32-wide scale blocks) 1: its loop loads W, x and the scales one block ahead of the
    # block it works on, W and x as int32 words (`_gemv_fp8_mma_registers_kernel`'s AHEAD)
    gluon_ahead: int = 0


DEFAULT = GemvConfig()
# the tilings the decode_small benchmark times beside DEFAULT (mini bench kernels --only decode_small)
# (64 x 128 with 2 stages: 40 KB of shared memory, so ~5 programs fit an SM and the split aims at 4)
CANDIDATES = {"64x128 s4": DEFAULT, "128x64 s4": GemvConfig(128, 64), "64x256 s3": GemvConfig(64, 256, 4, 3),
              "64x128 s2 4/SM": GemvConfig(64, 128, 4, 2, programs_per_sm=4),
              "64x128 s4 one launch": GemvConfig(one_launch=True)}
# The FP8 read of one row (T = 1) on the CUDA cores, its candidate tilings; the first is what `gemv` takes for one
# row with a scale (docs/perf/023: within 5% of the best candidate at each of V4.1's projections).
ROW_CANDIDATES = {"row 32x256 4w": GemvConfig(32, 256, 4, 3, 4, cuda_cores=True),
                  "row 32x512 4w": GemvConfig(32, 512, 4, 3, 4, cuda_cores=True),
                  "row 32x256 2w 8/SM": GemvConfig(32, 256, 2, 3, 8, cuda_cores=True),
                  "row 16x512 2w 8/SM": GemvConfig(16, 512, 2, 3, 8, cuda_cores=True)}
ROW_DEFAULT = next(iter(ROW_CANDIDATES.values()))
# the same read with its pieces summed by each N block's last program (`_last_sums_pieces`), not a second kernel
# (the B = 1 decode step's 200 sum launches took 0.28 ms on an H100, docs/perf/049): 0.2-0.4 us faster a read at
# five of V4.1's six shapes, the B = 1 decode step 9.43 -> 9.29 ms (one emulated EP8 rank, H100, docs/perf/051)
ROW_CANDIDATES["row 32x256 4w one launch"] = replace(ROW_DEFAULT, one_launch=True)
ROW_DEFAULT = ROW_CANDIDATES["row 32x256 4w one launch"]
# The FP8 read of several rows on the tensor cores, its candidate tilings; the first is what `gemv` takes for 2-16
# rows with a scale (x fake-quantized to FP8 in the weight's blocks: the official GEMM's act quant) unless
# MMA_TUNED names another: at 6 and 16 rows on an H100 (docs/perf/044) 128 rows a program was the fastest at wo_b,
# the shared w1|w3 and w2, 64 at the wide wq_b|indexer wq_b; 16 programs per SM was slower at every shape. Steps of
# more bytes (256 rows a program on 4 or 8 warps, or 8 stages in flight) were slower at every shape and row count
# (docs/perf/046).
MMA_CANDIDATES = {"mma 128 s4 4/SM": GemvConfig(128, 32, 4, 4, 4, fp8_mma=True),
                  "mma 64 s4 4/SM": GemvConfig(64, 32, 4, 4, 4, fp8_mma=True),
                  "mma 64 s4 8/SM": GemvConfig(64, 32, 4, 4, 8, fp8_mma=True)}
# The same read in the Gluon build (rows a program on 4 warps; 8 bytes of a row a lane: 16 need 64-wide MMA tiles, two
# of V4.1's scale blocks). Measured on an H100 (docs/perf/048): at 6 rows 3-6% faster than the best Triton build on
# five of V4.1's six projections (within 1% on wq_b's), at 16 rows 6-32% slower; 8 programs an SM, 64-row tiles and
# 1-2 blocks carried ahead as e4m3 tiles (moved byte by byte) were slower at every shape and are gone
MMA_CANDIDATES["regs 128 4/SM"] = GemvConfig(128, 32, 4, 1, 4, fp8_mma=True, gluon_k_width=8)
MMA_DEFAULT = next(iter(MMA_CANDIDATES.values()))
# the same with each warp's loads issued one block ahead of its MMAs (`gluon_ahead`): 0.5-2.2% faster at 6 rows at
# each of V4.1's six shapes on an H100 (2 and 3 blocks ahead no faster than none, docs/perf/053)
MMA_CANDIDATES["regs 128 4/SM ahead 1"] = replace(MMA_CANDIDATES["regs 128 4/SM"], gluon_ahead=1)
MMA_REGISTERS = MMA_CANDIDATES["regs 128 4/SM ahead 1"]  # what MINI_GEMV_WEIGHTS=fp8 (the default) takes at 2-8 rows
# 2 and 4 blocks a loop step, their loads all issued before the first MMA (64-128 contiguous bytes of each row
# requested together), were no faster across V4.1's six shapes at 6 and 16 rows (docs/perf/054) and are gone
MMA_REGISTERS_ROWS = 8  # its rows: one MMA column tile (faster at 6 rows, slower at 16: docs/perf/048; the B = 1
# verify step 13.50 -> 13.25 ms against the Triton build on an H100, docs/perf/049)
MMA_TUNED = {(36864, 1280): MMA_CANDIDATES["mma 64 s4 4/SM"]}


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, T, N, K, stride_x, stride_w, stride_y, K_PIECE,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TP: tl.constexpr, SPLIT: tl.constexpr,
                 ONE_LAUNCH: tl.constexpr, EVEN_K: tl.constexpr, ACT_BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Program (n block, K piece): acc[BLOCK_N, TP] = sum over the piece of W[n, k] x[t, k]; SPLIT: fp32 to
    part[piece, t, n] (ONE_LAUNCH: then the block's last program to arrive sums the pieces), else to y[t, n].
    ACT_BLOCK > 0: x fake-quantized to FP8 in 1 x ACT_BLOCK groups as it is loaded."""
    pid_n, piece = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    t = tl.arange(0, TP)
    t_ok = t < T
    kk = tl.arange(0, BLOCK_K)
    k_lo = piece * K_PIECE
    k_hi = tl.minimum(k_lo + K_PIECE, K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_w + kk[None, :]
    x_ptrs = x_ptr + t[:, None].to(tl.int64) * stride_x + kk[None, :]
    acc = tl.zeros([BLOCK_N, TP], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # K is masked only when it is not a multiple of BLOCK_K (a mask along K would stop wide loads); pieces are
        # whole BLOCK_K steps
        k_ok = (kk < BLOCK_K) if EVEN_K else (k0 + kk < K)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        if ACT_BLOCK > 0:  # whole groups: K and BLOCK_K are multiples of ACT_BLOCK (padding is zeros)
            x = fp8_group_quant(x.to(tl.float32), BLOCK_K // ACT_BLOCK, ACT_BLOCK, TP)
        acc = tl.dot(w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), acc)
    ok = n_ok[:, None] & t_ok[None, :]
    y_at = y_ptr + t[None, :].to(tl.int64) * stride_y + n[:, None]
    if SPLIT:
        at = t[None, :].to(tl.int64) * N + n[:, None]
        tl.store(part_ptr + piece.to(tl.int64) * T * N + at, acc, mask=ok)
        if ONE_LAUNCH:
            tl.debug_barrier()  # every thread's partial is stored before the program counts itself in (release)
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(1) - 1:  # the last: every piece is in L2 (.cg reads past L1)
                total = tl.zeros([BLOCK_N, TP], dtype=tl.float32)
                piece_ptrs = part_ptr + at
                for _ in range(0, tl.num_programs(1)):
                    total += tl.load(piece_ptrs, mask=ok, other=0.0, cache_modifier=".cg")
                    piece_ptrs += T * N
                tl.store(y_at, total.to(y_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=ok)


# The FP8 read of one row (`scale` given, T = 1): at B = 1 a projection reads the checkpoint's e4m3 bytes (half the
# bf16 copy's) and sums on the CUDA cores. Each byte's bits are moved into an fp32 that holds q * 2^-E4M3_BIAS
# exactly (`_e4m3_bits_as_fp32`: 3 integer operations a value, e4m3's subnormals included), and the weight's scale
# goes to x's side: x * s * 2^(E4M3_BIAS - OUT_SHIFT), exact (a power of two). Each product is then the bf16 copy's
# exact product times 2^-OUT_SHIFT, summed in fp32 FMAs and scaled back: the copy's products in this kernel's
# order, while every product stays in fp32's normal range (|q * s * x| >= 2^-106, or 0) and s <= 2^39
# (MAX_SCALE_BYTE; the caller checks it once per weight). The tensor-core form of the same read (the MMA on the
# bits as bf16, one copy of x per scale row) gave the copy's bits but ran at 0.30-0.37 of the copy rate in its
# bytes, slower than the bf16 copy at every projection and row count (docs/perf/023): the register shuffles that
# feed the MMA cost more than the bytes saved; the FMA form has none.
E4M3_BIAS = 120
OUT_SHIFT = 32
MAX_SCALE_BYTE = 254 - (E4M3_BIAS - OUT_SHIFT)  # s * 2^88 must be a normal fp32: E8M0 bytes up to 166 (s <= 2^39)


@triton.jit
def _e4m3_bits_as_fp32(w, INTERPRET: tl.constexpr):
    """e4m3 [..] -> fp32 holding q * 2^-120 exactly, from the bits: sign to sign, the 4 exponent and 3 mantissa bits
    to a bf16's exponent field's low 4 bits and mantissa's top 3 (two values a 32-bit word: prmt, shr, and, lop3),
    widened to fp32 (shl / and); e4m3's subnormals become subnormals of the same scaled value, an e4m3 NaN byte
    reads as 480 * 2^-120 (a checkpoint holds none)."""
    if INTERPRET:
        out = w.to(tl.float32) * 2.0 ** -120
    else:
        out = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 a, m, sgn, msk, hi;
            mov.b32 sgn, 0x80008000;
            mov.b32 msk, 0x07F007F0;
            mov.b32 hi, 0xFFFF0000;
            prmt.b32 a, $4, 0, 0x1404;
            shr.b32 m, a, 4;
            and.b32 m, m, msk;
            lop3.b32 a, a, sgn, m, 0xEA;
            shl.b32 $0, a, 16;
            and.b32 $1, a, hi;
            prmt.b32 a, $4, 0, 0x3424;
            shr.b32 m, a, 4;
            and.b32 m, m, msk;
            lop3.b32 a, a, sgn, m, 0xEA;
            shl.b32 $2, a, 16;
            and.b32 $3, a, hi;
            }""",
            constraints="=r,=r,=r,=r,r", args=[w.to(tl.uint8, bitcast=True)], dtype=tl.float32, is_pure=True,
            pack=4)
    return out


@triton.jit
def _last_sums_pieces(part_ptr, count_ptr, y_ptr, n, n_ok, N, pid_n, PP: tl.constexpr):
    """One launch's split-K sum (the one-row FP8 read's `one_launch`): after the program stored its piece's partials
    of the outputs n (part[piece, n], the pieces along the grid's second axis), it counts itself in on its N block's
    counter (a barrier, then an acq_rel atomic); the last of the block's programs to arrive loads every piece's
    partials at once (a [PP, n] tile read past L1: one round trip to L2, not one a piece), sums them (a reduction
    fixed by PP and the build: run to run the same), stores y and resets the counter for the next call or replay."""
    pieces = tl.num_programs(1)
    tl.debug_barrier()  # every thread's partial is stored before the program counts itself in (release)
    arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == pieces - 1:
        p = tl.arange(0, PP)
        parts = tl.load(part_ptr + p[:, None].to(tl.int64) * N + n[None, :],
                        mask=(p < pieces)[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + n, tl.sum(parts, axis=0).to(y_ptr.dtype.element_ty), mask=n_ok)
        tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemv_fp8_row_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, N, K, stride_w, stride_s, K_PIECE,
                         GROUP_N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                         ONE_LAUNCH: tl.constexpr, PP: tl.constexpr, EVEN_K: tl.constexpr, ACT_BLOCK: tl.constexpr,
                         W_BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """One row of x against an FP8 weight on the CUDA cores (decode at B = 1, where the MMA form's register
    shuffles cost more than its bytes): program (n block, K piece) sums (q * 2^-120) * (x * s * 2^88) over its
    piece with fp32 FMAs (exact products: the bf16 copy's times 2^-32), tile by tile, and scales the sums back.
    x[g K + k] with g = n // GROUP_N: the group of x the block's rows take (0 when x is one group)."""
    pid_n, piece = tl.program_id(0), tl.program_id(1)
    x_ptr += (pid_n * BLOCK_N // GROUP_N).to(tl.int64) * K
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    k_lo = piece * K_PIECE
    k_hi = tl.minimum(k_lo + K_PIECE, K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_w + kk[None, :]
    s_row = s_ptr + (tl.minimum(pid_n * BLOCK_N, N - 1) // W_BLOCK).to(tl.int64) * stride_s  # the block's scale row
    SB: tl.constexpr = W_BLOCK if W_BLOCK < BLOCK_K else BLOCK_K
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (kk < BLOCK_K) if EVEN_K else (k0 + kk < K)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        if ACT_BLOCK > 0:
            x = tl.reshape(fp8_group_quant(tl.reshape(x, [1, BLOCK_K]), BLOCK_K // ACT_BLOCK, ACT_BLOCK, 1),
                           [BLOCK_K])
        group = tl.minimum((k0 + tl.arange(0, BLOCK_K // SB) * SB) // W_BLOCK, tl.cdiv(K, W_BLOCK) - 1)
        f = ((tl.load(s_row + group).to(tl.int32) + (120 - 32)) << 23).to(tl.float32, bitcast=True)
        xs = tl.reshape(tl.reshape(x, [BLOCK_K // SB, SB]) * f[:, None], [BLOCK_K])
        acc += tl.sum(_e4m3_bits_as_fp32(w, INTERPRET) * xs[None, :], axis=1)
    acc = acc * 2.0 ** 32
    if SPLIT:
        tl.store(part_ptr + piece.to(tl.int64) * N + n, acc, mask=n_ok)
        if ONE_LAUNCH:
            _last_sums_pieces(part_ptr, count_ptr, y_ptr, n, n_ok, N, pid_n, PP)
    else:
        tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


# The FP8 read of 2-16 rows on the tensor cores (`fp8_mma`): the official FP8 GEMM's arithmetic (mini.ops.linear's
# `blockwise_gemm`) with x quantized in the kernel's loads. Each step is one scale block of K (W_BLOCK, the weight's
# block, which is also the activation quant group): the e4m3 weight bytes go to the MMA as stored (no conversion in
# registers: the step the bf16-MMA form of this read lost to, docs/perf/023), x's group is rounded to e4m3 codes
# with its power-of-two scale (kernels/quant.py's formula), and the block's [BLOCK_N, TP] products, summed by the
# MMA from zero, are scaled by both powers of two (exact) and added to the fp32 sums. Only the MMA's own sum of a
# block's W_BLOCK exact products differs from the bf16 copy's GEMV: Hopper's FP8 MMA keeps fewer bits of it (as
# the official kernels', which sum 128 such products in it per scale block): 97% of outputs are the copy's bits,
# the largest difference 7.5e-4 of the sum of |products| (docs/perf/044). It reads 0.2-0.38 of the copy rate in its
# bytes, not more: each step (one block) stores x's codes for the MMA, waits on the MMA before the scaling and moves
# both scales to the accumulator's layout through shared memory: 6 barriers a step (docs/perf/045); still 0-19%
# faster than the copy's GEMV at 6-16 rows.
@triton.jit(do_not_specialize=["T"])
def _gemv_fp8_mma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, T, N, K, stride_x, stride_w, stride_s, stride_y,
                         K_PIECE, e_ptr, stride_e, BLOCK_N: tl.constexpr, TP: tl.constexpr, SPLIT: tl.constexpr,
                         W_BLOCK: tl.constexpr, DOT_FP32: tl.constexpr, X_CODES: tl.constexpr):
    """Program (n block, K piece): acc[BLOCK_N, TP] = sum over the piece's scale blocks b of
    (W_q[n, b] @ x_q[t, b]^T) * s_w[n, b] * s_x[t, b]; SPLIT: fp32 to part[piece, t, n], else bf16 to y[t, n].
    X_CODES: x is given quantized, its e4m3 codes at x_ptr and E8M0 bytes at e_ptr [T, K / W_BLOCK] (rows
    `stride_e` apart); else x is bf16, quantized here (e_ptr unused). K is a multiple of W_BLOCK (x's groups are the
    weight's blocks): no mask along K."""
    pid_n, piece = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    t = tl.arange(0, TP)
    t_ok = t < T
    kk = tl.arange(0, W_BLOCK)
    k_lo = piece * K_PIECE
    k_hi = tl.minimum(k_lo + K_PIECE, K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_w + kk[None, :]
    x_ptrs = x_ptr + t[:, None].to(tl.int64) * stride_x + kk[None, :]
    s_ptrs = s_ptr + (tl.minimum(n, N - 1) // W_BLOCK).to(tl.int64) * stride_s  # each row's scale row
    acc = tl.zeros([BLOCK_N, TP], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, W_BLOCK):
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
        if X_CODES:  # the codes as the MMA takes them (no shared-memory store of x's: docs/perf/045)
            x_q = tl.load(x_ptrs + k0, mask=t_ok[:, None], other=0.0)
            s_x = e8m0_value(tl.load(e_ptr + t.to(tl.int64) * stride_e + k0 // W_BLOCK, mask=t_ok,
                                     other=127).to(tl.int32))
            if DOT_FP32:
                x_q = x_q.to(tl.float32)
        else:
            x = tl.load(x_ptrs + k0, mask=t_ok[:, None], other=0.0).to(tl.float32)
            a, e = fp8_group_codes(x, 1, W_BLOCK, TP)
            x_q = tl.reshape(e4m3_round(a), [TP, W_BLOCK])
            s_x = (tl.reshape(e, [TP]) << 23).to(tl.float32, bitcast=True)
            if not DOT_FP32:
                x_q = x_q.to(tl.float8e4nv)
        if DOT_FP32:  # the interpreter: the same exact products, in fp32
            d = tl.dot(w.to(tl.float32), tl.trans(x_q), input_precision="ieee")
        else:
            d = tl.dot(w, tl.trans(x_q))
        s_w = e8m0_value(tl.load(s_ptrs + k0 // W_BLOCK).to(tl.int32))
        acc += d * s_w[:, None] * s_x[None, :]
    ok = n_ok[:, None] & t_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + piece.to(tl.int64) * T * N + t[None, :].to(tl.int64) * N + n[:, None], acc, mask=ok)
    else:
        tl.store(y_ptr + t[None, :].to(tl.int64) * stride_y + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T"])
def _sum_pieces_kernel(part_ptr, y_ptr, T, N, stride_y, PIECES: tl.constexpr, PP: tl.constexpr,
                       BLOCK: tl.constexpr):
    """y[t, n] = sum over the pieces of part[p, t, n] in y's dtype, the pieces added as one tree fixed by PIECES."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat index over [T, N]
    ok = i < T * N
    p = tl.arange(0, PP)
    parts = tl.load(part_ptr + p[:, None].to(tl.int64) * T * N + i[None, :],
                    mask=(p < PIECES)[:, None] & ok[None, :], other=0.0)
    y = tl.sum(parts, axis=0)
    tl.store(y_ptr + (i // N).to(tl.int64) * stride_y + i % N, y.to(y_ptr.dtype.element_ty), mask=ok)


_COUNTERS: dict = {}  # device -> int32 arrival counters of the one-launch build, zero between calls
_OUTGROWN: list = []  # counters replaced by larger ones: kept, since captured graphs may still point at them


def _counters(device: torch.device, n_blocks: int) -> torch.Tensor | None:
    """The one-launch build's counters (one per N block), allocated zeroed outside graph capture (None while
    capturing without them: the caller then takes the two-pass sum). Calls on one stream at a time only: two
    concurrent calls would count on the same counters."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n_blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(n_blocks, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


# Shapes [N, K] whose fastest build is not DEFAULT, measured with the act quant fused (`mini bench kernels --only
# decode_gemv`, H200, CUDA-graph replays, docs/perf/019; us at B = 1, default -> tuned, act quant + cuBLAS):
# V4.1's wo_b [5120, 8192] 33.8 -> 25.5 (27.9), the shared expert's w1|w3 [4608, 5120] 21.3 -> 16.8 (18.7), the
# stacked wq_a|wkv [1792, 5120] 11.9 -> 9.3 (10.0) and wq_b|indexer wq_b [36864, 1280] 30.7 -> 25.7 (26.8); at
# B = 16 the same order. Wide K over few N blocks: more, smaller pieces keep more loads in flight.
TUNED = {(5120, 8192): CANDIDATES["64x128 s2 4/SM"], (4608, 5120): CANDIDATES["64x128 s2 4/SM"],
         (1792, 5120): CANDIDATES["128x64 s4"], (36864, 1280): CANDIDATES["64x128 s2 4/SM"]}


def config_for(N: int, K: int) -> GemvConfig:
    """The build `gemv` takes for a [N, K] weight when the caller names none: TUNED's, else DEFAULT."""
    return TUNED.get((N, K), DEFAULT)


def takes_groups(N: int, groups: int) -> bool:
    """Whether the FP8 read's default build (`gemv(..., scale=, groups=groups)`) takes an FP8 weight of N rows in
    `groups` groups: each group's rows whole BLOCK_N blocks (a program reads one group's x)."""
    return N % groups == 0 and (N // groups) % ROW_DEFAULT.block_n == 0


def split_k(N: int, K: int, config: GemvConfig = DEFAULT, sms: int = H200_SMS) -> tuple[int, int]:
    """(pieces, K per piece): the fewest pieces of whole BLOCK_K steps that give about `programs_per_sm` programs
    per SM across the N blocks (1 piece when the N blocks alone fill them). It depends on N and K, not on T.
    (Rounded down to the programs that fit at once instead, it was slower or the same on an H100, docs/perf/053.)"""
    n_blocks = triton.cdiv(N, config.block_n)
    steps = triton.cdiv(K, config.block_k)
    fit = config.programs_per_sm * sms
    want = max(1, min(steps, triton.cdiv(fit, n_blocks)))
    per_piece = triton.cdiv(steps, want)
    return triton.cdiv(steps, per_piece), per_piece * config.block_k


def fuses_act_quant(act_block: int, config: GemvConfig = DEFAULT) -> bool:
    """Whether the kernel quantizes x in its loads: each BLOCK_K step must hold whole groups."""
    return config.block_k % act_block == 0


def gemv(x: torch.Tensor | FP8Rows, w: torch.Tensor, out: torch.Tensor | None = None,
         config: GemvConfig | None = None, out_dtype: torch.dtype = torch.bfloat16, act_block: int = 0,
         scale: torch.Tensor | None = None, w_block: int = 0, groups: int = 1) -> torch.Tensor:
    """x [T, K] bf16 (T <= 16), w [N, K] bf16 row-major -> [T, N] in `out_dtype` (into `out` when given, its dtype):
    F.linear(x, w) with fp32 sums in this kernel's order; out_dtype fp32 keeps the sums unrounded (as
    torch.mm(..., out_dtype=torch.float32), the compressor's GEMM). act_block > 0: x is first fake-quantized to
    FP8 in 1 x act_block groups, F.linear(fp8_act_quant(x, act_block), w) (`fuses_act_quant` says when the kernel
    does it in its loads; otherwise the quant pass runs first). `config` None: `config_for` the weight's shape.
    With `scale`, w is the checkpoint's FP8 weight read as stored: float8_e4m3fn [N, K] with E8M0 `scale`
    [ceil(N / w_block), ceil(K / w_block)] bytes up to MAX_SCALE_BYTE. One row of x (`config` None: ROW_CANDIDATES'
    first) takes the CUDA-core read above: the same result as on dequant_fp8(w, scale, w_block, bf16) but for the
    order of the fp32 sums. 2-16 rows (`config` None: MMA_TUNED's or MMA_CANDIDATES' first) take the tensor cores'
    read, act_block = w_block: the same but for the FP8 MMA's sum within each block (above); its Gluon build
    (`gluon_k_width`, mini/kernels/gemv_mma_registers.py) also takes act_block = 0: x as it is, the exact products
    summed in fp32. `groups` G > 1 (the one-row FP8 read, or the Gluon build at 1-16 rows): a block-diagonal
    projection (V4.1's wo_a), x [T, G K] and w [N, K] whose rows in group g (N / G of them, whole BLOCK_N blocks)
    take x[:, g K:(g + 1) K]: y = [x_g w_g^T for each g]. (The same on the bf16 copy's GEMV was slower than cuBLAS's
    bmm at 1-16 rows: docs/perf/040.)
    x may also come quantized (`FP8Rows`: its e4m3 codes and E8M0 bytes in the weight's blocks, e.g. from
    fp8_act_quant_wire): the tensor cores' FP8 read then takes the codes as they are, at any 1-16 rows, with the bits
    of the same read quantizing bf16 x in its loads (act_block is then x's block or 0)."""
    if isinstance(x, FP8Rows):
        return _gemv_codes(x, w, out, config, out_dtype, act_block, scale, w_block, groups)
    if x.dim() != 2 or w.dim() != 2 or groups < 1 or x.shape[1] != groups * w.shape[1]:
        raise ValueError(f"gemv: x [T, {groups} K] and w [N, K] expected ({groups} group(s)), got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    if x.dtype != torch.bfloat16 or w.dtype != (torch.bfloat16 if scale is None else torch.float8_e4m3fn):
        raise ValueError(f"gemv: bf16 x and a bf16 w (or an e4m3 w with its scale) expected, got {x.dtype} and "
                         f"{w.dtype}{'' if scale is None else ' with a scale'}")
    T, K = x.shape[0], w.shape[1]
    N = w.shape[0]
    config = config or (config_for(N, K) if scale is None else ROW_DEFAULT if T == 1 else
                        MMA_TUNED.get((N, K), MMA_DEFAULT))
    if groups > 1 and (not (config.cuda_cores or config.gluon_k_width) or N % groups
                       or (N // groups) % config.block_n):
        raise ValueError(f"gemv: groups take the one-row FP8 read or the Gluon build, each group's rows (of w's {N}) "
                         f"whole BLOCK_N = {config.block_n} blocks; got {groups} groups, {T} row(s)"
                         f"{'' if scale is not None else ', no scale'}")
    if (scale is not None) != (config.cuda_cores or config.fp8_mma):
        raise ValueError(f"gemv: an FP8 weight (with its scale) takes an FP8-read build and a bf16 one the others; "
                         f"got {'a' if scale is not None else 'no'} scale and a "
                         f"{'bf16' if not (config.cuda_cores or config.fp8_mma) else 'FP8-read'} build")
    if config.cuda_cores and (T != 1 or w_block % config.block_n):
        raise ValueError(f"gemv: the CUDA-core FP8 read takes one row of x and a BLOCK_N that divides the weight's "
                         f"block ({w_block}); got {T} rows, BLOCK_N {config.block_n}")
    if config.fp8_mma and (act_block not in ((w_block, 0) if config.gluon_k_width else (w_block,)) or w_block < 32
                           or w_block & (w_block - 1)):
        raise ValueError(f"gemv: the tensor-core FP8 read quantizes x in the weight's blocks (act_block = w_block, "
                         f"a power of two >= 32, the MMA's K; its Gluon build also takes x unquantized, act_block 0); "
                         f"got act_block {act_block}, w_block {w_block}")
    if config.fp8_mma:
        config = replace(config, block_k=w_block)  # its steps (and split-K pieces) are whole scale blocks
    if scale is not None:
        _check_scale(scale, w, w_block)
    out = _output(out, T, N, out_dtype, x.device)
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if act_block and K % act_block:
        raise ValueError(f"gemv: K {K} is not a multiple of the activation quant block {act_block}")
    if act_block and not fuses_act_quant(act_block, config):
        from mini.kernels.fp8_act_quant import fp8_act_quant
        x, act_block = fp8_act_quant(x, act_block), 0
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    if config.fp8_mma:
        return _fp8_mma(x, None, w, scale, w_block, out, config, quantize=act_block > 0, groups=groups)
    pieces, k_piece = split_k(N, K, config, sm_count(x.device))
    interpreted = x.device.type == "cpu"
    if config.cuda_cores:
        part = torch.empty(pieces if pieces > 1 else 0, 1, N, dtype=torch.float32, device=x.device)
        n_blocks = triton.cdiv(N, config.block_n)
        counters = _counters(x.device, n_blocks) if config.one_launch and pieces > 1 else None
        _gemv_fp8_row_kernel[(n_blocks, pieces)](
            x, w, scale.view(torch.uint8), out, part, part if counters is None else counters, N, K, w.stride(0),
            scale.stride(0), k_piece, N // groups, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT=pieces > 1,
            ONE_LAUNCH=counters is not None,
            PP=1 if counters is None else triton.next_power_of_2(pieces),  # (unused without: no build per split)
            EVEN_K=K % config.block_k == 0,
            ACT_BLOCK=act_block, W_BLOCK=w_block, INTERPRET=interpreted, num_warps=config.num_warps,
            num_stages=config.num_stages)
        if pieces > 1 and counters is None:
            _sum_pieces_kernel[(triton.cdiv(N, 256),)](part, out, 1, N, out.stride(0), PIECES=pieces,
                                                       PP=triton.next_power_of_2(pieces), BLOCK=256)
        return out
    n_blocks = triton.cdiv(N, config.block_n)
    part = torch.empty(pieces if pieces > 1 else 0, T, N, dtype=torch.float32, device=x.device)
    counters = _counters(x.device, n_blocks) if config.one_launch and pieces > 1 else None
    _gemv_kernel[(n_blocks, pieces)](
        x, w, out, part, part if counters is None else counters, T, N, K, x.stride(0), w.stride(0), out.stride(0),
        k_piece, BLOCK_N=config.block_n, BLOCK_K=config.block_k, TP=MAX_ROWS, SPLIT=pieces > 1,
        ONE_LAUNCH=counters is not None, EVEN_K=K % config.block_k == 0, ACT_BLOCK=act_block,
        # the interpreter's bf16 dot is broken: the same (exact) values multiplied in fp32 there
        DOT_DTYPE=tl.float32 if interpreted else tl.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if pieces > 1 and counters is None:
        block = 256
        _sum_pieces_kernel[(triton.cdiv(T * N, block),)](part, out, T, N, out.stride(0), PIECES=pieces,
                                                         PP=triton.next_power_of_2(pieces), BLOCK=block)
    return out


def _check_scale(scale: torch.Tensor, w: torch.Tensor, w_block: int) -> None:
    grid = (triton.cdiv(w.shape[0], w_block), triton.cdiv(w.shape[1], w_block))
    if scale.dim() != 2 or tuple(scale.shape) != grid or scale.element_size() != 1 or scale.stride(1) != 1:
        raise ValueError(f"gemv: E8M0 scale [{grid[0]}, {grid[1]}] (bytes, unit column stride) expected for "
                         f"w {tuple(w.shape)} in {w_block} x {w_block} blocks, got {scale.dtype} {tuple(scale.shape)}")


def _output(out: torch.Tensor | None, T: int, N: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`out` (or a new [T, N] tensor of `dtype`) once checked; T within MAX_ROWS."""
    if T > MAX_ROWS:
        raise ValueError(f"gemv: at most {MAX_ROWS} rows, got {T}")
    out = torch.empty(T, N, dtype=dtype, device=device) if out is None else out
    if out.shape != (T, N) or out.dtype not in (torch.bfloat16, torch.float32) or out.stride(1) != 1:
        raise ValueError(f"gemv: out must be a bf16 or fp32 [{T}, {N}] tensor with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)}")
    return out


def _fp8_mma(x: torch.Tensor, x_scales: torch.Tensor | None, w: torch.Tensor, scale: torch.Tensor, w_block: int,
             out: torch.Tensor, config: GemvConfig, quantize: bool = True, groups: int = 1) -> torch.Tensor:
    """The tensor cores' FP8 read into `out` [T, N]: x bf16 [T, groups K] (quantized in the loads, or with
    `quantize` False taken as it is: the Gluon build only), or x's e4m3 codes with their E8M0 bytes `x_scales`
    [T, K / w_block]; arguments checked by the caller."""
    T, (N, K) = x.shape[0], w.shape
    if config.gluon_k_width and (not x.is_cuda or config.num_stages != 1 or config.block_n % 16
                                 or 4 * config.gluon_k_width > w_block or config.gluon_ahead not in (0, 1)):
        raise ValueError(f"gemv: the Gluon build of the FP8 read runs on CUDA only (not under Triton's interpreter), "
                         f"at one stage (its loads in the loop), 16-row tiles, 4 lanes' bytes within a scale block, "
                         f"0 or 1 block loaded ahead; got {x.device.type}, "
                         f"{config.num_stages} stages, BLOCK_N {config.block_n}, {config.gluon_k_width} bytes a lane, "
                         f"{w_block}-wide blocks, {config.gluon_ahead} ahead")
    pieces, k_piece = split_k(N, K, config, sm_count(x.device))
    part = torch.empty(pieces if pieces > 1 else 0, T, N, dtype=torch.float32, device=x.device)
    w_scales = scale.view(torch.uint8)
    args = (x, w, w_scales, out, part, T, N, K, x.stride(0), w.stride(0), scale.stride(0), out.stride(0), k_piece,
            w_scales if x_scales is None else x_scales, 0 if x_scales is None else x_scales.stride(0))
    if config.gluon_k_width:
        from mini.kernels.gemv_mma_registers import X_BF16, X_CODES, X_QUANT, _gemv_fp8_mma_registers_kernel
        _gemv_fp8_mma_registers_kernel[(triton.cdiv(N, config.block_n), pieces)](
            *args, BLOCK_N=config.block_n, TP=8 if T <= 8 else MAX_ROWS, SPLIT=pieces > 1, W_BLOCK=w_block,
            K_WIDTH=config.gluon_k_width, X_MODE=X_CODES if x_scales is not None else X_QUANT if quantize else X_BF16,
            GROUP_N=N // groups, AHEAD=blocks_ahead(config, x, w, w_block, x_scales is not None),
            num_warps=config.num_warps)
    else:
        _gemv_fp8_mma_kernel[(triton.cdiv(N, config.block_n), pieces)](
            *args, BLOCK_N=config.block_n, TP=MAX_ROWS, SPLIT=pieces > 1, W_BLOCK=w_block,
            DOT_FP32=x.device.type == "cpu", X_CODES=x_scales is not None, num_warps=config.num_warps,
            num_stages=config.num_stages)
    if pieces > 1:
        _sum_pieces_kernel[(triton.cdiv(T * N, 256),)](part, out, T, N, out.stride(0), PIECES=pieces,
                                                       PP=triton.next_power_of_2(pieces), BLOCK=256)
    return out


def blocks_ahead(config: GemvConfig, x: torch.Tensor, w: torch.Tensor, w_block: int, x_codes: bool) -> int:
    """The blocks the Gluon read's loop loads ahead (its AHEAD: `config.gluon_ahead`) where its word loads can take
    the operands: 8 bytes of a row a lane (two words), 32-wide scale blocks (V4's 128-wide ones would spill) and
    rows of W (and of bf16 x) starting on 4-byte boundaries. Otherwise 0: the loop that loads each block as it works
    on it. Both sum the same products in the same order."""
    words = w.data_ptr() % 4 == 0 and w.stride(0) % 4 == 0
    if not x_codes:
        words = words and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
    return config.gluon_ahead if config.gluon_k_width == 8 and w_block == 32 and words else 0


def _gemv_codes(x: FP8Rows, w: torch.Tensor, out: torch.Tensor | None, config: GemvConfig | None,
                out_dtype: torch.dtype, act_block: int, scale: torch.Tensor | None, w_block: int,
                groups: int) -> torch.Tensor:
    """`gemv` of x given as FP8 codes (FP8Rows): the tensor cores' FP8 read on them."""
    (T, K), N = x.shape, w.shape[0]
    if scale is None or w.dtype != torch.float8_e4m3fn or w.dim() != 2 or w.shape[1] != K or groups != 1:
        raise ValueError(f"gemv: x as FP8 codes takes an e4m3 w [N, {K}] with its scale (one group), got "
                         f"{w.dtype} {tuple(w.shape)}{'' if scale is not None else ' without a scale'}, "
                         f"{groups} group(s)")
    config = config or MMA_TUNED.get((N, K), MMA_DEFAULT)
    if not config.fp8_mma or x.block != w_block or act_block not in (0, w_block) or w_block < 32 \
            or w_block & (w_block - 1):
        raise ValueError(f"gemv: x as FP8 codes takes the tensor-core FP8 read with x's block = w_block (a power "
                         f"of two >= 32); got {'an FP8-MMA' if config.fp8_mma else 'another'} build, x's block "
                         f"{x.block}, w_block {w_block}, act_block {act_block}")
    _check_scale(scale, w, w_block)
    out = _output(out, T, N, out_dtype, w.device)
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    w = w if w.stride(1) == 1 else w.contiguous()
    return _fp8_mma(x.codes.view(torch.float8_e4m3fn), x.scales, w, scale, w_block, out,
                    replace(config, block_k=w_block))
