"""DSpark, V4.1's draft module (spec §2.7; the official `DSparkBlock` and `Transformer.forward_spec`), composed from
the model's ops.

The target model hands over its *features*: per token the mean over the hc copies of the inputs of the target
layers (after Engram), concatenated in layer order ([T, n·D], `Model.target_features`, taken during the forward).
Stage 0 projects them, `main_x = main_norm(main_proj(features))`, and every stage keeps a window ring of its own
keys of main_x, `kv_s(main_x)` at the token's position (ring slot pos % W): `write_rings`. Nothing else persists.

A draft after position p (`propose`): the block [anchor, noise × (k-1)] at positions p+1..p+k, embedded with the
model's table and copied to the hc streams (starting from copy 0, as layer 0 does), runs through the stages, each
a V4.1 block (delayed mHC pre, window-only attention over ring + block, the draft MoE). The last stage collapses
the streams, norms and applies the model's head to all k positions at once (`base_logits`); then, in order, the
Markov head adds head(embed(previous token)) to position i's logits and picks draft i from them (the previous
token: the anchor, then draft i-1). The confidence head reads [collapsed stream, Markov embedding] (fp32 logits).

    model.forward(batch, cache)                                 # also fills model.target_features
    write_rings(model.dspark, cfg, model.target_features, batch.positions, batch.slots[batch.seq_of], rings)
    draft = propose(model.dspark, cfg, model.embed, model.head, rings, anchor_ids, last_positions, slots)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mini.config import LayerPlan, ModelConfig
from mini.model.attn_layer import AttentionWeights, out_proj
from mini.ops import mhc
from mini.ops.dspark_attention import draft_attention
from mini.ops.greedy import add_argmax
from mini.ops.linear import QWeight, head_logits, linear, linears
from mini.ops.moe import MoEWeights, moe
from mini.ops.norm import rms_norm
from mini.ops.rope import apply_rope, layer_frequencies, norm_rope_quant, rope_table

WINDOW_KV_QUANT_BLOCK = 32  # V4.1's window KV fake quant (FP8 1x32, all dims): the rings hold such keys


@dataclass
class StageWeights:
    plan: LayerPlan  # window only, RoPE base rope_theta, no YaRN
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (fn, scale, base) fp32
    hc_ffn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    attn: AttentionWeights
    moe: MoEWeights


@dataclass
class DSparkWeights:
    main_proj: QWeight  # FP8 [D, n·D]
    main_norm: torch.Tensor
    stages: list[StageWeights]
    norm: torch.Tensor  # the last stage's final norm
    markov_embed: torch.Tensor  # [V, r] bf16
    markov_head: torch.Tensor  # [V, r]: logits bias = markov_embed[prev] @ markov_head^T (fp32; bf16 on CUDA, as the
    # model's head: head_logits' exact-product GEMM reads half the bytes, five times a draft step)
    confidence: torch.Tensor  # [1, D + r] fp32 (bf16 values)

    @classmethod
    def from_state(cls, state: dict, cfg: ModelConfig, device, dtype) -> "DSparkWeights":
        """From checkpoint tensors (`mtp.{s}.…`, already on `device` except the routed experts)."""
        def hc(p):
            return tuple(state[f"{p}_{part}"].float() for part in ("fn", "scale", "base"))

        stages = []
        for s, plan in enumerate(cfg.dspark_layers):
            p = f"mtp.{s}"
            stages.append(StageWeights(
                plan, state[f"{p}.attn_norm.weight"], state[f"{p}.ffn_norm.weight"], hc(f"{p}.hc_attn"),
                hc(f"{p}.hc_ffn"), AttentionWeights.from_state(state, f"{p}.attn", cfg, plan, dtype),
                MoEWeights.from_state(state, f"{p}.ffn", cfg.dspark_moe, plan.layer, device=device, consume=True)))
        last = f"mtp.{cfg.n_mtp_layers - 1}"
        markov_head = state[f"{last}.markov_head.head.weight"]
        lossless = markov_head.dtype == torch.bfloat16 and markov_head.is_cuda
        return cls(QWeight.from_state(state, "mtp.0.main_proj", cfg.fp8_block), state["mtp.0.main_norm.weight"],
                   stages, state[f"{last}.norm.weight"], state[f"{last}.markov_head.embed.weight"],
                   markov_head if lossless else markov_head.float(),
                   state[f"{last}.confidence_head.proj.weight"].float())


class DSparkRings:
    """Per-sequence draft state: one window ring per stage, [n_slots, W, head_dim] (keys of main_x)."""

    def __init__(self, cfg: ModelConfig, n_slots: int, device, dtype):
        self.rings = [torch.zeros(n_slots, cfg.window_size, cfg.head_dim, device=device, dtype=dtype)
                      for _ in range(cfg.n_mtp_layers)]


@dataclass
class Draft:
    """One draft per sequence: k positions (p+2..p+k+1 of the target, as tokens)."""
    ids: torch.Tensor  # [B, k] int64
    logits: torch.Tensor  # [B, k, V] fp32: base + Markov bias of the previous token
    confidence: torch.Tensor  # [B, k] fp32 logits (before any sigmoid)
    base_logits: torch.Tensor  # [B, k, V] fp32: head(norm(hidden)), independent of the drafts
    markov_embeds: torch.Tensor  # [B, k, r]
    hidden: torch.Tensor  # [B, k, D]: the last stage's collapsed stream (before the final norm)


def main_x(w: DSparkWeights, cfg: ModelConfig, features: torch.Tensor) -> torch.Tensor:
    """[T, n·D] target features -> [T, D]: what every stage's wkv turns into ring keys."""
    return rms_norm(linear(features, w.main_proj), w.main_norm, cfg.norm_eps)


def _stage_keys(x: torch.Tensor, attn: AttentionWeights, table: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A stage's window keys of its input rows: kv_norm(wkv(x)), RoPE, FP8 1x32 (the backbone's V4.1 window KV)."""
    return _keys_of(linear(x, attn.wkv), attn, table, cfg)


def _keys_of(kv: torch.Tensor, attn: AttentionWeights, table: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return norm_rope_quant(kv, table, attn.kv_norm, cfg.norm_eps, "fp8", WINDOW_KV_QUANT_BLOCK)


def write_rings(w: DSparkWeights, cfg: ModelConfig, features: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, rings: DSparkRings) -> None:
    """Write each row's keys into every stage's ring (slot pos % W of the row's sequence slot `slots` [T]). Rows a
    later row of the same sequence overwrites are not written (the official prefill seeds the ring with the last W
    positions), so a prefill chunk, a decode step or any mix of them writes the same rings. The keys of every row
    are computed, as the official prefill does: on the CPU a GEMM's row can round differently with the row count."""
    W = cfg.window_size
    last = torch.full((rings.rings[0].shape[0],), -1, dtype=positions.dtype, device=positions.device)
    last = last.scatter_reduce(0, slots, positions, "amax")
    keep = positions > last[slots] - W
    for keys, ring in zip(_ring_keys(w, cfg, features, positions), rings.rings):
        ring[slots[keep], positions[keep] % W] = keys[keep].to(ring.dtype)


def write_ring_rows(w: DSparkWeights, cfg: ModelConfig, features: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, rings: DSparkRings) -> None:
    """`write_rings` without its mask (a mask's index list syncs with the host): every row's keys go to slot
    pos % W of `slots`' ring, with device ops only, so a CUDA graph can hold it (mini.model.dspark_drafter's static
    draft step). The caller sends rows that must not land in a sequence's ring to a scratch slot, and no two other
    rows may share a ring entry (a static step's rows of one sequence are fewer than W)."""
    for keys, ring in zip(_ring_keys(w, cfg, features, positions), rings.rings):
        ring[slots, positions % cfg.window_size] = keys.to(ring.dtype)


def _ring_keys(w: DSparkWeights, cfg: ModelConfig, features: torch.Tensor, positions: torch.Tensor):
    """Each stage's ring keys of every row (one stage at a time)."""
    mx = main_x(w, cfg, features)
    table = rope_table(positions, layer_frequencies(cfg, cfg.dspark_layers[0]))
    return (_stage_keys(mx, st.attn, table, cfg) for st in w.stages)


def _attention(x, st: StageWeights, cfg: ModelConfig, table, ring, slots, n_ring) -> torch.Tensor:
    """x [B·k, D] (normed) -> [B·k, D]: queries and keys of the block, attention over ring + block, the grouped
    output projection. Writes nothing."""
    a, T, H, d = st.attn, x.shape[0], cfg.n_heads, cfg.head_dim
    B, k = slots.shape[0], T // slots.shape[0]
    q_latent, kv = linears(x, (a.wq_a, a.wkv))  # one GEMM on the fast path
    q = apply_rope(linear(rms_norm(q_latent, a.q_norm, cfg.norm_eps), a.wq_b).view(T, H, d), table)
    kv = _keys_of(kv, a, table, cfg)
    o = draft_attention(q.view(B, k, H, d), kv.view(B, k, d), ring, slots, n_ring, a.sink, d ** -0.5)
    o = apply_rope(o.view(T, H, d), table, inverse=True)  # V = K carries the keys' rotation
    return out_proj(o, a, cfg)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


@torch.inference_mode()
def propose(w: DSparkWeights, cfg: ModelConfig, embed: torch.Tensor, head: torch.Tensor, rings: DSparkRings,
            anchor_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            pick: Callable[[torch.Tensor], torch.Tensor] = greedy) -> Draft:
    """Drafts for B sequences whose rings hold positions ..p (`positions` [B] = p) and whose target just chose
    `anchor_ids` [B] (the token at p+1). `embed` / `head` are the model's. `pick` turns position i's logits
    [B, V] into draft i (greedy by default; the official code samples with its temperature)."""
    k, hc, eps, dtype = cfg.dspark_block_size, cfg.hc_mult, cfg.norm_eps, rings.rings[0].dtype
    B = anchor_ids.shape[0]
    block = torch.full((B, k), cfg.dspark_noise_id, dtype=torch.long, device=anchor_ids.device)
    block[:, 0] = anchor_ids
    pos = (positions[:, None] + 1 + torch.arange(k, device=positions.device)).flatten()
    table = rope_table(pos, layer_frequencies(cfg, cfg.dspark_layers[0]))
    n_ring = (positions + 1).clamp(max=cfg.window_size)
    h = embed[block.flatten()].to(dtype).unsqueeze(1).repeat(1, hc, 1)  # [B·k, hc, D]
    pre = torch.zeros(B * k, hc, device=h.device)
    pre[:, 0] = 1.0  # a one-hot pre-mix, as the backbone's layer 0
    opts = dict(hc_mult=hc, iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=eps)
    for st, ring in zip(w.stages, rings.rings):  # V4.1 blocks: each site collapses with the previous site's pre
        x, a_pre, a_post, a_comb = mhc.pre_norm(h, *st.hc_attn, st.attn_norm, pre, **opts)
        h = mhc.expand(_attention(x, st, cfg, table, ring, slots, n_ring), h, a_post, a_comb)
        x, pre, f_post, f_comb = mhc.pre_norm(h, *st.hc_ffn, st.ffn_norm, a_pre, **opts)
        h = mhc.expand(moe(x, st.moe, cfg.dspark_moe, st.plan), h, f_post, f_comb)
    hidden = mhc.collapse(h, pre)  # [B·k, D]
    base = head_logits(rms_norm(hidden, w.norm, eps), head).view(B, k, -1)
    logits, ids, embeds, prev = torch.empty_like(base), block.new_empty(B, k), [], anchor_ids
    for i in range(k):  # the Markov chain: each position's bias depends on the token picked before it
        e = w.markov_embed[prev]
        bias = head_logits(e, w.markov_head)
        if pick is greedy:  # the add and the pick in one pass on the fast path
            ids[:, i] = prev = add_argmax(base[:, i], bias, logits[:, i])
        else:
            ids[:, i] = prev = pick(torch.add(base[:, i], bias, out=logits[:, i]))
        embeds.append(e)
    markov = torch.stack(embeds, 1)  # [B, k, r]
    hidden = hidden.view(B, k, -1)
    confidence = torch.nn.functional.linear(torch.cat([hidden, markov.to(hidden.dtype)], -1).float(),
                                            w.confidence).squeeze(-1)
    return Draft(ids, logits, confidence, base, markov, hidden)
