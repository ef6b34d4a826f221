"""Batch-invariant GEMMs for the deterministic mode (`mini.ops.set_deterministic`): a row of the output is computed
the same way however many rows the call has.

cuBLAS picks its kernel (tile shape, split-K, stream-K, sliced-K warps) from the problem's M, so a token's linear
layers round differently when the step holds 1, 37 or 4,096 tokens; that alone changes greedy answers under load
(docs/design.md, Determinism). `matmul` below is one Triton kernel in which every output element is an fp32 sum
over K in BK steps, in increasing k, each step one tensor-core dot (bf16/fp16) or an IEEE fp32 dot (fp32: what
torch's fp32 GEMM computes, no TF32), then alpha, the addend and one rounding to the output dtype. No split of K;
BK is one per dtype; M is not specialized at compile time (but for the fp32 few-rows kernel's rows per program, a
power of two up to 16: a tile, not a sum).

The output tile (BM x BN, warps, stages) only says which program computes which elements: on the GPU a BK step's
dot is a chain of k16 MMAs into the same fp32 accumulator, so an element's sum is the same chain whatever the
tile. Measured, not assumed: on the H200 all 14 tiles of tools/det_profile.py's sweep (BM 16-256, BN 64-256, BK
32-128, 4 and 8 warps, wgmma- and mma.sync-sized) gave the same bits at the 12 weight shapes of the rank4 step
(bf16 and fp32). So `config_for` may give large calls their weight shape's tuned tile (`TUNED`, from the sweeps),
fp32 calls of at most 16 rows (the head at decode) a kernel of FMA chains sized by M (`SMALL_FP32`), and the
others the dtype's default (more programs for decode-sized calls), with BK fixed per dtype (the CPU interpreter
rounds once per BK step, so BK would matter there); the gpu tests check every `TUNED` entry's rows alone == among
7, 300 and 4,096 rows, and fp32 rows alone == among 2..4,096, bit for bit. Row r's bits depend only on row r of
A and on B. A TileConfig also names its kernel (`KERNELS`: through pointers, TMA descriptors, persistent, an FMA
chain for fp32 rows): `tools/det_profile.py --variants-only` times each and compares its bits with the current
kernel's on the GPU before it becomes a default (TUNED's TMA entries and SMALL_FP32 came from there).

`enable()` makes it aten's CUDA implementation of mm, addmm and bmm (and their out= / out_dtype forms), so that
every GEMM of the process takes it (F.linear, @, einsum, torch.mm(..., out_dtype=)) without touching each call
site; `disable()` restores cuBLAS. Only floating inputs of one dtype (bf16, fp16, fp32) are taken; anything else
raises, naming what it got, rather than silently falling back to a batch-dependent kernel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mini.kernels.aten_override import AtenOverride, check_out
from mini.kernels.device_info import sm_count


@dataclass(frozen=True)
class TileConfig:
    """One build of the kernel: the tile (BM x BN output, BK of K per step), warps, pipeline stages, GROUP_M
    (row tiles walked together so that the weight's column tiles are reused from L2; it orders the programs only,
    not any sum), and which kernel (`KERNELS`)."""
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8
    kernel: str = "pointer"  # KERNELS: which build computes the tile (the same sums, see KERNELS)


# the kernels a TileConfig may name. All compute, per output element, the fp32 sum over K in increasing BK steps,
# each step one dot (tensor-core MMAs for 16-bit operands, a chain of IEEE FMAs in increasing k for fp32):
# "pointer": `_mm_kernel`, operands loaded through pointers (any strides);
# "tma", "tma-persistent", "tma-persistent-flat": `_mm_tma_kernel`, operands loaded through TMA tensor
#   descriptors (Hopper's bulk copies), one program per tile or a persistent grid of one program per SM walking the
#   tiles (-flat: the tile and K loops flattened into one software pipeline, so a tile's epilogue overlaps the next
#   one's loads). Where a call's operands do not fit a descriptor (strides, alignment) it runs the "pointer"
#   kernel. (Triton 3.6's automatic warp specialization does nothing on sm_90: with it, the flattened kernel's PTX
#   is the same, so there is no such variant);
# "fma-rows": `_mm_fma_rows_kernel`, fp32 (SMALL_FP32: calls of at most SMALL_ROWS rows, the head at decode;
#   larger calls in blocks of FMA_ROWS_MAX rows, measured by det_profile only): one thread per output column and
#   block of rows, its FMA chains over k written out (tl.fma, k in order: checked in the sm_90 PTX), the weight
#   read 4 contiguous k per 16-byte load with no data moved between threads, so that it streams at memory speed.
#   Meant to be the fp32 dot's chain bit for bit (tools/det_profile.py --variants-only compares them on the GPU);
#   the CPU interpreter rounds its dots per BK step instead, so there it is only checked against float64.
KERNELS = ("pointer", "tma", "tma-persistent", "tma-persistent-flat", "fma-rows")
FMA_ROWS_MAX = 16

# the default tile per input dtype. 16-bit: wgmma-sized tiles; fp32: FMA (IEEE) dots, whose registers allow smaller
# tiles. BK is the dtype's for every tile (TUNED too)
CONFIGS = {torch.bfloat16: TileConfig(64, 128, 64, num_warps=4, num_stages=4),
           torch.float16: TileConfig(64, 128, 64, num_warps=4, num_stages=4),
           torch.float32: TileConfig(64, 64, 32, num_warps=4, num_stages=2)}
# per weight shape (dtype, N, K): the fastest tile of tools/det_profile.py's sweeps on the H200 at the rank4 step's
# row counts (4,096; 2,048 for the last), among those with the default's BK and bits. Pointer tiles from phase
# det_profile at 28589aa (TFLOP/s default -> tuned, cuBLAS: wq_b 467 -> 572 (710), wo_b 456 -> 620 (752), wo_a 461
# -> 607 (771), shared w1|w3 475 -> 569 (780), w2 465 -> 583 (732), wq_a 416 -> 484 (749)); TMA kernels from phase
# det_gemm at 0ab9964 (every variant the current bits; TFLOP/s pointer-tuned -> TMA, cuBLAS): wq_b 582 -> 688 (773),
# wo_b 648 -> 783 (816), wo_a 550 -> 704 (785), w1|w3 591 -> 653 (802), w2 570 -> 665 (704), Engram 544 -> 738
# (801); over those shapes a step's GEMMs 97.0 -> 79.8 ms (cuBLAS 70.7)
_T = TileConfig
TUNED: dict[tuple[torch.dtype, int, int], TileConfig] = {
    (torch.bfloat16, 32768, 1280): _T(128, 256, 64, 8, 3, kernel="tma-persistent"),  # attention wq_b
    (torch.bfloat16, 5120, 8192): _T(128, 256, 64, 8, 3, kernel="tma-persistent"),  # attention wo_b
    (torch.bfloat16, 1024, 4096): _T(128, 256, 64, 8, 3, kernel="tma-persistent"),  # wo_a (bmm over 8 groups)
    (torch.bfloat16, 4608, 5120): _T(128, 256, 64, 8, 3, kernel="tma-persistent"),  # shared expert w1 | w3
    (torch.bfloat16, 5120, 2304): _T(128, 256, 64, 8, 3, kernel="tma-persistent"),  # shared expert w2
    (torch.bfloat16, 25600, 6144): _T(256, 128, 64, 8, 3, kernel="tma"),  # Engram
    (torch.bfloat16, 1280, 5120): _T(128, 128, 64, 8, 3),  # attention wq_a (no TMA variant was faster)
    (torch.bfloat16, 512, 5120): _T(128, 64, 64, 4, 4),  # attention wkv, compressor (also fp32 out)
    (torch.bfloat16, 4096, 1280): _T(128, 128, 64, 8, 3),  # indexer wq_b
    (torch.bfloat16, 32, 5120): _T(64, 64, 64, 4, 4),  # indexer weights_proj
    (torch.bfloat16, 128, 512): _T(128, 64, 64, 4, 4),
}
# calls with at least this many rows take their weight shape's TUNED tile; fewer rows take the default, whose
# smaller tiles spread a decode-sized call over more SMs (at 64 rows the large tiles measured up to 2x slower).
# Setting it above any row count makes the choice by (dtype, N, K) alone.
TUNED_MIN_ROWS = 1024
# fp32 calls of at most this many rows (the LM head at decode, M = sequences of the step) take the "fma-rows"
# kernel: one warp per 32 columns, each thread its column's FMA chain. On the H200 (phase det_gemm at 0ab9964) the
# head (N = 129,280, K = 5,120) took 1.06 ms at 1 row and 1.40 at 16 (cuBLAS 0.63 / 1.21), where the default
# 64 x 64 dot tile took 6.3 and a 16-row dot tile 2.9; its bits equal the default tile's (rows alone too). Under
# the CPU interpreter, whose tl.fma rounds the product and the sum apart, such calls take the 16-row dot tile
# instead (SMALL_FP32_DOT: the same sums as the default tile there), so the CPU tests see one reduction throughout
SMALL_ROWS = 16
SMALL_FP32 = TileConfig(16, 32, 32, num_warps=1, num_stages=1, kernel="fma-rows")
SMALL_FP32_DOT = TileConfig(16, 128, 32, num_warps=4, num_stages=3)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def config_for(dtype: torch.dtype, n: int, k: int, m: int) -> TileConfig:
    """The tile of an [M, K] x [K, N] GEMM: the weight shape's tuned one for large calls, the small-row fp32 tile
    for fp32 calls of few rows, else the dtype's default (the same sums in each, see the module docstring)."""
    if m >= TUNED_MIN_ROWS:
        return TUNED.get((dtype, n, k), CONFIGS[dtype])
    if dtype == torch.float32 and m <= SMALL_ROWS:
        return SMALL_FP32_DOT if _INTERPRET else SMALL_FP32
    return CONFIGS[dtype]


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(a_ptr, b_ptr, c_ptr, add_ptr, M, N, K,
               s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_addb, s_addm, s_addn, alpha, beta,
               HAS_ADD: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
               EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # program -> output tile, GROUP_M row tiles at a time (only which program computes which tile)
    pid = tl.program_id(0)
    bat = tl.program_id(1).to(tl.int64)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    # rows / columns past the edge read valid ones again (their results are never stored): no masks on the loads
    a_ptrs = a_ptr + bat * s_ab + (rows % M).to(tl.int64)[:, None] * s_am + kk[None, :] * s_ak
    b_ptrs = b_ptr + bat * s_bb + kk[:, None] * s_bk + (cols % N).to(tl.int64)[None, :] * s_bn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):  # K in increasing BK steps, each one dot into the fp32 accumulator: per element
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = k0 + kk < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=PRECISION)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    _epilogue(acc, rows, cols, bat, c_ptr, add_ptr, M, N, s_cb, s_cm, s_cn, s_addb, s_addm, s_addn, alpha, beta,
              HAS_ADD, SCALE)


@triton.jit
def _epilogue(acc, rows, cols, bat, c_ptr, add_ptr, M, N, s_cb, s_cm, s_cn, s_addb, s_addm, s_addn, alpha, beta,
              HAS_ADD: tl.constexpr, SCALE: tl.constexpr):
    """`_mm_kernel`'s epilogue: alpha, beta * add, one rounding to c's dtype, the tile's valid elements stored."""
    if SCALE:
        acc = acc * alpha
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    if HAS_ADD:
        add_ptrs = add_ptr + bat * s_addb + rows.to(tl.int64)[:, None] * s_addm + cols.to(tl.int64)[None, :] * s_addn
        add = tl.load(add_ptrs, mask=ok, other=0.0).to(tl.float32)
        acc = acc + beta * add
    c = c_ptr + bat * s_cb + rows.to(tl.int64)[:, None] * s_cm + cols.to(tl.int64)[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _tile_coords(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile number (batch-major, GROUP_M row tiles walked together) -> (batch, row tile, column tile)."""
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    bat = tile // (n_m * n_n)
    pid = tile % (n_m * n_n)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(n_m - first_m, GROUP_M)
    return bat, first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _tma_tile(tile, tile_c, a_desc, b_desc, c_ptr, add_ptr, M, N, K, a_bstride, s_cb, s_cm, s_cn, s_addb, s_addm,
              s_addn, alpha, beta, HAS_ADD: tl.constexpr, SCALE: tl.constexpr, A_COLS: tl.constexpr,
              B_NK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """One output tile of `_mm_tma_kernel`: loads from tile number `tile`, the epilogue at `tile_c` (the same
    number, from a counter of its own: Triton's persistent matmul keeps the two apart for its loop flattening)."""
    bat, pid_m, pid_n = _tile_coords(tile, M, N, BM, BN, GROUP_M)
    if A_COLS:  # a's batches side by side in its rows: batch bat's K columns start at bat * a_bstride
        a_row = pid_m * BM
        a_col = bat * a_bstride
    else:  # a's batches one after another: batch bat's rows start at bat * M
        a_row = bat * M + pid_m * BM
        a_col = 0
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):  # K in increasing BK steps, one dot each: the pointer kernel's sum
        a = a_desc.load([a_row, a_col + k0])
        if B_NK:
            b = b_desc.load([bat * N + pid_n * BN, k0]).T
        else:
            b = b_desc.load([bat * K + k0, pid_n * BN])
        acc = tl.dot(a, b, acc)
    bat_c, pid_m_c, pid_n_c = _tile_coords(tile_c, M, N, BM, BN, GROUP_M)
    rows = pid_m_c * BM + tl.arange(0, BM)
    cols = pid_n_c * BN + tl.arange(0, BN)
    _epilogue(acc, rows, cols, bat_c.to(tl.int64), c_ptr, add_ptr, M, N, s_cb, s_cm, s_cn, s_addb, s_addm, s_addn,
              alpha, beta, HAS_ADD, SCALE)


@triton.jit(do_not_specialize=["M", "tiles"])
def _mm_tma_kernel(a_desc, b_desc, c_ptr, add_ptr, M, N, K, tiles, a_bstride,
                   s_cb, s_cm, s_cn, s_addb, s_addm, s_addn, alpha, beta,
                   HAS_ADD: tl.constexpr, SCALE: tl.constexpr, A_COLS: tl.constexpr, B_NK: tl.constexpr,
                   BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
                   FLATTEN: tl.constexpr, INTERPRET: tl.constexpr):
    """`_mm_kernel`'s sums with the operands brought by TMA descriptors: a over [Bt * M, K] (a batch's rows one
    after another) or (A_COLS) [M, columns] with batch i's K columns from i * a_bstride (batches side by side in a
    row, as attention's grouped output projection passes them: its K a multiple of BK), b over [Bt * N, K] (B_NK:
    the weight as stored, [N, K] per batch) or [Bt * K, N]. A tile's
    rows or columns past its batch read the next batch's (or TMA's zeros): never stored. The K tail reads zeros
    (past K of a row of a / of b^T); the host sends a [K, N] b with a K tail to the pointer kernel. PROGRAMS 0: one
    program per tile; else a persistent grid of PROGRAMS programs, each walking tiles pid, pid + PROGRAMS, ...
    (which program computes a tile: no sum depends on it)."""
    pid = tl.program_id(0)
    if PROGRAMS == 0:
        _tma_tile(pid, pid, a_desc, b_desc, c_ptr, add_ptr, M, N, K, a_bstride, s_cb, s_cm, s_cn, s_addb, s_addm,
                  s_addn, alpha, beta, HAS_ADD, SCALE, A_COLS, B_NK, BM, BN, BK, GROUP_M)
    elif INTERPRET:  # (the interpreter's range takes no tensor bounds: the same walk, a guard per tile)
        for t0 in range(0, tiles, PROGRAMS):
            if t0 + pid < tiles:
                _tma_tile(t0 + pid, t0 + pid, a_desc, b_desc, c_ptr, add_ptr, M, N, K, a_bstride, s_cb, s_cm, s_cn,
                          s_addb, s_addm, s_addn, alpha, beta, HAS_ADD, SCALE, A_COLS, B_NK, BM, BN, BK, GROUP_M)
    else:
        tile_c = pid - PROGRAMS
        for tile in tl.range(pid, tiles, PROGRAMS, flatten=FLATTEN):
            tile_c += PROGRAMS
            _tma_tile(tile, tile_c, a_desc, b_desc, c_ptr, add_ptr, M, N, K, a_bstride, s_cb, s_cm, s_cn, s_addb,
                      s_addm, s_addn, alpha, beta, HAS_ADD, SCALE, A_COLS, B_NK, BM, BN, BK, GROUP_M)


@triton.jit
def _split4(x, R: tl.constexpr):
    """[R, 4] -> its 4 columns in order (register moves when a thread holds a row's 4 values)."""
    even, odd = tl.split(tl.reshape(x, (R, 2, 2)))  # k 0, 2 | k 1, 3
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _fma4(acc, a, b, BM: tl.constexpr, BN: tl.constexpr):
    """acc[m, n] = fma(a[m, k], b[n, k], acc[m, n]) for k = 0..3 in order."""
    a0, a1, a2, a3 = _split4(a, BM)
    b0, b1, b2, b3 = _split4(b, BN)
    acc = tl.fma(a0[:, None], b0[None, :], acc)
    acc = tl.fma(a1[:, None], b1[None, :], acc)
    acc = tl.fma(a2[:, None], b2[None, :], acc)
    acc = tl.fma(a3[:, None], b3[None, :], acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _mm_fma_rows_kernel(a_ptr, b_ptr, c_ptr, add_ptr, M, N, K,
                        s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_addb, s_addm, s_addn, alpha, beta,
                        HAS_ADD: tl.constexpr, SCALE: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr):
    """fp32: per output element acc = fma(a[m, k], b[k, n], acc) for k = 0, 1, .., K - 1 from 0, the chain the fp32
    IEEE dot builds, written out: a program holds BM rows and BN columns and reads k four at a time, twice per step
    ([BN, 4] of b: one column's 4 contiguous k in one thread's 16-byte load, so that taking them apart moves no data
    between threads). Row blocks are the grid's first axis, so the programs reading one column block of the weight
    run together (it is read from memory once)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bat = tl.program_id(2).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, 4)
    a_ptrs = a_ptr + bat * s_ab + (rows % M).to(tl.int64)[:, None] * s_am + kk[None, :] * s_ak
    b_ptrs = b_ptr + bat * s_bb + (cols % N).to(tl.int64)[:, None] * s_bn + kk[None, :] * s_bk  # [BN, 4]: b^T
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, 8):
        if EVEN_K:
            a_lo = tl.load(a_ptrs)
            b_lo = tl.load(b_ptrs)
            a_hi = tl.load(a_ptrs + 4 * s_ak)
            b_hi = tl.load(b_ptrs + 4 * s_bk)
        else:
            lo_ok = k0 + kk < K
            hi_ok = k0 + 4 + kk < K
            a_lo = tl.load(a_ptrs, mask=lo_ok[None, :], other=0.0)
            b_lo = tl.load(b_ptrs, mask=lo_ok[None, :], other=0.0)
            a_hi = tl.load(a_ptrs + 4 * s_ak, mask=hi_ok[None, :], other=0.0)
            b_hi = tl.load(b_ptrs + 4 * s_bk, mask=hi_ok[None, :], other=0.0)
        acc = _fma4(acc, a_lo, b_lo, BM, BN)  # k0 .. k0 + 3
        acc = _fma4(acc, a_hi, b_hi, BM, BN)  # k0 + 4 .. k0 + 7
        a_ptrs += 8 * s_ak
        b_ptrs += 8 * s_bk
    _epilogue(acc, rows, cols, bat, c_ptr, add_ptr, M, N, s_cb, s_cm, s_cn, s_addb, s_addm, s_addn, alpha, beta,
              HAS_ADD, SCALE)


def _tma_operands(a: torch.Tensor, b: torch.Tensor, cfg: TileConfig):
    """The TMA kernel's views of a [Bt, M, K] and b [Bt, K, N]: (a's descriptor, b's, a_cols, a's batch stride,
    b_nk), or None where descriptors cannot take them. a: [Bt * M, K] (its batches one after another), or [M,
    columns] (a_cols: batches side by side in each row, e.g. [T, G, k] transposed to [G, T, k]; K a multiple of BK,
    or a partial last step would read the next batch's columns instead of zeros). b: [Bt * N, K] (b_nk: the weight
    as stored) or [Bt * K, N] (one batch, or K a multiple of BK). Strides and bases 16-byte aligned, the last
    dimension contiguous."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    Bt, M, K = a.shape
    N = b.shape[2]
    es = a.element_size()
    whole_steps = K % cfg.BK == 0

    def aligned(t, *strides):
        return t.data_ptr() % 16 == 0 and all((st * es) % 16 == 0 for st in strides)

    if a.stride(2) != 1 or not aligned(a, a.stride(1), a.stride(0) if Bt > 1 else 0):
        return None
    if Bt == 1 or a.stride(0) == M * a.stride(1):
        a_cols = False
        ad = TensorDescriptor(a, [Bt * M, K], [a.stride(1), 1], [cfg.BM, cfg.BK])
    elif whole_steps and a.stride(0) >= K and (Bt - 1) * a.stride(0) + K <= a.stride(1):
        a_cols = True
        ad = TensorDescriptor(a, [M, (Bt - 1) * a.stride(0) + K], [a.stride(1), 1], [cfg.BM, cfg.BK])
    else:
        return None
    if b.stride(1) == 1 and (Bt == 1 or b.stride(0) == N * b.stride(2)) and aligned(b, b.stride(2)):
        b_nk = True
        bd = TensorDescriptor(b, [Bt * N, K], [b.stride(2), 1], [cfg.BN, cfg.BK])
    elif (b.stride(2) == 1 and (Bt == 1 or b.stride(0) == K * b.stride(1)) and aligned(b, b.stride(1))
          and (Bt == 1 or whole_steps)):
        b_nk = False
        bd = TensorDescriptor(b, [Bt * K, N], [b.stride(1), 1], [cfg.BK, cfg.BN])
    else:
        return None
    return ad, bd, a_cols, a.stride(0), b_nk


def _check(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    if a.dtype != b.dtype or a.dtype not in CONFIGS:
        raise NotImplementedError(f"deterministic mode: {op} takes bf16, fp16 or fp32 operands of one dtype, got "
                                  f"{a.dtype} x {b.dtype} (no batch-invariant kernel for that)")


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
        add: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 1.0,
        config: TileConfig | None = None) -> torch.Tensor:
    """out[i] = alpha * a[i] @ b[i] (+ beta * add[i]) for a [B, M, K], b [B, K, N], add broadcastable to [B, M, N];
    fp32 accumulation, one rounding to out's dtype (default: a's, or `out_dtype`). Any strides. `config` (the
    benchmarks' sweep) replaces `config_for`'s choice; the overrides never pass one."""
    _check(a, b, "bmm")
    Bt, M, K = a.shape
    N = b.shape[2]
    if b.shape[0] != Bt or b.shape[1] != K:
        raise ValueError(f"bmm: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    dtype = out_dtype or (out.dtype if out is not None else a.dtype)
    out = torch.empty(Bt, M, N, dtype=dtype, device=a.device) if out is None else out
    if out.shape != (Bt, M, N):
        raise ValueError(f"bmm: out has shape {tuple(out.shape)}, expected {(Bt, M, N)}")
    if out.numel() == 0:
        return out
    if K == 0:
        return out.copy_(torch.zeros_like(out) if add is None else (beta * add).expand(Bt, M, N))
    add_t = add.expand(Bt, M, N) if add is not None else out
    cfg = config or config_for(a.dtype, N, K, M)
    fp32 = a.dtype == torch.float32
    if cfg.kernel not in KERNELS:
        raise ValueError(f"bmm: unknown kernel {cfg.kernel!r} in {cfg}; known: {KERNELS}")
    common = dict(HAS_ADD=add is not None, SCALE=alpha != 1.0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.kernel == "fma-rows" and fp32:  # (other dtypes: the pointer kernel with the config's tile)
        # rows of a program: a tile by M (up to FMA_ROWS_MAX), the chain per element is the same
        bm = min(FMA_ROWS_MAX, triton.next_power_of_2(M))
        _mm_fma_rows_kernel[(triton.cdiv(M, bm), triton.cdiv(N, cfg.BN), Bt)](
            a, b, out, add_t, M, N, tl.constexpr(K) if _INTERPRET else K, *a.stride(), *b.stride(), *out.stride(),
            *add_t.stride(), float(alpha), float(beta), EVEN_K=K % 8 == 0, BM=bm, BN=cfg.BN, **common)
        return out
    tma = _tma_operands(a, b, cfg) if cfg.kernel.startswith("tma") and not fp32 else None
    if tma is not None:
        ad, bd, a_cols, a_bstride, b_nk = tma
        tiles = triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN) * Bt
        # persistent: one program per SM whatever the call's size (one build per GPU; programs past the last
        # tile have nothing to do)
        programs = 0 if cfg.kernel == "tma" else (sm_count(a.device) if a.is_cuda else 3)
        _mm_tma_kernel[(programs or tiles,)](
            ad, bd, out, add_t, M, N, *((tl.constexpr(K), tl.constexpr(tiles)) if _INTERPRET else (K, tiles)),
            a_bstride, *out.stride(), *add_t.stride(), float(alpha), float(beta), A_COLS=a_cols, B_NK=b_nk,
            BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
            GROUP_M=cfg.GROUP_M, PROGRAMS=programs, FLATTEN=cfg.kernel == "tma-persistent-flat",
            INTERPRET=_INTERPRET, **common)
        return out
    grid = (triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN), Bt)
    # K is a runtime value: one build per configuration serves every weight width. Triton 3.6's interpreter cannot
    # loop up to a runtime scalar (under numpy 2), so there it goes in as a constant
    _mm_kernel[grid](a, b, out, add_t, M, N, tl.constexpr(K) if _INTERPRET else K,
                     *a.stride(), *b.stride(), *out.stride(), *add_t.stride(),
                     float(alpha), float(beta), HAS_ADD=add is not None, SCALE=alpha != 1.0,
                     PRECISION="ieee" if fp32 else "tf32",
                     DOT_DTYPE=tl.float32 if (fp32 or _INTERPRET) else
                     (tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float16),
                     EVEN_K=K % cfg.BK == 0, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           add: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 1.0,
           config: TileConfig | None = None) -> torch.Tensor:
    """The 2-D case of `bmm`: a [M, K] @ b [K, N] (+ beta * add, broadcastable to [M, N])."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"matmul: expected 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    M, N = a.shape[0], b.shape[1]
    o = None if out is None else out.unsqueeze(0)
    r = bmm(a.unsqueeze(0), b.unsqueeze(0), o, out_dtype, None if add is None else add.expand(M, N).unsqueeze(0),
            alpha, beta, config)
    return r[0] if out is None else out


# ---------------------------------------------------------------------------------------------- aten overrides


def _mm(a, b):
    return matmul(a, b)


def _mm_out(a, b, *, out):
    check_out(out, (a.shape[0], b.shape[1]))
    return matmul(a, b, out=out)


def _mm_dtype(a, b, out_dtype):
    return matmul(a, b, out_dtype=out_dtype)


def _addmm(add, a, b, *, beta=1, alpha=1):
    return matmul(a, b, add=add if beta != 0 else None, alpha=alpha, beta=beta, out_dtype=a.dtype)


def _bmm(a, b):
    return bmm(a, b)


def _bmm_out(a, b, *, out):
    check_out(out, (a.shape[0], a.shape[1], b.shape[2]))
    return bmm(a, b, out=out)


_OVERRIDE = AtenOverride("CUDA", {
    "mm": _mm,
    "mm.out": _mm_out,
    "addmm": _addmm,
    "bmm": _bmm,
    "bmm.out": _bmm_out,
    "mm.dtype": _mm_dtype,
})
enable, disable, enabled = _OVERRIDE.enable, _OVERRIDE.disable, _OVERRIDE.enabled
