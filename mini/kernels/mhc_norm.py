"""mHC site input, fused: mixes (one rsqrt over hc·D, the 24-wide projection, sigmoids, 20 Sinkhorn iterations on
the 4×4 comb in registers), the collapse of the hc copies and the weighted RMSNorm of the collapsed row, with an
optional FP8 1×block fake quant of the normed output. `mini.ops.mhc.pre_norm` calls it at every mHC site (the
plain RMSNorm is mini/kernels/rms_norm.py).

Same functions as mini/ops/mhc.py (`mixes`, `collapse`) and mini/ops/norm.py (`rms_norm`):
* the projection is an fp32 dot. For a bf16 stream every stream value is exact in bf16, and fn splits exactly into
  three bf16 pieces (8 + 8 + 8 significant bits; `fn_pieces`, computed once per weight tensor): three bf16 MMAs
  then give every product exactly, summed in the tensor cores' fp32 accumulator (not plain tf32, whose 10-bit fn
  would feed its error into sigmoids and a softmax). Measured at T=4096 on the H200 against the fp32 torch
  reference: max relative error of pre / post / comb 5.6e-6 / 2.9e-6 / 1.9e-5 (the former one-kernel 3xTF32
  version: 5.7e-7 / 5.0e-7 / 2.3e-6; the tests' bounds are 2e-4 / 2e-4 / 5e-4). An fp32 stream uses one fp32
  dot (`precision`: 3xTF32 by default, "ieee" for FMA);
* the collapse sums the hc weighted copies in fp32 (a tree sum) and rounds to the stream dtype before the norm;
* V4.1 collapses with the previous site's `pre` (delayed, known before this site's mixes); V4 passes none and
  the kernel collapses with the `pre` it just computed.

Two launches, so that the whole GPU streams h once (a [4096, 4, 5120] bf16 stream is 168 MB; 135 us per V4.1 site
on the H200 against 574 us for the former one-kernel version, docs/kernels.md):
1. `_mhc_partial_kernel`, grid (token blocks, D chunks) = split-K over the hc·D reduction: each program reads all
   hc copies of its D chunk once (per step one [block_t, hc·block_k] tile, the copies side by side along K, and
   the matching [hc·block_k, 32] tiles of fn's three pieces: three MMAs per step) for its partial sum of squares
   and partial projection, and (V4.1, delayed pre) the collapsed, rounded row chunk, written to y with its
   partial sum of squares;
2. `_mhc_finish_kernel`, grid (token blocks): sums the partials (one tile, a tree over the splits), then the
   sigmoids and the Sinkhorn, (V4 only: the collapse with its own pre, a second read of h) and the normalisation
   of y in place.
The split count follows T (`partial_tiles`): 8 chunks fill the GPU at thousands of tokens, but a decode step has
one token block, and every token block reads all of fn's pieces (3.9 MB at V4.1, against h's 40 KB per token):
there D is cut into up to one chunk per block_k step, ~160 programs, and the finishing pass takes fewer tokens per
program (`finish_tiles`). The deterministic mode keeps the 8 chunks, 64-token blocks and the finishing pass's
8 x 512 tiles at every T (`invariant`), so that a row's sums do not depend on the step's size.
"""
import os
import weakref

import torch
import triton
import triton.language as tl

from mini.formats.quant import fake_quant_enabled
from mini.kernels.device_info import sm_count
from mini.kernels.quant import fake_quant_tile, kind_code

PART_COLS = 32  # one partial row: m in cols 0..NM-1 (pre, post, comb: NM = 24), then sum h^2, sum y^2
# Triton 3.6's interpreter multiplies bf16 tiles wrongly (seen on CPU): there the bf16 pieces are multiplied as fp32
# tiles holding the same values (still exact products), on the GPU as bf16 MMA operands.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot_pieces(x, hi, mid, lo, acc, OP: tl.constexpr):
    """acc + x @ (hi + mid + lo) for a bf16 tile x and the three bf16 pieces of an fp32 tile (`fn_pieces`): each of
    the three products is exact, summed in the fp32 accumulator in the order hi, mid, lo."""
    acc = tl.dot(x.to(OP), hi.to(OP), acc)
    acc = tl.dot(x.to(OP), mid.to(OP), acc)
    return tl.dot(x.to(OP), lo.to(OP), acc)


@triton.jit
def _mhc_partial_kernel(
    h_ptr, fn_ptr, pieces_ptr, pre_in_ptr, part_ptr, y_ptr, T,
    D: tl.constexpr, HC: tl.constexpr, NM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, COLLAPSE: tl.constexpr, SPLIT_BF16: tl.constexpr, OP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    s = tl.program_id(1)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    K: tl.constexpr = HC * D
    row0 = toks.to(tl.int64)[:, None] * K  # start of each token's [hc, D] block
    # one step's tile holds the hc copies side by side along K: column j is copy j // BLOCK_K, column j % BLOCK_K
    # of the step, so one MMA per fn piece covers all copies
    j = tl.arange(0, HC * BLOCK_K)
    jc = j // BLOCK_K
    jd = j % BLOCK_K
    kk = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 32)  # fn rows 0..NM-1 (pre, post, comb); rows NM.. read as 0
    col_ok = cols < NM
    copies = tl.arange(0, HC)
    # the delayed pre of every copy, loaded once: a load per step would wait on a round trip each time
    pre_w = tl.load(pre_in_ptr + toks[:, None] * HC + copies[None, :], mask=tok_ok[:, None], other=0.0)

    sumsq = tl.zeros([BLOCK_T], tl.float32)
    ysq = tl.zeros([BLOCK_T], tl.float32)
    m = tl.zeros([BLOCK_T, 32], tl.float32)
    for d0 in range(0, CHUNK, BLOCK_K):
        d = s * CHUNK + d0 + jd
        d_ok = d < D
        x = tl.load(h_ptr + row0 + (jc * D + d)[None, :], mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
        if SPLIT_BF16:  # fn's bf16 pieces [3, K, 32] (fn_pieces), loaded straight into the MMAs
            p = pieces_ptr + (jc * D + d)[:, None] * 32 + cols[None, :]
            hi = tl.load(p, mask=d_ok[:, None], other=0.0)
            mid = tl.load(p + K * 32, mask=d_ok[:, None], other=0.0)
            lo = tl.load(p + 2 * K * 32, mask=d_ok[:, None], other=0.0)
            m = _dot_pieces(x, hi, mid, lo, m, OP)
        else:
            f = tl.load(fn_ptr + cols[None, :] * K + (jc * D + d)[:, None], mask=d_ok[:, None] & col_ok[None, :],
                        other=0.0)
            m = tl.dot(xf, f, m, input_precision=PRECISION)
        if COLLAPSE:
            y = tl.sum(tl.reshape(xf, [BLOCK_T, HC, BLOCK_K]) * pre_w[:, :, None], axis=1)
            y = y.to(y_ptr.dtype.element_ty)
            yf = y.to(tl.float32)
            ysq += tl.sum(yf * yf, axis=1)
            dy = s * CHUNK + d0 + kk
            tl.store(y_ptr + toks.to(tl.int64)[:, None] * D + dy[None, :], y, mask=tok_ok[:, None] & (dy < D)[None, :])
    # one partial row per token: m in cols 0..NM-1 (fn's zero rows leave NM.. at 0), then the two statistics
    m = tl.where((cols == NM)[None, :], sumsq[:, None], tl.where((cols == NM + 1)[None, :], ysq[:, None], m))
    tl.store(part_ptr + (s * T + toks.to(tl.int64))[:, None] * 32 + cols[None, :], m, mask=tok_ok[:, None])


@triton.jit
def _mhc_partial_copies_kernel(
    h_ptr, pieces_ptr, pre_in_ptr, part_ptr, y_ptr, T,
    D: tl.constexpr, HC: tl.constexpr, NM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, COLLAPSE: tl.constexpr, OP: tl.constexpr,
):
    """`_mhc_partial_kernel` for a bf16 stream of 4 copies with each copy's [BLOCK_T, BLOCK_K] slice its own tile
    (layout="copies"): the collapse and the sums of squares are elementwise across the copies instead of a
    reduction over a [BLOCK_T, 4, BLOCK_K] view of one side-by-side tile, so no cross-thread shuffles and fewer
    registers (sm_90a at 64 x 16: 372 instructions per step and thread, 56 registers, against 568 and 95). The
    projection's MMAs keep the side-by-side tile's order (hi over copies 0..3, then mid, then lo); the sums of
    squares and the collapse group their fp32 terms otherwise, so the mixes and y may move in their last bits."""
    tl.static_assert(HC == 4)
    s = tl.program_id(1)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    K: tl.constexpr = HC * D
    row0 = toks.to(tl.int64)[:, None] * K  # start of each token's [hc, D] block
    kk = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 32)
    wb = pre_in_ptr + toks * HC  # the delayed pre of every copy, loaded once
    w0 = tl.load(wb + 0, mask=tok_ok, other=0.0)[:, None]
    w1 = tl.load(wb + 1, mask=tok_ok, other=0.0)[:, None]
    w2 = tl.load(wb + 2, mask=tok_ok, other=0.0)[:, None]
    w3 = tl.load(wb + 3, mask=tok_ok, other=0.0)[:, None]
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    ysq = tl.zeros([BLOCK_T], tl.float32)
    m = tl.zeros([BLOCK_T, 32], tl.float32)
    for d0 in range(0, CHUNK, BLOCK_K):
        d = s * CHUNK + d0 + kk
        d_ok = d < D
        ok = tok_ok[:, None] & d_ok[None, :]
        x0 = tl.load(h_ptr + row0 + d[None, :], mask=ok, other=0.0)
        x1 = tl.load(h_ptr + row0 + D + d[None, :], mask=ok, other=0.0)
        x2 = tl.load(h_ptr + row0 + 2 * D + d[None, :], mask=ok, other=0.0)
        x3 = tl.load(h_ptr + row0 + 3 * D + d[None, :], mask=ok, other=0.0)
        f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        sumsq += tl.sum(f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3, axis=1)
        # fn's bf16 pieces [3, K, 32]: rows c * D + d of copy c; piece by piece over the copies, as one K = 4 x
        # BLOCK_K dot of the side-by-side tile accumulates
        pm = d_ok[:, None]
        for piece in tl.static_range(3):
            p = pieces_ptr + piece * K * 32 + d[:, None] * 32 + cols[None, :]
            m = tl.dot(x0.to(OP), tl.load(p, mask=pm, other=0.0).to(OP), m)
            m = tl.dot(x1.to(OP), tl.load(p + D * 32, mask=pm, other=0.0).to(OP), m)
            m = tl.dot(x2.to(OP), tl.load(p + 2 * D * 32, mask=pm, other=0.0).to(OP), m)
            m = tl.dot(x3.to(OP), tl.load(p + 3 * D * 32, mask=pm, other=0.0).to(OP), m)
        if COLLAPSE:
            y = ((f0 * w0 + f1 * w1) + (f2 * w2 + f3 * w3)).to(y_ptr.dtype.element_ty)
            yf = y.to(tl.float32)
            ysq += tl.sum(yf * yf, axis=1)
            tl.store(y_ptr + toks.to(tl.int64)[:, None] * D + d[None, :], y, mask=ok)
    m = tl.where((cols == NM)[None, :], sumsq[:, None], tl.where((cols == NM + 1)[None, :], ysq[:, None], m))
    tl.store(part_ptr + (s * T + toks.to(tl.int64))[:, None] * 32 + cols[None, :], m, mask=tok_ok[:, None])


@triton.jit
def _mhc_finish_kernel(
    h_ptr, part_ptr, scale_ptr, base_ptr, norm_w_ptr, pre_in_ptr,
    pre_ptr, post_ptr, comb_ptr, y_ptr,
    T, norm_eps, hc_eps,
    D: tl.constexpr, HC: tl.constexpr, ITERS: tl.constexpr, NSPLIT: tl.constexpr, SP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DELAYED: tl.constexpr, COLLAPSE: tl.constexpr,
    QUANT: tl.constexpr, QBLOCK: tl.constexpr, D_PIECES: tl.constexpr,
):
    """Program (token block, piece). D_PIECES == 1: the mixes, then the collapse's normalisation over all of D.
    D_PIECES > 1 (delayed collapse only): piece 0 the mixes, piece p >= 1 the normalisation of D columns
    [(p - 1) BLOCK_D, p BLOCK_D): the same values, without one program's serial walk over D after its Sinkhorn."""
    NC: tl.constexpr = HC * HC  # comb entries
    NP: tl.constexpr = 2 * HC  # pre + post entries
    K: tl.constexpr = HC * D
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    piece = tl.program_id(1)
    tok_ok = toks < T
    cols = tl.arange(0, 16)
    pp_ok = cols < NP

    # sum the split-K partials: all NSPLIT of a token block loaded as one tile (independent loads, one round trip;
    # a decode step has up to 160), added as one tree over the split axis (fixed for a given NSPLIT: deterministic)
    sp = tl.arange(0, SP)
    part_rows = part_ptr + (sp[None, :] * T + toks.to(tl.int64)[:, None]) * 32  # [BLOCK_T, SP]
    part_ok = tok_ok[:, None] & (sp < NSPLIT)[None, :]
    if (piece == 0) | (D_PIECES == 1):
        _mixes(part_rows, part_ok, tok_ok, toks, cols, pp_ok, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
               norm_eps, hc_eps, K, HC, NP, NC, ITERS, BLOCK_T)

    if COLLAPSE:
        ysq = tl.sum(tl.load(part_rows + NP + NC + 1, mask=part_ok, other=0.0), axis=1)
        dd = tl.arange(0, BLOCK_D)
        y_rows = y_ptr + toks.to(tl.int64)[:, None] * D
        if not DELAYED:  # V4: collapse with the pre just computed (the delayed case did it in the partial kernel)
            tl.debug_barrier()  # this program's `pre` stores above must land before they are read back
            ysq = tl.zeros([BLOCK_T], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + dd
                ok = tok_ok[:, None] & (d < D)[None, :]
                y = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
                for ci in tl.static_range(HC):
                    w = tl.load(pre_ptr + toks * HC + ci, mask=tok_ok, other=0.0)
                    hv = tl.load(h_ptr + toks[:, None].to(tl.int64) * K + ci * D + d[None, :], mask=ok, other=0.0)
                    y += w[:, None] * hv.to(tl.float32)
                y = y.to(y_ptr.dtype.element_ty)
                yf = y.to(tl.float32)
                ysq += tl.sum(yf * yf, axis=1)
                tl.store(y_rows + d[None, :], y, mask=ok)
            tl.debug_barrier()  # the normalisation reads rows other threads of this program wrote
        inv = 1.0 / tl.sqrt(ysq / D + norm_eps)
        if D_PIECES == 1:
            for d0 in range(0, D, BLOCK_D):
                _normalise(y_rows, norm_w_ptr, d0 + dd, tok_ok, inv, D, BLOCK_T, BLOCK_D, QBLOCK, QUANT)
        elif piece > 0:
            _normalise(y_rows, norm_w_ptr, (piece - 1) * BLOCK_D + dd, tok_ok, inv, D, BLOCK_T, BLOCK_D, QBLOCK,
                       QUANT)


@triton.jit
def _normalise(y_rows, norm_w_ptr, d, tok_ok, inv, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
               QBLOCK: tl.constexpr, QUANT: tl.constexpr):
    """The collapsed rows' columns d, normalised (and fake-quantized) in place."""
    ok = tok_ok[:, None] & (d < D)[None, :]
    yf = tl.load(y_rows + d[None, :], mask=ok, other=0.0).to(tl.float32)
    wn = tl.load(norm_w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    out = fake_quant_tile(wn[None, :] * (yf * inv[:, None]), BLOCK_T, BLOCK_D, QBLOCK, QUANT)
    tl.store(y_rows + d[None, :], out.to(y_rows.dtype.element_ty), mask=ok)


@triton.jit
def _mixes(part_rows, part_ok, tok_ok, toks, cols, pp_ok, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
           norm_eps, hc_eps, K: tl.constexpr, HC: tl.constexpr, NP: tl.constexpr, NC: tl.constexpr,
           ITERS: tl.constexpr, BLOCK_T: tl.constexpr):
    """pre, post and comb of the token block from its summed partials: sigmoids, then the Sinkhorn."""
    m_pp = tl.sum(tl.load(part_rows[:, :, None] + cols[None, None, :],
                          mask=part_ok[:, :, None] & pp_ok[None, None, :], other=0.0), axis=1)
    m_comb = tl.sum(tl.load(part_rows[:, :, None] + NP + cols[None, None, :], mask=part_ok[:, :, None], other=0.0),
                    axis=1)
    sumsq = tl.sum(tl.load(part_rows + NP + NC, mask=part_ok, other=0.0), axis=1)
    inv_rms = 1.0 / tl.sqrt(sumsq / K + norm_eps)
    m_comb = m_comb * inv_rms[:, None]
    m_pp = m_pp * inv_rms[:, None]

    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    # pre (cols 0..HC-1) and post (cols HC..2HC-1)
    z = m_pp * tl.where(cols < HC, s0, s1)[None, :] + tl.load(base_ptr + cols, mask=pp_ok, other=0.0)[None, :]
    sig = 1.0 / (1.0 + tl.exp(-z))
    pp = tl.where((cols < HC)[None, :], sig + hc_eps, 2.0 * sig)
    c_idx = tl.where(cols < HC, cols, cols - HC)
    tl.store(pre_ptr + toks[:, None] * HC + c_idx[None, :], pp, mask=tok_ok[:, None] & (cols < HC)[None, :])
    tl.store(post_ptr + toks[:, None] * HC + c_idx[None, :], pp,
             mask=tok_ok[:, None] & ((cols >= HC) & pp_ok)[None, :])

    # comb: row softmax + eps, column normalise, then (ITERS - 1) x (rows, columns)
    c = m_comb * s2 + tl.load(base_ptr + NP + cols)[None, :]
    c = tl.reshape(c, [BLOCK_T, HC, HC])
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + toks[:, None] * NC + cols[None, :], tl.reshape(c, [BLOCK_T, NC]), mask=tok_ok[:, None])


def fn_pieces(fn: torch.Tensor) -> torch.Tensor:
    """fn [NM, K] -> its bf16 pieces [3, K, 32] (hi, mid, lo; K-major, columns NM..31 zero) with hi + mid + lo = fn
    exactly: hi = bf16(fn), mid = bf16(fn - hi), lo = fn - hi - mid (both remainders exact in fp32, lo exact in
    bf16). The split-K pass loads them as the B operands of three bf16 MMAs."""
    f = fn.float()
    hi = f.bfloat16()
    rest = f - hi.float()
    mid = rest.bfloat16()
    lo = (rest - mid.float()).bfloat16()
    out = torch.zeros(3, f.shape[1], PART_COLS, dtype=torch.bfloat16, device=f.device)
    out[:, :, :f.shape[0]] = torch.stack((hi, mid, lo)).transpose(1, 2)
    return out


_PIECES: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(fn) -> (fn, its pieces), dropped with fn


def _pieces_of(fn: torch.Tensor) -> torch.Tensor:
    """fn_pieces(fn), computed once per weight tensor (all token blocks of every call then read the same pieces).
    Weights are not written in place, so the cache holds while the tensor lives. Not filled inside a CUDA graph
    capture (its kernels run only at replay); the engine's eager warm-up step fills it before."""
    hit = _PIECES.get(id(fn))
    if hit is not None and hit[0]() is fn:
        return hit[1]
    pieces = fn_pieces(fn)
    if not (fn.is_cuda and torch.cuda.is_current_stream_capturing()):
        key = id(fn)
        _PIECES[key] = (weakref.ref(fn, lambda _, key=key: _PIECES.pop(key, None)), pieces)
    return pieces


# The split-K pass's tiles at 4,096 tokens (the fastest of 35 configurations on the H200): 64-token blocks, D in 8
# chunks, 512 programs, one wave. The deterministic mode keeps them at every T: a row's sums (the chunks, and the
# MMA shape a token block gets) must not depend on the step's size.
INVARIANT_TILES = (64, 8)
# Few tokens: so many chunks that ~this many programs share the fn pieces' 3.9 MB (V4.1), which each token block
# reads whole; at T = 1 the 8 programs of the 4,096-token tiles walked 40 steps each (30 us per site on the H200).
SMALL_STEP_PROGRAMS = 160


def partial_tiles(T: int, D: int, block_k: int, invariant: bool) -> tuple[int, int]:
    """(block_t, split) of the split-K pass for T tokens: INVARIANT_TILES where `invariant` or where they already
    fill the GPU; else 16-token blocks up to 16 tokens (the smallest MMA tile), and chunks of a power of two of
    block_k steps, the fewest that make about SMALL_STEP_PROGRAMS programs (where that is more than INVARIANT_TILES'
    8 chunks; a small D keeps those). Powers of two: a handful of kernel builds serve every T (at V4.1: 2 steps
    up to 64 tokens, 4 to 128, 8 to 256, 16 to 512, 32 to 1,024), each compiled by the warm-up's power-of-two
    steps before serving."""
    block_t, split = INVARIANT_TILES
    steps = triton.cdiv(D, block_k)
    if invariant:
        return block_t, split
    if T <= 16:
        block_t = 16
    blocks = triton.cdiv(max(T, 1), block_t)
    chunks = triton.cdiv(steps, triton.next_power_of_2(triton.cdiv(steps * blocks, SMALL_STEP_PROGRAMS)))
    return (block_t, chunks) if chunks > split else INVARIANT_TILES


def finish_tiles(nsplit: int, invariant: bool) -> tuple[int, int]:
    """(finish_block_t, block_d) of the finishing pass: 8 tokens x 512 columns (the 4,096-token tiles, and the
    deterministic mode's at every T), or where many partials come (decode), fewer tokens per program so that their
    [tokens, splits, 16] tile stays ~4K values, and wider column steps (fewer round trips over D)."""
    if invariant:
        return 8, 512
    block_t = max(1, min(8, 256 // triton.next_power_of_2(nsplit)))
    return block_t, min(2048, 4096 // block_t)


def finish_pieces(token_blocks: int, D: int, block_d: int, delayed_collapse: bool, invariant: bool,
                  sms: int) -> int:
    """Programs per token block that normalise the collapsed rows beside the one computing the mixes (1: one
    program does both): where the token blocks alone leave most of the GPU idle (decode), V4.1's delayed collapse
    (its rows are ready before the mixes) normalises each block_d column step in its own program, so the step
    waits for the Sinkhorn or one column step, not both in turn. The values do not depend on it; the deterministic
    mode keeps 1."""
    if invariant or not delayed_collapse or token_blocks * 2 > sms:
        return 1
    return triton.cdiv(D, block_d)


def mhc_norm(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             norm_weight: torch.Tensor | None, *, pre_in: torch.Tensor | None, iters: int, hc_eps: float,
             norm_eps: float, quant: str | None = None, quant_block: int = 32, collapse: bool = True,
             block_t: int | None = None, block_k: int = 16, split: int | None = None, invariant: bool = False,
             num_warps: int = 4, num_stages: int = 3, finish_block_t: int | None = None, block_d: int | None = None,
             finish_warps: int = 4, precision: str = "tf32x3", layout: str = "side_by_side"):
    """h [T, hc, D] -> (y [T, D] = rms_norm(collapse(h, pre_in or pre)) in h.dtype (None when collapse=False),
    pre [T, hc], post [T, hc], comb [T, hc, hc] fp32). quant='fp8' fake-quantizes y in 1×quant_block blocks.
    Tiles: the partial kernel takes block_t tokens × one of `split` D chunks (block_k columns of every copy per
    step); the finishing kernel takes finish_block_t tokens and walks D in block_d columns. None: `partial_tiles`
    and `finish_tiles` pick them (by T unless `invariant`). block_k 16 and 3 stages were the fastest of 35
    configurations on the H200 at 4,096 tokens (4 programs per SM; docs/kernels.md). layout="copies" runs the
    split-K pass on one tile per copy (`_mhc_partial_copies_kernel`: bf16 streams only; fewer instructions, last
    bits of the mixes may move)."""
    T, HC, D = h.shape
    auto_block_t, auto_split = partial_tiles(T, D, block_k, invariant)
    block_t, split = block_t or auto_block_t, split or auto_split
    chunk = triton.cdiv(triton.cdiv(D, block_k), split) * block_k  # D columns per split, whole block_k steps
    nsplit = triton.cdiv(D, chunk)
    auto_finish_t, auto_block_d = finish_tiles(nsplit, invariant)
    finish_block_t, block_d = finish_block_t or auto_finish_t, block_d or auto_block_d
    if layout not in ("side_by_side", "copies"):
        raise ValueError(f"mhc_norm: layout {layout!r} is not 'side_by_side' or 'copies'")
    if layout == "copies" and h.dtype != torch.bfloat16:
        raise ValueError(f"mhc_norm: layout 'copies' takes a bf16 stream, not {h.dtype}")
    NM = (2 + HC) * HC
    assert HC * HC == 16, "the kernel's comb tile is 4x4"
    assert fn.shape == (NM, HC * D)
    h = h.contiguous()
    fn_in = fn  # the caller's weight tensor: the key of its cached pieces
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    dev = h.device
    pre = torch.empty(T, HC, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(T, HC, HC, dtype=torch.float32, device=dev)
    y = torch.empty(T, D, dtype=h.dtype, device=dev) if collapse else None
    if not fake_quant_enabled():
        quant = None
    if quant is not None:
        assert D % quant_block == 0 and block_d % quant_block == 0
    if not T:
        return y, pre, post, comb
    part = torch.empty(nsplit, T, PART_COLS, dtype=torch.float32, device=dev)
    delayed = pre_in is not None
    pre_in_t = pre_in.float().contiguous() if delayed else pre
    split_bf16 = h.dtype == torch.bfloat16
    pieces = _pieces_of(fn_in) if split_bf16 else fn
    op = tl.float32 if _INTERPRET else tl.bfloat16
    if layout == "copies":
        _mhc_partial_copies_kernel[(triton.cdiv(T, block_t), nsplit)](
            h, pieces, pre_in_t, part, y if collapse else h, T,
            D=D, HC=HC, NM=NM, CHUNK=chunk, BLOCK_T=block_t, BLOCK_K=block_k, COLLAPSE=collapse and delayed,
            OP=op, num_warps=num_warps, num_stages=num_stages)
    else:
        _mhc_partial_kernel[(triton.cdiv(T, block_t), nsplit)](
            h, fn, pieces, pre_in_t, part, y if collapse else h, T,
            D=D, HC=HC, NM=NM, CHUNK=chunk, BLOCK_T=block_t, BLOCK_K=block_k, COLLAPSE=collapse and delayed,
            SPLIT_BF16=split_bf16, OP=op, PRECISION=precision, num_warps=num_warps, num_stages=num_stages)
    token_blocks = triton.cdiv(T, finish_block_t)
    d_pieces = finish_pieces(token_blocks, D, block_d, delayed and collapse, invariant, sm_count(dev))
    _mhc_finish_kernel[(token_blocks, d_pieces + (d_pieces > 1))](
        h, part, scale, base, norm_weight if collapse else h, pre_in_t, pre, post, comb, y if collapse else h,
        T, norm_eps, hc_eps,
        D=D, HC=HC, ITERS=iters, NSPLIT=nsplit, SP=triton.next_power_of_2(nsplit), BLOCK_T=finish_block_t,
        BLOCK_D=block_d, DELAYED=delayed,
        COLLAPSE=collapse, QUANT=kind_code(quant), QBLOCK=quant_block, D_PIECES=d_pieces, num_warps=finish_warps)
    return y, pre, post, comb
