"""Routed experts at decode row counts, read in Humming's weight layout and split over K: a candidate for issue 28
(`humming_experts.expert_gemm` dispatches it only up to SPLIT_K_MAX_ROWS expected rows).

Why: at B = 1 on one emulated EP4 rank Humming's grouped GEMM streams one touched expert's w1|w3 at 0.52 TB/s
(docs/perf/020). With stream-K off (its bf16 reduce-add rounds twice) a GEMM has one CTA per column tile of each
touched expert, ~50 for 132 SMs. Here programs also split K: each adds its piece's exact products in fp32, and a
second pass adds the pieces in a fixed order and rounds once to bf16. Each output is then one fp32 sum of the exact
products and one rounding, as Humming's and the reference's are; only the order of the sum differs.

The layout (`humming_experts.convert`; derived from the library's repack kernel for 4-bit weights and 16-bit
activations; `layout_codes` / `layout_scales` write it from the checkpoint's bytes):
- codes, per expert int32 [K/16, 2N]. Row s holds K slab 16s..16s+15. Its words 128b..128b+127 hold columns
  64b..64b+63. Word 4t + i3 (t = 4 tn + tk), nibble q = 4 i6 + 2 i4 + i5, is column 16 i3 + 8 i4 + tn at
  k = 8 i5 + 2 tk + i6 (mma.sync's B fragments, thread t);
- scales, per expert uint8 [K/32, N]. Within every 64 columns, position 8a + c holds column 8c + a.
A program owns 64 columns (one block b) of one touched expert and one piece of K. It walks the piece in a
pipelined loop of STEP_K-deep steps; a step loads SLABS rows of 128 contiguous words (16-byte loads), expands
their nibbles by broadcasting into [tn, i3, i4 | slab, tk, i6, i5] order and reshapes that to a [64, STEP_K] tile
whose rows n' = 8 tn + 2 i3 + i4 are the columns' scale positions; the rows' activations are gathered in the same
k order (L1-resident) and the output columns are scattered back at the store.

Measured on the H200 (docs/perf/021): the first build (64-deep steps of [32, 16] words in a while loop, which the
compiler does not pipeline; 8-byte loads) streamed one expert at 0.26 TB/s, half Humming's rate.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mini.kernels.device_info import H200_SMS, sm_count
from mini.kernels.quant import e2m1_value, e8m0_value

ROWS = 16  # an expert's rows go through the MMA 16 at a time (decode: 1-16 rows per touched expert)
SLABS = 8  # K slabs of 16 per loop step: [64 columns, 128 k] of weights (4 KB of codes) per step
STEP_K = 16 * SLABS
# Triton 3.6's interpreter cannot take the kernel's run-time loop bound (a for loop, which the compiler pipelines;
# a while loop it does not); 3.7's runs it. Compiled (CUDA) it runs on both.
_INTERPRETER_RUNS_IT = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7)


def runs_on(a: torch.Tensor) -> bool:
    """Whether the kernel can take `a` here: on CUDA, or on CPU under the interpreter from Triton 3.7 on."""
    return a.is_cuda or _INTERPRETER_RUNS_IT


def layout_codes(codes: torch.Tensor) -> torch.Tensor:
    """Checkpoint MXFP4 codes uint8 [..., N, K/2] (low nibble = even k) -> Humming's int32 [..., K/16, 2N]."""
    *lead, N, half_k = codes.shape
    K = 2 * half_k
    nib = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*lead, N, K)
    # n = 64 b + 16 i3 + 8 i4 + tn, k = 16 s + 8 i5 + 2 tk + i6
    v = nib.reshape(*lead, N // 64, 4, 2, 8, K // 16, 2, 4, 2)
    d = len(lead)
    b, i3, i4, tn, s, i5, tk, i6 = (d + j for j in range(8))
    v = v.permute(*range(d), s, b, tn, tk, i3, i6, i4, i5)  # word (b, tn, tk, i3), nibble q = (i6, i4, i5)
    v = v.reshape(*lead, K // 16, 2 * N, 4, 2)
    return (v[..., 0] | (v[..., 1] << 4)).contiguous().view(torch.int32).reshape(*lead, K // 16, 2 * N)


def layout_scales(scales: torch.Tensor) -> torch.Tensor:
    """Checkpoint E8M0 scales uint8 [..., N, K/32] -> Humming's uint8 [..., K/32, N]."""
    *lead, N, groups = scales.shape
    t = scales.transpose(-1, -2).reshape(*lead, groups, N // 64, 8, 8)  # column 64 b + 8 c + a
    return t.transpose(-1, -2).reshape(*lead, groups, N).contiguous()  # at 8 a + c


@triton.jit(do_not_specialize=["R", "STEPS"])
def _humming_gemv_kernel(a_ptr, off_ptr, w_ptr, s_ptr, y_ptr, part_ptr, R, N, K, stride_a, STEPS,
                         E: tl.constexpr, EP: tl.constexpr, TP: tl.constexpr, SS: tl.constexpr, SPLIT: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (column block b, slot, K piece): the slot-th expert that has rows, its rows TP at a time, over
    STEPS steps of SS slabs (16 SS deep) from piece * STEPS; SPLIT: fp32 partials to part[piece, row, n], else bf16
    to y[row, n]. Tiles are indexed (tn, i3, i4 | slab, tk, i6, i5): rows n' = 8 tn + 2 i3 + i4, which is also
    the column's scale position, and columns k' = 16 slab + 4 tk + 2 i6 + i5."""
    b, slot, piece = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ex = tl.arange(0, EP)
    lo = tl.load(off_ptr + ex, mask=ex < E, other=0)
    hi = tl.load(off_ptr + ex + 1, mask=ex < E, other=0)
    has = hi > lo
    pick = has & (tl.cumsum(has.to(tl.int32), 0) == slot + 1)
    if tl.sum(pick.to(tl.int32), 0) > 0:
        e = tl.sum(tl.where(pick, ex, 0), 0)
        r0 = tl.sum(tl.where(pick, lo, 0), 0)
        r1 = tl.sum(tl.where(pick, hi, 0), 0)
        tn = tl.arange(0, 8)[:, None, None, None]
        i3 = tl.arange(0, 4)[None, :, None, None]
        sl = tl.arange(0, SS)[None, None, :, None]
        tk = tl.arange(0, 4)[None, None, None, :]
        # one step's words [tn, i3, slab, tk]: 128 contiguous words per slab for this column block
        w_tile = sl * (2 * N) + b * 128 + tn * 16 + tk * 4 + i3
        i4 = tl.arange(0, 2)[None, None, :, None]
        s_sl = tl.arange(0, SS)[None, None, None, :]
        s_tile = (s_sl // 2) * N + b * 64 + 8 * tn + 2 * i3 + i4  # [tn, i3, i4, slab]: a group of 32 is 2 slabs
        i4x = tl.arange(0, 2)[None, None, :, None, None, None, None]
        i6x = tl.arange(0, 2)[None, None, None, None, None, :, None]
        i5x = tl.arange(0, 2)[None, None, None, None, None, None, :]
        shift = 4 * (4 * i6x + 2 * i4x + i5x)  # nibble q = 4 i6 + 2 i4 + i5
        kq = tl.arange(0, 16 * SS)  # k' -> k within the step
        k_of = (kq // 16) * 16 + (kq % 2) * 8 + ((kq // 4) % 4) * 2 + (kq // 2) % 2
        nq = tl.arange(0, 64)  # n' -> column
        n_of = b * 64 + ((nq // 2) % 4) * 16 + (nq % 2) * 8 + nq // 8
        w_e = w_ptr + e.to(tl.int64) * (K // 16) * (2 * N)
        s_e = s_ptr + e.to(tl.int64) * (K // 32) * N
        slab0 = piece * STEPS * SS
        t = tl.arange(0, TP)
        row0 = r0
        while row0 < r1:
            rows = row0 + t
            r_ok = rows < r1
            x_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_a + k_of[None, :]
            acc = tl.zeros([64, TP], dtype=tl.float32)
            for i in range(0, STEPS):
                s0 = slab0 + i * SS
                live = s0 < K // 16  # the last piece may hold fewer steps
                words = tl.load(w_e + s0 * (2 * N) + w_tile, mask=live, other=0)
                sc = tl.load(s_e + (s0 // 2) * N + s_tile, mask=live, other=127).to(tl.int32)
                x = tl.load(x_ptrs + s0 * 16, mask=r_ok[:, None] & live, other=0.0).to(DOT_DTYPE)
                nib = (words[:, :, None, :, :, None, None] >> shift) & 15  # [tn, i3, i4, slab, tk, i6, i5]
                # two exact multiplies: the E2M1 value, then the E8M0 scale
                val = e2m1_value(nib) * e8m0_value(sc)[:, :, :, :, None, None, None]
                w = tl.reshape(val, [64, 16 * SS]).to(DOT_DTYPE)
                acc += tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION)
            ok = r_ok[None, :]
            if SPLIT:
                at = piece.to(tl.int64) * R * N + rows[None, :].to(tl.int64) * N + n_of[:, None]
                tl.store(part_ptr + at, acc, mask=ok)
            else:
                at = rows[None, :].to(tl.int64) * N + n_of[:, None]
                tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=ok)
            row0 += TP


@triton.jit(do_not_specialize=["R"])
def _sum_pieces_kernel(part_ptr, y_ptr, off_ptr, R, N, E: tl.constexpr, PIECES: tl.constexpr,
                       PP: tl.constexpr, BLOCK: tl.constexpr):
    """y[r, n] = the pieces' partials added as one tree fixed by PIECES, in y's dtype, for the local rows
    r < expert_offset[E] (later rows left unwritten)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat over [R, N]
    ok = i < tl.load(off_ptr + E) * N
    p = tl.arange(0, PP)
    parts = tl.load(part_ptr + p[:, None].to(tl.int64) * R * N + i[None, :],
                    mask=(p < PIECES)[:, None] & ok[None, :], other=0.0)
    tl.store(y_ptr + i, tl.sum(parts, axis=0).to(y_ptr.dtype.element_ty), mask=ok)


def pieces_for(N: int, K: int, touched: int, sms: int = H200_SMS, programs_per_sm: int = 4,
               step_k: int = STEP_K) -> int:
    """How many K pieces (of whole step_k-deep steps) give about `programs_per_sm` programs per SM when `touched`
    experts each run N / 64 column blocks."""
    steps = K // step_k
    return max(1, min(steps, triton.cdiv(programs_per_sm * sms, (N // 64) * max(touched, 1))))


def humming_gemv(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, expert_offset: torch.Tensor,
                 touched: int, out: torch.Tensor | None = None, pieces: int | None = None, slabs: int = SLABS,
                 num_stages: int = 3, num_warps: int = 4) -> torch.Tensor:
    """a bf16 [R, K] (rows sorted by expert, row-major), weight int32 [E, K/16, 2N] and scale uint8 / E8M0
    [E, K/32, N] in Humming's layout (`layout_codes` / `layout_scales`, or a `HummingStack`'s), expert_offset int32
    [E+1] -> out bf16 [R, N] = a W_e^T for the rows of each expert e; rows past expert_offset[E] left unwritten.
    `touched`: about how many experts have rows (sets the split over K; `pieces` overrides it). `slabs`,
    `num_stages`, `num_warps`: the build (the defaults are the served one; others for tools/humming_decode_study.py)."""
    step_k = 16 * slabs
    E, k16, two_n = weight.shape
    N, K = two_n // 2, 16 * k16
    R = a.shape[0]
    if a.dtype != torch.bfloat16 or a.dim() != 2 or a.shape[1] != K or a.stride(1) != 1:
        raise ValueError(f"humming_gemv: a must be row-major bf16 [R, {K}], got {a.dtype} {tuple(a.shape)}")
    if weight.dtype != torch.int32 or N % 64 or K % step_k:
        raise ValueError(f"humming_gemv: int32 weights of N a multiple of 64 and K of {step_k} expected, got "
                         f"{weight.dtype} N={N} K={K}")
    if scale.shape != (E, K // 32, N) or expert_offset.shape != (E + 1,):
        raise ValueError(f"humming_gemv: scale [{E}, {K // 32}, {N}] and expert_offset [{E + 1}] expected")
    out = torch.empty(R, N, dtype=torch.bfloat16, device=a.device) if out is None else out
    if out.shape != (R, N) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"humming_gemv: out must be a contiguous bf16 [{R}, {N}] tensor")
    if R == 0:
        return out
    steps = K // step_k
    pieces = min(pieces or pieces_for(N, K, touched, sm_count(a.device), step_k=step_k), steps)
    per_piece = triton.cdiv(steps, pieces)
    pieces = triton.cdiv(steps, per_piece)
    part = torch.empty(pieces, R, N, dtype=torch.float32, device=a.device) if pieces > 1 else out
    interpreted = a.device.type == "cpu"  # the interpreter's bf16 dot is broken: the same values in fp32
    grid = (N // 64, min(E, R), pieces)
    _humming_gemv_kernel[grid](a, expert_offset, weight, scale.view(torch.uint8), out, part, R, N, K, a.stride(0),
                               per_piece, E=E, EP=triton.next_power_of_2(E), TP=ROWS, SS=slabs, SPLIT=pieces > 1,
                               DOT_DTYPE=tl.float32 if interpreted else tl.bfloat16,
                               DOT_PRECISION="ieee" if interpreted else None, num_stages=num_stages,
                               num_warps=num_warps)
    if pieces > 1:
        block = 1024
        _sum_pieces_kernel[(triton.cdiv(R * N, block),)](part, out, expert_offset, R, N, E=E, PIECES=pieces,
                                                          PP=triton.next_power_of_2(pieces), BLOCK=block)
    return out
