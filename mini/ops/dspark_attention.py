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
On the fast path (bf16 on CUDA, V4.1-Flash's 64 heads x 512, MINI_SPARSE_ATTN allowing FlashMLA) the op runs
FlashMLA's sparse prefill kernel over each draft's list (`draft_kernel` says when): the B sequences' ring rows and
the block keys laid out as one key tensor, each query's list in the official order, built with device ops only so
that the draft step's CUDA graph holds it. The kernel walks a list in blocks of 64 entries as the official kernel
does, with P rounded to bf16 before P·V: `mini.ops.attention`'s FlashMLA arithmetic, one CTA per (query, 64 heads),
so a draft's result does not depend on the batch it runs in. The reference's torch ops (fp32 GEMMs and ~55
elementwise kernels per stage) were the draft step's largest part after its experts (tools/draft_census.py,
docs/perf/027).
"""
from __future__ import annotations

import torch

from mini.kernels import flashmla_attention as flashmla
from mini.ops import backends, deterministic, use_fast
from mini.ops.attention import _attend as official_online_softmax
from mini.ops.attention import det_sparse_attn, settle_by_first_call
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


def draft_kernel(q: torch.Tensor, block_kv: torch.Tensor, ring: torch.Tensor) -> str:
    """Which kernel computes a draft's attention: "flashmla" where FlashMLA's kernel takes it (the fast path on
    CUDA, bf16, its head count and width) and MINI_SPARSE_ATTN settled on the library; "flashmla-checked" while
    auto has not settled it (outside a capture: the first call compares the library with the reference, as the
    backbone's first FlashMLA call does, and settles the switch); else "reference". In the deterministic mode only
    where MINI_DET_SPARSE_ATTN keeps FlashMLA (one CTA per query: nothing depends on the batch)."""
    if not (use_fast(q) and flashmla.takes_model(q.flatten(0, 1), [block_kv, ring])):
        return "reference"
    if deterministic() and det_sparse_attn() != "flashmla":
        return "reference"
    library = backends.sparse_attn()
    if library == "auto-flashmla" and not torch.cuda.is_current_stream_capturing():
        return "flashmla-checked"
    return "flashmla" if library == "flashmla" else "reference"


def draft_key_rows(block_kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, n_ring: torch.Tensor,
                   width_multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`draft_key_lists` as rows of one key tensor, the form FlashMLA reads: (keys [B·W + B·k, D], the B
    sequences' rings then the block keys; rows [B·k, n] int32, the list of each of a draft's k queries, n = W + k
    rounded up to `width_multiple`, -1 past its end; count [B·k] int32, the list's length n_ring + k). Device ops
    only: no sync, so a CUDA graph can hold it."""
    B, k, D = block_kv.shape
    W = ring.shape[1]
    keys = torch.cat([ring.index_select(0, slots).reshape(B * W, D), block_kv.reshape(B * k, D)])
    j = torch.arange(-(-(W + k) // width_multiple) * width_multiple, device=ring.device)
    b, n = torch.arange(B, device=ring.device)[:, None], n_ring[:, None]
    rows = torch.where(j < n, b * W + j, torch.where(j < n + k, B * W + b * k + j - n, -1))
    return keys, rows.repeat_interleave(k, dim=0).int(), (n_ring + k).repeat_interleave(k).int()


@staged("attention.sparse_core")
def draft_attention(q: torch.Tensor, block_kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor,
                    n_ring: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, k, H, D] (the block's queries, RoPE'd at p+1..p+k), block_kv [B, k, D] (the block's keys, RoPE'd and
    fake-quantized), ring [n_slots, W, D] (one stage's ring), slots [B], n_ring [B] (ring slots holding keys:
    min(W, p + 1)), sink [H] fp32 -> o [B, k, H, D] in q.dtype (keys' rotation still on its tail)."""
    args = (q, block_kv, ring, slots, n_ring, sink, scale)
    kernel = draft_kernel(q, block_kv, ring)
    if kernel == "flashmla":
        return _flashmla(*args)
    if kernel == "flashmla-checked":
        return settle_by_first_call(lambda: _reference(*args), lambda: _flashmla(*args), " (DSpark's draft attention)")
    return _reference(*args)


def _reference(q, block_kv, ring, slots, n_ring, sink, scale) -> torch.Tensor:
    B, k, H, D = q.shape
    keys, valid = draft_key_lists(block_kv, ring, slots, n_ring)
    per_query = keys.repeat_interleave(k, dim=0), valid.repeat_interleave(k, dim=0)  # a draft's k queries share it
    o = official_online_softmax(q.reshape(B * k, H, D), *per_query, sink.float(), scale)
    return o.to(q.dtype).view(B, k, H, D)


def _flashmla(q, block_kv, ring, slots, n_ring, sink, scale) -> torch.Tensor:
    B, k, H, D = q.shape
    keys, rows, count = draft_key_rows(block_kv, ring, slots, n_ring, flashmla.TOPK_MULTIPLE)
    return flashmla.sparse_prefill(q.reshape(B * k, H, D), keys, rows, count, sink, scale).view(B, k, H, D)


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
