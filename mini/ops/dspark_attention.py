"""DSpark's draft attention (spec §2.7; the official `DSparkAttention` decode branch): a draft block of k queries
attends to its stage's ring of projected target features and to the block's own k keys, without a causal mask
inside the block.

A draft made after position p was written reads ring slots 0..n-1 with n = min(W, p + 1), **in slot order** (the
official index list `arange(n)`, not the backbone decode's oldest-first list), then the k block keys: one list of
n + k entries per draft, the same for its k queries. The rings hold keys only of the target model's positions
(`kv(main_x)`), never draft keys, so nothing a draft computes is kept.

K = V (one latent), a per-head sink in the denominator, scale 1/sqrt(D): the arithmetic is the official
sparse-attention kernel's, as in `mini.ops.attention` (an online softmax over blocks of 64 list entries, so where the
block keys sit in the list fixes the rounding: right after the n ring entries, as the official list puts them).
There is no fast path yet: the engine captures the draft step in CUDA graphs (mini.model.dspark_drafter), the
place for one.
"""
from __future__ import annotations

import torch

from mini.ops.attention import _attend as official_online_softmax
from mini.ops.stages import staged


def draft_key_lists(block_kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, n_ring: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each draft's key list as (keys fp32 [B, W + k, D], valid [B, W + k]): ring slots 0..n_ring-1 of its slot,
    then its k block keys, then nothing (valid False)."""
    B, k, D = block_kv.shape
    W = ring.shape[1]
    j = torch.arange(W + k, device=block_kv.device)
    n = n_ring[:, None]
    from_ring = j < n
    from_block = (j >= n) & (j < n + k)
    ring_keys = ring[slots[:, None], j.clamp(max=W - 1)]  # [B, W + k, D]
    block_keys = block_kv.gather(1, (j - n).clamp(0, k - 1)[..., None].expand(B, W + k, D))
    keys = torch.where(from_ring[..., None], ring_keys.float(),
                       torch.where(from_block[..., None], block_keys.float(), 0.0))
    return keys, from_ring | from_block


@staged("attention.sparse_core")
def draft_attention(q: torch.Tensor, block_kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor,
                    n_ring: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, k, H, D] (the block's queries, RoPE'd at p+1..p+k), block_kv [B, k, D] (the block's keys, RoPE'd and
    fake-quantized), ring [n_slots, W, D] (one stage's ring), slots [B], n_ring [B] (ring slots holding keys:
    min(W, p + 1)), sink [H] fp32 -> o [B, k, H, D] in q.dtype (keys' rotation still on its tail)."""
    B, k, H, D = q.shape
    keys, valid = draft_key_lists(block_kv, ring, slots, n_ring)
    per_query = keys.repeat_interleave(k, dim=0), valid.repeat_interleave(k, dim=0)  # a draft's k queries share it
    o = official_online_softmax(q.reshape(B * k, H, D), *per_query, sink.float(), scale)
    return o.to(q.dtype).view(B, k, H, D)


def plain_draft_attention(q: torch.Tensor, block_kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor,
                          n_ring: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """The definition in one softmax (no blocks, P not rounded before P·V): what `draft_attention` computes up to
    the official kernel's roundings. The tests hold the two together."""
    B, k, H, D = q.shape
    keys, valid = draft_key_lists(block_kv, ring, slots, n_ring)
    logits = torch.einsum("bqhd,bnd->bqhn", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    sink_col = sink.float().view(1, 1, H, 1).expand(B, k, H, 1)
    p = torch.softmax(torch.cat([logits, sink_col], -1), -1)[..., :-1]  # the sink takes mass, gives no value
    return torch.einsum("bqhn,bnd->bqhd", p, keys).to(q.dtype)
