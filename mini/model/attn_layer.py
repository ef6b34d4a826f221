"""One attention sub-layer (spec §2.4): projections, the KV sources' compressor and index keys, the indexer, sparse
attention over window ring + fresh chunk + compressed pool, and the grouped output projection.

`StepShared` carries what one forward's layers share (never across steps): the step's plan of what runs, the top-k
group ids each index source publishes (ordered for the attention kernel once, not in every layer reading them) and
V4.1's candidate mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mini.config import LayerPlan, ModelConfig
from mini.formats import fake_quant_fp8
from mini.model.cache import KVCache
from mini.model.layout import StepLayout
from mini.ops import indexer as indexer_op
from mini.ops.attention import sparse_attention
from mini.ops.compressor import CompressorWeights, compress
from mini.ops.indexer import index_scores, ordered_ids, quantize_index, select_candidates, top_groups_ordered
from mini.ops.linear import QWeight, grouped_linear, linear, linears
from mini.ops.norm import rms_norm
from mini.ops.rope import apply_rope, layer_frequencies, norm_rope_quant, rope_table
from mini.ops.stages import staged
from mini.ops.step_plan import StepPlan


@dataclass
class StepShared:
    """What the layers of one forward share: the step's plan (mini.ops.step_plan: which kernels run), and what index
    sources publish to the layers after them."""
    step: StepPlan
    # index source layer -> ([T, k] group ids, -1 = none, valid ones first; [T] int32 their count): ordered_ids
    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    candidates: torch.Tensor | None = None  # V4.1's candidate source: [T, N] bool, the groups later sources score


@dataclass
class IndexerWeights:
    wq_b: QWeight
    weights_proj: torch.Tensor  # [index_heads, D]
    wk: torch.Tensor | None  # [index_head_dim, head_dim] (V4.1 key owners)
    k_norm: torch.Tensor | None
    compressor: CompressorWeights | None  # V4: the indexer pools its own keys


@dataclass
class AttentionWeights:
    sink: torch.Tensor  # [H] fp32
    wq_a: QWeight
    q_norm: torch.Tensor
    wq_b: QWeight
    wkv: QWeight
    kv_norm: torch.Tensor
    wo_a: torch.Tensor  # [groups, o_lora_rank, heads_per_group * head_dim], bf16 values
    wo_b: QWeight
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None
    wo_a_fp8: QWeight | None = None  # wo_a as the checkpoint stores it (FP8): the one-row GEMV reads these bytes

    @classmethod
    def from_state(cls, state: dict, prefix: str, cfg: ModelConfig, plan: LayerPlan, dtype) -> "AttentionWeights":
        B = cfg.fp8_block

        def q(name):
            return QWeight.from_state(state, f"{prefix}.{name}", B)

        wo_a, wo_a_fp8 = state[f"{prefix}.wo_a.weight"], None
        if wo_a.dtype == torch.float8_e4m3fn:  # convert.py's dequantisation, done at load (the bytes kept too)
            wo_a_fp8 = q("wo_a")
            wo_a = wo_a_fp8.dequantize(torch.bfloat16)
        comp = idx = None
        if plan.owns_kv:
            comp = CompressorWeights.from_state(state, f"{prefix}.compressor", plan.ratio,
                                                not cfg.is_v41 and plan.ratio == 4, dtype)
        if plan.runs_indexer:
            p = f"{prefix}.indexer"
            idx = IndexerWeights(
                QWeight.from_state(state, f"{p}.wq_b", B), state[f"{p}.weights_proj.weight"],
                state.get(f"{p}.wk.weight"), state.get(f"{p}.k_norm.weight"),
                CompressorWeights.from_state(state, f"{p}.compressor", plan.ratio, True, dtype)
                if not cfg.is_v41 else None)
        return cls(state[f"{prefix}.attn_sink"].float(), q("wq_a"), state[f"{prefix}.q_norm.weight"], q("wq_b"),
                   q("wkv"), state[f"{prefix}.kv_norm.weight"],
                   wo_a.to(dtype).view(cfg.o_groups, cfg.o_lora_rank, -1), q("wo_b"), comp, idx, wo_a_fp8)


def _window_kv(kv: torch.Tensor, table: torch.Tensor, norm: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """kv_norm, RoPE and the window KV's fake quant of the projected latent."""
    if cfg.is_v41:  # FP8 1x32 over all dims, RoPE tail included: one fused op
        return norm_rope_quant(kv, table, norm, cfg.norm_eps, "fp8", 32)
    return _quant_v4_kv(norm_rope_quant(kv, table, norm, cfg.norm_eps), cfg)


def _quant_v4_kv(kv: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    rd = cfg.rope_head_dim  # V4 (window and compressed KV): FP8 1x64 on the nope dims only
    return torch.cat([fake_quant_fp8(kv[:, :-rd], 64), kv[:, -rd:]], dim=-1)


def _rope_compressed_kv(latent: torch.Tensor, table: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    if cfg.is_v41:  # FP4 1x16 with e4m3 scales, fused with the rotation
        return norm_rope_quant(latent, table, quant="fp4_e4m3", quant_block=16)
    return _quant_v4_kv(apply_rope(latent, table), cfg)


def _rope_index(x: torch.Tensor, table: torch.Tensor, cfg: ModelConfig, norm: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Index q ([T, H, di]) or keys ([G, di], with k_norm): (norm,) RoPE, (V4: Hadamard,) FP4 1x32 ue8m0."""
    if cfg.is_v41:
        return norm_rope_quant(x, table, norm, cfg.norm_eps, "fp4_ue8m0", 32)
    if norm is not None:
        x = rms_norm(x, norm, cfg.norm_eps)
    return quantize_index(apply_rope(x, table), rotate=True)


def _compress_into_pools(x, w: AttentionWeights, plan: LayerPlan, cfg: ModelConfig, lay: StepLayout,
                         cache: KVCache):
    """KV sources: pool the completed groups, derive their index keys (V4.1, from the pre-RoPE latent; V4 from the
    indexer's own compressor), then rotate at j·ratio, quantize and write both paged pools."""
    l, eps, pos = plan.layer, cfg.norm_eps, lay.batch.positions
    groups = lay.groups(plan.ratio, w.compressor.overlap)
    freqs = layer_frequencies(cfg, plan)  # the groups' table: the same for the step's sources of one ratio
    table = lay.table(("group_rope", plan.ratio, w.compressor.overlap, plan.rope_base, plan.yarn),
                      lambda: rope_table(groups.pos, freqs))
    drafts = lay.draft_rows  # a verify step keeps its draft rows' state writes (mini.model.drafts)

    def keep(pool: str, comp):
        return drafts.keeper(pool, l, comp.ratio, comp.overlap) if drafts is not None and comp.ratio > 1 else None

    latent = compress(x, w.compressor, pos, groups, *cache.comp_state.get(l, (None, None)), eps,
                      keep("comp_state", w.compressor))
    if plan.owns_index_keys:
        if cfg.is_v41:
            keys = _rope_index(F.linear(latent, w.indexer.wk.to(latent.dtype)), table, cfg, w.indexer.k_norm)
        else:
            keys = _rope_index(compress(x, w.indexer.compressor, pos, groups, *cache.index_state[l], eps,
                                        keep("index_state", w.indexer.compressor)), table, cfg)
        pool = cache.index_k[l]
        pool.view(-1, pool.shape[-1])[groups.pool_row] = keys.to(pool.dtype)
    latent = _rope_compressed_kv(latent, table, cfg)
    pool = cache.comp_kv[l]
    pool.view(-1, pool.shape[-1])[groups.pool_row] = latent.to(pool.dtype)


@staged("attention.indexer_topk")
def _index(x, index_q, w: IndexerWeights, plan: LayerPlan, cfg: ModelConfig, lay: StepLayout, cache: KVCache,
           table: torch.Tensor, shared: StepShared) -> tuple[torch.Tensor, torch.Tensor]:
    """This index source's top-k group ids [T, k] (-1 = none) in the order attention reads them (`ordered_ids`:
    the valid ones first) and [T] int32 their count; V4.1's candidate source also publishes its blocks. `index_q`:
    the query latent's projection by the indexer's wq_b (computed beside the attention's own wq_b)."""
    T, H, di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
    rows = lay.seq_rows(plan.ratio)
    if rows.shape[1] == 0:
        return ordered_ids(torch.empty(T, 0, dtype=torch.int64, device=x.device))
    q = _rope_index(index_q.view(T, H, di), table, cfg)
    weights = F.linear(x, w.weights_proj.to(x.dtype)) * (di ** -0.5 * H ** -0.5)
    keys = cache.index_k[plan.index_key_layer]
    n_vis = lay.n_visible(plan.ratio)
    scores = index_scores(q, weights, keys.view(-1, di), rows, lay.batch.seq_of, n_vis, lay.table,
                          shared.candidates if plan.uses_candidates else None)
    widths = indexer_op.tie_widths(scores, lay.tok_end, plan.ratio, shared.step)  # the step's tie rule
    if plan.candidate_source:
        shared.candidates = select_candidates(scores, n_vis, cfg.candidate_topk_blocks, cfg.candidate_block_size,
                                                 widths)
    return top_groups_ordered(scores, cfg.index_topk, n_vis, widths)


@staged("attention.key_gathering")
def _compressed_ids(plan: LayerPlan, lay: StepLayout, shared: StepShared) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, K] absolute group ids each query reads, -1 = none, the valid ones first; [T] int32 their count)."""
    if plan.index_layer < 0:  # V4 ratio 128: every visible group (valid first already), the same in every layer
        def all_visible():
            j = torch.arange(lay.seq_rows(plan.ratio).shape[1], device=lay.device)
            ids = torch.where(j < lay.n_visible(plan.ratio)[:, None], j, -1)
            return ids, (ids >= 0).sum(-1, dtype=torch.int32)
        return lay.table(("all_visible", plan.ratio), all_visible)
    return shared.topk[plan.index_layer]


@staged("attention")
def attention(x: torch.Tensor, w: AttentionWeights, plan: LayerPlan, cfg: ModelConfig, lay: StepLayout,
              cache: KVCache, shared: StepShared) -> torch.Tensor:
    """x [T, D] (normed collapsed input) -> [T, D]; writes this layer's caches."""
    T, H, d, eps = x.shape[0], cfg.n_heads, cfg.head_dim, cfg.norm_eps
    freqs = layer_frequencies(cfg, plan)
    table = lay.table(("rope", plan.rope_base, plan.yarn), lambda: rope_table(lay.batch.positions, freqs))
    # projections of one input run as one GEMM (linears): x -> q latent | window KV, q latent -> heads | index q
    q_latent, kv = linears(x, (w.wq_a, w.wkv))
    qr = rms_norm(q_latent, w.q_norm, eps)
    q, index_q = linears(qr, (w.wq_b, w.indexer.wq_b)) if plan.runs_indexer else (linear(qr, w.wq_b), None)
    q = q.view(T, H, d)
    if not cfg.is_v41:  # V4: per-head RMS normalisation of the query, no weight
        qf = q.float()
        q = (qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + eps)).to(q.dtype)
    q = apply_rope(q, table)
    kv = _window_kv(kv, table, w.kv_norm, cfg)

    comp = comp_ids = comp_valid = None
    if plan.ratio:
        if plan.owns_kv:
            _compress_into_pools(x, w, plan, cfg, lay, cache)
        if plan.runs_indexer:
            shared.topk[plan.layer] = _index(x, index_q, w.indexer, plan, cfg, lay, cache, table, shared)
        comp, (comp_ids, comp_valid) = cache.comp_kv[plan.kv_layer], _compressed_ids(plan, lay, shared)

    b, ring = lay.batch, cache.window[plan.layer]
    # rope_out: the keys' rotation carried through V = K is removed from the output
    o = sparse_attention(q, kv, ring, w.sink, b.positions, b.seq_of, b.slots, b.start_pos, d ** -0.5,
                         comp, b.block_table, comp_ids, plan.ratio, rope_out=table, key_rows=lay.key_rows,
                         step=shared.step, window_width=lay.window_widths, comp_valid=comp_valid,
                         rows_per_seq=lay.rows_per_seq, key_store=cache.keys)
    # written after attention: the ring slots this chunk overwrites held keys its own queries read
    ring.view(-1, d)[lay.ring_write_dst] = kv[lay.ring_write_row].to(ring.dtype)
    if lay.draft_rows is not None:  # draft rows: written once accepted (mini.model.drafts)
        lay.draft_rows.keep_window(plan.layer, kv)
    return out_proj(o, w, cfg)


def out_proj(o: torch.Tensor, w: AttentionWeights, cfg: ModelConfig) -> torch.Tensor:
    """The output projection of the heads' outputs o [T, H, d]: wo_a per group of heads, then wo_b."""
    T = o.shape[0]
    return linear(grouped_linear(o.reshape(T, cfg.o_groups, -1), w.wo_a.to(o.dtype), w.wo_a_fp8), w.wo_b)
