"""Sparse MLA attention that reads its keys by index straight from the cache pools (design.md step 4).

One query token attends to
* its sliding window: positions max(0, p-W+1)..p, read from the chunk's fresh KV `kv_new` (positions at or after
  the chunk start) or from the sequence's window ring (earlier positions, ring index = pos % W);
* up to K compressed groups (absolute group ids, -1 = none), read from the paged compressed pool through the
  block table: group g lives in row `block_table[seq, g // rows_per_block] * rows_per_block + g % rows_per_block`.
No concatenated key tensor is built. K = V (one shared latent, MQA), so a program holds BLOCK_H query heads of one
token and every key tile it loads serves all of them, for the scores and for PV.

With a RoPE table (`rope_out`), the output's last RD channels are rotated back by its conjugate before the store
(V = K carries the keys' rotation), as mini.ops.rope.apply_rope(inverse=True) does after the op: the fp32 rotation
of the dtype-rounded output, rounded again. That saves a pass over [T, H, D] per layer.

Numerics follow the official kernel (mini.ops.attention's reference): an online softmax over a query's key list in
blocks of BLOCK_N = 64 entries, the list in the reference's order (window entries, then the groups valid first;
`reference_window_rows`), so that the same keys share a block; fp32 scores and softmax statistics (running max
over the logits alone, from -1e30), P cast to the KV dtype (bf16) before PV, fp32 accumulator, and the per-head
sink logit (not scaled) added to the denominator at the end. exp is computed as exp2 with log2(e) folded into the
scale (last-ulp differences only).

The work is split over D (`d_split`, 2 by default where D >= 32): two programs per token and head tile, each
computing all the scores (QK as two dots over the halves of D chained through one accumulator: the same k16 MMA
chain as one dot) and accumulating half of the output's columns. With one program (d_split=1, the same bits) the
[64, 512] fp32 accumulator is 128 of a thread's 255 registers at 8 warps and ptxas spills ~2 KB per thread inside
the key loop on sm_90a (468 stores, 511 loads per iteration); the split build spills nothing. Measured on the H200
at 7298590 (tools/attn_sweep.py, phase attn_sweep, RoPE epilogue on): decode B=256 x 32K 0.522 -> 0.347 ms, B=64
0.270 -> 0.219, prefill 4,096 6.91 -> 4.30 ms; every output bit equal to d_split=1 there and in the gpu tests.

At decode the grid is small (2 programs per row at V4.1 width against 132 SMs), so the key list can be split too
(`k_split`, flash-decoding): S programs per (token, head tile, half) walk contiguous runs of whole blocks of the
query's list and store their unnormalised output and (max, sum) in fp32; `_combine_kernel` merges them by log-sum-exp
and ends as the one-program walk does (`_finish`). `split_pieces` chooses S from the grid (docs/kernels.md).
"""

import torch
import triton
import triton.language as tl

from mini.kernels.device_info import sm_count

_LOG2E = 1.4426950408889634
# The interpreter needs constant loop bounds; compiled kernels take the compressed key count at run time, so a
# growing top-k (early groups, V4's all-visible ratio-128 layers) does not recompile the kernel.
_INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)


def window_widths(seq_of: torch.Tensor, start_pos: torch.Tensor, W: int) -> torch.Tensor:
    """[B] int32: how many window entries each sequence's key lists hold in the official order: a chunk that starts
    its sequence lists min(its length, W) (the reference's prefill of that sequence), any other chunk W (its decode
    ring). Per sequence, so a sequence's lists (and the softmax blocks they fix) do not depend on the other
    sequences of the step. On the device, no sync (scatter_add, not bincount)."""
    lens = torch.zeros_like(start_pos).scatter_add_(0, seq_of, torch.ones_like(seq_of))
    return torch.where(start_pos == 0, lens.clamp(max=W), W).to(torch.int32)


@triton.jit
def _key_rows(j0, t, pos, seq, start, slot, first, width, kv_new_ptr, window_ptr, comp_ptr, btab_ptr, cidx_ptr,
              stride_win, stride_btab, stride_cidx, n_comp, rows_per_block,
              W: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Entries j0..j0+BLOCK_N-1 of token t's key list: [BLOCK_N] pointers to their rows (K = V) and which exist.
    Fresh rows of this chunk are contiguous in the flat batch, earlier window rows sit in the ring, groups are read
    through the block table."""
    j = j0 + tl.arange(0, BLOCK_N)
    in_window = j < width
    kpos = first + j
    win_ok = in_window & (kpos >= 0) & (kpos <= pos)
    fresh = kpos >= start
    win_row = tl.where(fresh, kv_new_ptr + tl.where(win_ok & fresh, t - (pos - kpos), 0).to(tl.int64) * D,
                       window_ptr + slot * stride_win + tl.where(win_ok, kpos % W, 0) * D)
    c = j - width
    g = tl.load(cidx_ptr + t * stride_cidx + c, mask=(c >= 0) & (c < n_comp), other=-1)
    comp_ok = g >= 0
    g = tl.where(comp_ok, g, 0)
    blk = tl.load(btab_ptr + seq * stride_btab + g // rows_per_block, mask=comp_ok, other=0)
    comp_row = comp_ptr + (blk.to(tl.int64) * rows_per_block + g % rows_per_block) * D
    return tl.where(in_window, win_row, comp_row), win_ok | comp_ok


@triton.jit
def _online_update(q, rowptr, key_ok, m_i, l_i, acc, scale_log2, D: tl.constexpr):
    """One key tile of the online softmax: q [BH, D], rowptr [BN] pointers to the key rows (K = V)."""
    d = tl.arange(0, D)
    k = tl.load(rowptr[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale_log2  # [BH, BN] fp32, in log2 units
    s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
    return m_new, l_i, acc


@triton.jit
def _online_update_half(q_lo, q_hi, rowptr, key_ok, m_i, l_i, acc, scale_log2, D: tl.constexpr, half):
    """_online_update for output columns half * D/2 .. (half + 1) * D/2 - 1 only (the d_split=2 build): the same
    scores, as two dots over the halves of D, the second accumulating onto the first (the same chain of k16 MMAs
    in increasing d as one dot over D), and PV with that half of the rows: acc [BH, D/2]."""
    d = tl.arange(0, D // 2)
    k_lo = tl.load(rowptr[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
    k_hi = tl.load(rowptr[:, None] + (D // 2 + d)[None, :], mask=key_ok[:, None], other=0.0)
    s = tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo))) * scale_log2  # [BH, BN] fp32, in log2 units
    s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if half == 0:
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lo.dtype), k_lo)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k_hi.dtype), k_hi)
    return m_new, l_i, acc


@triton.jit
def _unrotate(x, rope_ptr, t, ROWS: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, C0,
              COLS: tl.constexpr):
    """x [ROWS, COLS], columns C0..C0+COLS-1 of D-wide rows whose last RD channels, complex pairs (2i, 2i+1), are
    multiplied by the conjugate of token t's table row: fp32 math and result (the store rounds it, as
    ops.rope.apply_rope(inverse=True) does); the nope pairs see cos 1, sin 0.
    q is NOT rotated here the same way: a computed QK operand makes Triton keep q in registers through the key
    loop (wgmma register operand), which spills; see docs/kernels.md."""
    pair = C0 // 2 + tl.arange(0, COLS // 2)
    rot = pair >= (D - RD) // 2
    off = t.to(tl.int64) * RD + 2 * tl.where(rot, pair - (D - RD) // 2, 0)
    cos = tl.load(rope_ptr + off, mask=rot, other=1.0)[None, :]
    sin = tl.load(rope_ptr + off + 1, mask=rot, other=0.0)[None, :]
    re, im = tl.split(tl.reshape(x.to(tl.float32), [ROWS, COLS // 2, 2]))
    return tl.reshape(tl.join(re * cos + im * sin, im * cos - re * sin), [ROWS, COLS])


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_new_ptr, window_ptr, comp_ptr, sink_ptr, rope_ptr, out_ptr,
    pos_ptr, seq_ptr, slot_ptr, start_ptr, btab_ptr, cidx_ptr, width_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_win, stride_btab, stride_cidx,
    n_heads, n_comp, scale_log2, rows_per_block,
    W: tl.constexpr, N_COMP_TILES: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PREFILL_LISTS: tl.constexpr, D_SPLIT: tl.constexpr,
):
    # D_SPLIT = 2: program_id(2) says which half of the output's D columns this program accumulates (each computes
    # all the scores); with one program per tile `half` stays the constant 0, which leaves that build's code as it was
    half = 0
    if D_SPLIT != 1:
        half = tl.program_id(2)
    _attend(q_ptr, kv_new_ptr, window_ptr, comp_ptr, sink_ptr, rope_ptr, out_ptr,
            pos_ptr, seq_ptr, slot_ptr, start_ptr, btab_ptr, cidx_ptr, width_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_win, stride_btab, stride_cidx,
            n_heads, n_comp, scale_log2, rows_per_block,
            W, N_COMP_TILES, D, RD, BLOCK_H, BLOCK_N, PREFILL_LISTS, D_SPLIT, half,
            False, 0, 1, width_ptr, sink_ptr, sink_ptr)


@triton.jit
def _sparse_mla_split_kernel(
    q_ptr, kv_new_ptr, window_ptr, comp_ptr, sink_ptr, rope_ptr, out_ptr,
    pos_ptr, seq_ptr, slot_ptr, start_ptr, btab_ptr, cidx_ptr, width_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_win, stride_btab, stride_cidx,
    n_heads, n_comp, scale_log2, rows_per_block, nvalid_ptr, part_ptr, stat_ptr, n_pieces,
    W: tl.constexpr, N_COMP_TILES: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PREFILL_LISTS: tl.constexpr, D_SPLIT: tl.constexpr,
):
    # _sparse_mla_kernel's arguments (the output's are the combine's business) and the split's: each query's valid
    # group count, the fp32 partials; program_id(2) = piece * D_SPLIT + half
    half = 0
    if D_SPLIT != 1:
        half = tl.program_id(2) % D_SPLIT
    piece = tl.program_id(2) // D_SPLIT
    _attend(q_ptr, kv_new_ptr, window_ptr, comp_ptr, sink_ptr, rope_ptr, out_ptr,
            pos_ptr, seq_ptr, slot_ptr, start_ptr, btab_ptr, cidx_ptr, width_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_win, stride_btab, stride_cidx,
            n_heads, n_comp, scale_log2, rows_per_block,
            W, N_COMP_TILES, D, RD, BLOCK_H, BLOCK_N, PREFILL_LISTS, D_SPLIT, half,
            True, piece, n_pieces, nvalid_ptr, part_ptr, stat_ptr)


@triton.jit
def _piece_bounds(n_keys, piece, n_pieces, BLOCK_N: tl.constexpr):
    """Entries [lo, hi) of a key list of n_keys entries that piece `piece` of n_pieces walks: contiguous runs of
    whole BLOCK_N blocks, ceil(blocks / n_pieces) each (the last ones shorter or empty), so the online softmax's
    blocks are the one-program walk's and a piece depends on its query's list alone."""
    per = tl.cdiv(tl.cdiv(n_keys, BLOCK_N), n_pieces) * BLOCK_N
    lo = piece * per
    return lo, tl.minimum(lo + per, n_keys)


@triton.jit
def _store_partial(part_ptr, stat_ptr, acc, m_i, l_i, piece, t, heads, head_ok, n_heads, half,
                   D: tl.constexpr, DO: tl.constexpr):
    """A piece's unnormalised output columns (part [S, T, H, D] fp32) and its running max and sum (stat
    [S, T, H, 2] fp32; every half holds the same ones, the first stores them)."""
    row = (piece * tl.num_programs(0) + t).to(tl.int64) * n_heads + heads  # [BLOCK_H] rows of [S * T * H]
    d = tl.arange(0, DO)
    tl.store(part_ptr + row[:, None] * D + (half * DO + d)[None, :], acc, mask=head_ok[:, None])
    if half == 0:
        tl.store(stat_ptr + 2 * row, m_i, mask=head_ok)
        tl.store(stat_ptr + 2 * row + 1, l_i, mask=head_ok)


@triton.jit
def _combine_kernel(part_ptr, stat_ptr, sink_ptr, rope_ptr, out_ptr, stride_ot, stride_oh, n_heads,
                    N_PIECES: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """The split walk's end, one program per (token, head tile, BLOCK_D output columns): the pieces' partials
    merged in piece order by log-sum-exp (each scaled by exp2(m_s - M) from the largest running max M), then
    `_finish` as the one-program walk ends. With one piece every scale is exp2(0) = 1: the one-program bits."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < n_heads
    chunk = tl.program_id(2)
    cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    n_tok = tl.num_programs(0)
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    for s in range(N_PIECES):
        row = (s * n_tok + t).to(tl.int64) * n_heads + heads
        m = tl.maximum(m, tl.load(stat_ptr + 2 * row, mask=head_ok, other=-1.0e30))
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(N_PIECES):
        row = (s * n_tok + t).to(tl.int64) * n_heads + heads
        scale = tl.exp2(tl.load(stat_ptr + 2 * row, mask=head_ok, other=-1.0e30) - m)  # 0 for an empty piece
        l_i += tl.load(stat_ptr + 2 * row + 1, mask=head_ok, other=0.0) * scale
        acc += tl.load(part_ptr + row[:, None] * D + cols[None, :], mask=head_ok[:, None], other=0.0) * scale[:, None]
    _finish(acc, m, l_i, sink_ptr, rope_ptr, out_ptr, t, heads, head_ok, stride_ot, stride_oh, chunk,
            D, RD, BLOCK_H, BLOCK_D)


@triton.jit
def _attend(
    q_ptr, kv_new_ptr, window_ptr, comp_ptr, sink_ptr, rope_ptr, out_ptr,
    pos_ptr, seq_ptr, slot_ptr, start_ptr, btab_ptr, cidx_ptr, width_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_win, stride_btab, stride_cidx,
    n_heads, n_comp, scale_log2, rows_per_block,
    W: tl.constexpr, N_COMP_TILES: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PREFILL_LISTS: tl.constexpr, D_SPLIT: tl.constexpr, half,
    SPLIT_K: tl.constexpr, piece, n_pieces, nvalid_ptr, part_ptr, stat_ptr,
):
    """One program: BLOCK_H heads of token t, output columns half * D/D_SPLIT .. (half + 1) * D/D_SPLIT - 1
    (D_SPLIT 1 or 2; `half` is the constant 0 when D_SPLIT is 1, which leaves that build's code as it was).
    SPLIT_K: only piece `piece` of the n_pieces contiguous runs of whole BLOCK_N blocks of the query's key list
    (`_piece_bounds`), ending with the partial (acc, m, l) in fp32 (`_store_partial`) instead of the output."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < n_heads
    DO: tl.constexpr = D // D_SPLIT  # output columns of this program
    d = tl.arange(0, DO)
    q_rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    if D_SPLIT == 1:
        q = tl.load(q_rows + d[None, :], mask=head_ok[:, None], other=0.0)
    else:
        q_lo = tl.load(q_rows + d[None, :], mask=head_ok[:, None], other=0.0)
        q_hi = tl.load(q_rows + (DO + d)[None, :], mask=head_ok[:, None], other=0.0)

    pos = tl.load(pos_ptr + t)
    seq = tl.load(seq_ptr + t)
    start = tl.load(start_ptr + seq)
    slot = tl.load(slot_ptr + seq)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DO], tl.float32)

    # One walk over the query's key list in the official kernel's order, BLOCK_N entries per online-softmax step
    # (64: its blocks): `width` window entries, then the compressed groups, valid ones first in ascending order.
    # A chunk that starts its sequence lists its window from max(0, pos-W+1), oldest first (the reference's
    # prefill), any other chunk from pos-W+1 (its decode ring).
    width = tl.load(width_ptr + seq)
    if PREFILL_LISTS:
        first = tl.where(start == 0, tl.maximum(pos - W + 1, 0), pos - W + 1)
    else:
        first = pos - W + 1
    if SPLIT_K:
        lo, hi = _piece_bounds(width + tl.load(nvalid_ptr + t), piece, n_pieces, BLOCK_N)
    else:
        lo, hi = 0, width + n_comp
    if _INTERPRETED:
        end: tl.constexpr = W + N_COMP_TILES * BLOCK_N
        begin: tl.constexpr = 0
    else:
        begin, end = lo, hi
    for j0 in range(begin, end, BLOCK_N):
        rowptr, key_ok = _key_rows(j0, t, pos, seq, start, slot, first, width, kv_new_ptr, window_ptr, comp_ptr,
                                   btab_ptr, cidx_ptr, stride_win, stride_btab, stride_cidx, n_comp, rows_per_block,
                                   W, D, BLOCK_N)
        if SPLIT_K and _INTERPRETED:  # the constant walk visits every block: the other pieces' are no-ops
            key_ok = key_ok & (j0 >= lo) & (j0 < hi)
        if D_SPLIT == 1:
            m_i, l_i, acc = _online_update(q, rowptr, key_ok, m_i, l_i, acc, scale_log2, D)
        else:
            m_i, l_i, acc = _online_update_half(q_lo, q_hi, rowptr, key_ok, m_i, l_i, acc, scale_log2, D, half)

    if SPLIT_K:
        _store_partial(part_ptr, stat_ptr, acc, m_i, l_i, piece, t, heads, head_ok, n_heads, half, D, DO)
    else:
        _finish(acc, m_i, l_i, sink_ptr, rope_ptr, out_ptr, t, heads, head_ok, stride_ot, stride_oh, half,
                D, RD, BLOCK_H, DO)


@triton.jit
def _finish(acc, m_i, l_i, sink_ptr, rope_ptr, out_ptr, t, heads, head_ok, stride_ot, stride_oh, half,
            D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr, DO: tl.constexpr):
    """The softmax's end for one query's whole key list: the per-head sink logit in the denominator, the division,
    the RoPE-unrotate epilogue and the store of output columns half * DO .. half * DO + DO - 1 (acc holds those)."""
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0)
    l_i = l_i + tl.exp2(sink * 1.4426950408889634 - m_i)
    out = acc / l_i[:, None]
    if RD > 0:  # rotate back by the conjugate, from the output rounded to its dtype as the unfused op stores it
        out = _unrotate(out.to(out_ptr.dtype.element_ty), rope_ptr, t, BLOCK_H, D, RD, half * DO, DO)
    d = tl.arange(0, DO)
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + (half * DO + d)[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def supported(head_dim: int) -> bool:
    """Whether the kernel takes this head width: a tile dimension (a power of two, at least a dot's 16). Windows,
    head counts, top-k widths and RoPE widths are any (masked tiles)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def sparse_mla_attention(q: torch.Tensor, kv_new: torch.Tensor, window: torch.Tensor, sink: torch.Tensor,
                         positions: torch.Tensor, seq_of: torch.Tensor, slots: torch.Tensor,
                         start_pos: torch.Tensor, scale: float,
                         comp: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                         comp_idx: torch.Tensor | None = None, ratio: int = 1,
                         rope_out: torch.Tensor | None = None, prefill_lists: bool = True,
                         block_h: int = 64, block_n: int = 64, num_warps: int = 8, num_stages: int = 2,
                         d_split: int | None = None, k_split: int | None = None,
                         width: torch.Tensor | None = None, comp_valid: torch.Tensor | None = None,
                         rows_per_seq: int = 1) -> torch.Tensor:
    """q [T, H, D], kv_new [T, D] (this step's window KV), window ring [n_slots, W, D], sink [H] fp32,
    positions/seq_of [T], slots/start_pos [B]; optional paged compressed pool comp [n_blocks, rows_per_block, D]
    with block_table [B, nb] and comp_idx [T, K] absolute group ids (-1 = none); optional RoPE table rope_out
    complex64 [T, RD/2] that the output is rotated back by. Returns [T, H, D] in q.dtype. The signature is
    mini.ops.attention.sparse_attention's (`ratio` is not needed to address the pool). `prefill_lists=False`: every
    query's window list is W wide in the decode ring's order (the deterministic mode's chunk-invariant lists).
    `d_split`: programs per (token, head tile), each computing all the scores and accumulating 1/d_split of the
    output's D columns: 2 (None: 2 where D >= 32, else 1) or 1; the same sums either way (`_online_update_half`).
    `k_split`: pieces each query's key list is walked in (split-K, `split_pieces`): 1 is the one-program walk; S > 1
    walks contiguous runs of whole blocks in S programs and merges them in `_combine_kernel` (not the one-program
    bits: each piece's P is rounded against its own running max). None: for decode steps (one token per sequence)
    with the official lists, chosen by the grid's size (`split_pieces`: 10 pieces at B = 1, 4 at B = 16, 1 from
    B = 33 on the H200), and so for static verify steps (`rows_per_seq` = 1 + k rows per sequence, T = B ·
    rows_per_seq: B = 1 x 6 rows takes 10 pieces); otherwise 1: an eager step with prefill chunks or drafts
    keeps one program (the warm-up compiles its kernels by shape class, not by step size), and so do the
    deterministic mode's lists
    (`prefill_lists=False`), whose point is that a row does not depend on the rest of the step (any fixed k_split
    keeps that: a piece depends on its query's list alone). Measured in rank4's decode graphs on the H200, A/B
    interleaved (docs/perf/014): B = 1 x 4K 18.31 -> 16.64 ms/step, B = 16 24.66 -> 23.74; the verify step at
    B = 1 x 6 rows in docs/perf/024."""
    T, H, D = q.shape
    W = window.shape[1]
    if not supported(D):
        raise ValueError(f"sparse_mla_attention: head dim {D} is not a power of two >= 16")
    if d_split is None:
        d_split = 2 if D >= 32 else 1  # a dot's K is at least 16
    if d_split not in (1, 2) or D // d_split < 16:
        raise ValueError(f"sparse_mla_attention: d_split {d_split} (1 or 2, with D / d_split >= 16; D = {D})")
    q, kv_new = q.contiguous(), kv_new.contiguous()
    assert kv_new.shape == (T, D) and window.shape[2] == D and window.stride(-1) == 1 and window.stride(1) == D
    out = torch.empty_like(q)
    if T == 0:
        return out
    if comp_idx is None:  # window-only layer: no compressed entries
        comp, block_table = kv_new, start_pos
        comp_idx = torch.empty((T, 0), dtype=torch.int32, device=q.device)
        rows_per_block = 1
    else:
        assert comp.shape[-1] == D and comp.is_contiguous()
        # the reference lists a query's groups valid first, ascending (top-k ids come ascending with -1 first);
        # `comp_valid` given: comp_idx is in that order already and holds this many valid ids per query (an index
        # source's top-k, ordered once for the layers that read it: mini.ops.indexer.ordered_ids)
        if comp_valid is None:
            comp_idx = comp_idx.gather(-1, torch.sort((comp_idx < 0).to(torch.int8), dim=-1, stable=True).indices)
        rows_per_block = comp.shape[1]
    # window entries of each sequence's key lists (mini.ops.attention.window_widths): per sequence, no sync
    # (`width`: the step's window_widths, which its layers share: built once per step, issue 28)
    if not prefill_lists:
        width = start_pos.new_full(start_pos.shape, W, dtype=torch.int32)
    elif width is None:
        width = window_widths(seq_of, start_pos, W)
    rope = None
    if rope_out is not None:
        assert rope_out.shape[0] == T and 2 * rope_out.shape[1] <= D
        rope = torch.view_as_real(rope_out.to(torch.complex64)).contiguous()  # [T, RD/2, 2]: cos, sin
    block_h = max(16, min(block_h, triton.next_power_of_2(H)))  # a dot needs at least 16 rows
    grid = (T, triton.cdiv(H, block_h), d_split)
    if k_split is None:  # decode steps (one token per sequence: the CUDA-graph steps) and static verify steps
        decode = T == start_pos.shape[0] * rows_per_seq  # with the official lists
        k_split = split_pieces(T * grid[1] * d_split, triton.cdiv(W + comp_idx.shape[1], block_n),
                               sm_count(q.device)) if prefill_lists and decode else 1
    if not isinstance(k_split, int) or k_split < 1:
        raise ValueError(f"sparse_mla_attention: k_split {k_split!r} (a positive int or None)")
    rd = 0 if rope is None else 2 * rope.shape[1]
    args = (q, kv_new, window, comp, sink, rope if rope is not None else sink, out,
            positions, seq_of, slots, start_pos, block_table, comp_idx, width,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), window.stride(0), block_table.stride(0),
            comp_idx.stride(0),
            H, comp_idx.shape[1], scale * _LOG2E, rows_per_block)
    consts = dict(W=W, N_COMP_TILES=triton.cdiv(comp_idx.shape[1], block_n) if _INTERPRETED else 0, D=D, RD=rd,
                  BLOCK_H=block_h, BLOCK_N=block_n, PREFILL_LISTS=prefill_lists, D_SPLIT=d_split,
                  num_warps=num_warps, num_stages=num_stages)
    if k_split == 1:
        _sparse_mla_kernel[grid](*args, **consts)
        return out
    # the split walk: pieces of each query's list (its window width + its valid groups, which come first), partials
    # in fp32 scratch, then the combine (merge, sink, division, RoPE epilogue, store) over 64-column chunks, so that
    # even B = 1 reads the partials with several programs
    n_valid = (comp_idx >= 0).sum(-1, dtype=torch.int32) if comp_valid is None else comp_valid  # [T], no sync
    part = torch.empty((k_split, T, H, D), dtype=torch.float32, device=q.device)
    stat = torch.empty((k_split, T, H, 2), dtype=torch.float32, device=q.device)
    _sparse_mla_split_kernel[(T, grid[1], k_split * d_split)](*args, n_valid, part, stat, k_split,
                                                              **dict(consts, RD=0))  # (the combine's)
    block_d = min(D, 64)
    _combine_kernel[(T, grid[1], D // block_d)](
        part, stat, sink, args[5], out, out.stride(0), out.stride(1), H,
        N_PIECES=k_split, D=D, RD=rd, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return out


def split_pieces(programs: int, max_blocks: int, sms: int) -> int:
    """Pieces per key list for a grid of `programs` one-program walks of up to `max_blocks` blocks each: 1 where
    the grid fills at least half the SMs; else as many as keep the split grid within one wave (every program
    resident at once: about one per SM at 8 warps and ~190 KB of shared memory), no more than the blocks, and no
    more than those blocks need (10 blocks in 4 pieces of 3, not 5 of 2 and 3 empty-ended)."""
    if 2 * programs > sms:
        return 1
    pieces = max(1, min(max_blocks, sms // programs))
    return triton.cdiv(max_blocks, triton.cdiv(max_blocks, pieces))
