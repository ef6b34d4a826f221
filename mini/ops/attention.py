"""Sparse MQA attention with a sink (spec §2.4.6), reading its keys by index from the cache pools (design.md step 4).

A query at position p of sequence b attends to
* its window, positions max(0, p-W+1)..p: rows of the chunk's fresh `kv_new` for positions at or after the chunk
  start, otherwise ring row `pos % W` of the sequence's slot in `window`;
* compressed groups `comp_idx` (absolute group ids, -1 = none) of the paged pool `comp`: group g lives in row
  `block_table[b, g // rows_per_block] * rows_per_block + g % rows_per_block`.
K = V (one latent). o[t,h] = Σ_n softmax_n(q[t,h]·k_n · scale) k_n, the denominator also holding exp(sink[h]).
With a RoPE table `rope_out`, o's tail is rotated back by its conjugate (V = K carries the keys' rotation): the
kernel does it in its epilogue instead of one more pass over [T, H, D].
Logits and softmax statistics are fp32; the probabilities are rounded to the activation dtype before P·V, as in
the reference kernel. `mini.kernels.sparse_attention` implements the same signature on the GPU.
"""
from __future__ import annotations

import torch

from mini.ops import use_fast
from mini.ops.rope import apply_rope

GATHER_ELEMENTS = 1 << 25  # the reference gathers the keys of a block of queries at once: at most this many values


def window_rows(positions, seq_of, slots, start_pos, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, W] rows of kv_new and [T, W] flat rows of the rings holding each query's window (-1 = elsewhere/none)."""
    k = torch.arange(W, device=positions.device)
    key_pos = positions[:, None] - (W - 1) + k
    fresh = key_pos >= start_pos[seq_of][:, None]
    valid = key_pos >= 0
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None] - (W - 1) + k
    new = torch.where(valid & fresh, rows, -1)
    ring = torch.where(valid & ~fresh, slots[seq_of][:, None] * W + key_pos % W, -1)
    return new, ring


def group_rows(group_ids, seq, block_table, rows_per_block: int) -> torch.Tensor:
    """Flat pool rows of absolute group ids (any shape, -1 kept), seq broadcasting against them."""
    g = group_ids.clamp_min(0)
    rows = block_table[seq, g // rows_per_block].long() * rows_per_block + g % rows_per_block
    return torch.where(group_ids >= 0, rows, -1)


def _attend(q, keys, valid, sink, scale):
    logits = torch.einsum("thd,tnd->thn", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    peak = torch.maximum(logits.amax(-1), sink[None, :])  # [t, H]
    p = torch.exp(logits - peak[..., None])
    denom = p.sum(-1) + torch.exp(sink[None, :] - peak)
    return torch.einsum("thn,tnd->thd", p.to(q.dtype).float(), keys) / denom[..., None]


def sparse_attention(q: torch.Tensor, kv_new: torch.Tensor, window: torch.Tensor, sink: torch.Tensor,
                     positions: torch.Tensor, seq_of: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
                     scale: float, comp: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     comp_idx: torch.Tensor | None = None, ratio: int = 1,
                     rope_out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], kv_new [T, D], window [n_slots, W, D], sink [H] fp32, positions/seq_of [T], slots/start_pos
    [B]; optional comp [n_blocks, rows_per_block, D] with block_table [B, nb] and comp_idx [T, K] group ids;
    optional rope_out table complex64 [T, rd/2] (apply_rope(inverse=True) of the output).
    Returns [T, H, D] in q.dtype. (`ratio` only matters to kernels that address blocks by token position.)"""
    if use_fast(q) and q.dtype == torch.bfloat16:
        from mini.kernels.sparse_attention import sparse_mla_attention
        return sparse_mla_attention(q, kv_new, window, sink, positions, seq_of, slots, start_pos, scale, comp,
                                    block_table, comp_idx, ratio, rope_out)
    T, W, D = q.shape[0], window.shape[1], q.shape[-1]
    new_rows, ring_rows = window_rows(positions, seq_of, slots, start_pos, W)
    sources = [(kv_new, new_rows), (window.view(-1, D), ring_rows)]
    if comp_idx is not None and comp_idx.shape[-1]:
        sources.append((comp.view(-1, D), group_rows(comp_idx, seq_of[:, None], block_table, comp.shape[1])))
    out = torch.empty_like(q)
    step = max(1, GATHER_ELEMENTS // (sum(rows.shape[1] for _, rows in sources) * D))
    for lo in range(0, T, step):
        hi = min(lo + step, T)
        valid = torch.cat([rows[lo:hi] >= 0 for _, rows in sources], dim=1)
        keys = torch.cat([src[rows[lo:hi].clamp_min(0)] for src, rows in sources], dim=1).float()
        keys = keys.masked_fill(~valid[..., None], 0.0)  # unread slots may hold anything, NaN included
        out[lo:hi] = _attend(q[lo:hi], keys, valid, sink.float(), scale).to(q.dtype)
    return out if rope_out is None else apply_rope(out, rope_out, inverse=True)
