"""The model (spec §2): embedding -> hc copies -> blocks (Engram, mHC-wrapped attention and MoE) -> collapse ->
norm -> fp32 head, over a flat batch of tokens.

mHC schedule. V4 (immediate): every site collapses its input with the `pre` it computes from that input; a final
`hc_head` collapses the stream. V4.1 (delayed): a site's `pre` collapses the input of the *next* site — layer 0's
attention starts from a one-hot pre-mix, each FFN uses its block's attention `pre`, each attention the previous
FFN's, and the last FFN's `pre` makes the final collapse; there is no hc_head.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from mini.config import LayerPlan, ModelConfig
from mini.model.attn_layer import AttentionWeights, StepShared, attention
from mini.model.batch import Batch, DecodeBuffers, EngramInput
from mini.model.cache import KVCache
from mini.model.dspark import DSparkWeights
from mini.model.static_decode import StaticDecodeInputs
from mini.ops import mhc
from mini.ops.engram import EngramWeights, engram
from mini.ops.linear import head_logits
from mini.ops.moe import MoEWeights, moe
from mini.ops.norm import rms_norm
from mini.ops.stages import staged
from mini.ops.step_plan import StepPlan
from mini.step import SeqChunk

log = logging.getLogger(__name__)

_SKIPPED = {"mtp.": "MTP/DSpark draft", "vision.": "vision", "aligner.": "vision", "image_": "vision"}


@dataclass
class HCWeights:
    fn: torch.Tensor  # [(2+hc)*hc, hc*D] fp32
    scale: torch.Tensor  # [3]
    base: torch.Tensor  # [(2+hc)*hc]

    @classmethod
    def from_state(cls, state: dict, prefix: str) -> "HCWeights":
        return cls(state[f"{prefix}_fn"].float(), state[f"{prefix}_scale"].float(), state[f"{prefix}_base"].float())


@dataclass
class BlockWeights:
    plan: LayerPlan
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HCWeights
    hc_ffn: HCWeights
    attn: AttentionWeights
    moe: MoEWeights
    engram: EngramWeights | None


ENGRAM_DEVICE_BYTES = 1 << 30  # Engram tables (all layers, values + scales) up to this size go to the device


def _is_engram_table(name: str) -> bool:
    return ".engram.embed." in name


def _on_device(state: dict, device, consume: bool, engram_tables: bool, skip: dict = _SKIPPED) -> dict:
    """The tensors the model runs, on `device`; the Engram tables stay where they are (host, memory-mapped) unless
    `engram_tables`, the routed experts too until MoEWeights stacks them on the device (one copy, never two), and
    the parts mini does not run are dropped with one log line. `consume` empties `state` on the way."""
    kept, skipped = {}, {}
    for name in list(state):
        t = state.pop(name) if consume else state[name]
        what = next((v for k, v in skip.items() if name.startswith(k)), None)
        if what is not None:
            skipped[what] = skipped.get(what, 0) + 1
        elif (_is_engram_table(name) and not engram_tables) or ".ffn.experts." in name:
            kept[name] = t  # host-side Engram tables stay put; experts are stacked straight onto the device
        else:
            kept[name] = t.to(device)
    if skipped:
        log.info("skipping weights mini does not run: %s",
                 ", ".join(f"{n} {what} tensors" for what, n in skipped.items()))
    return kept


class Model:
    def __init__(self, config: ModelConfig, state: dict, device="cpu", dtype=torch.bfloat16, moe_exchange=None,
                 experts: range | None = None, consume_state: bool = False,
                 engram_device_bytes: int = ENGRAM_DEVICE_BYTES):
        """`state`: checkpoint tensors by official name; `experts`: the routed experts it holds (EP, None = all);
        `moe_exchange(x, moe_weights, config, plan, input_ids)`, when given, replaces `moe()` (the EP exchange).
        `consume_state` empties `state` while taking its tensors: a layer's experts rewritten into new buffers at
        load (the Humming layout) then free the old ones at once, not when the caller drops `state`.
        The Engram tables move to `device` when they take at most `engram_device_bytes` in all (tiny-v4.1: 0.4
        MB; V4.1-Flash: ~200 GB, they stay on the host); then `engram_on_device` is True and a static decode step
        hashes and looks up on the device (EngramInput "prefix"). 0 keeps them on the host (even on CPU, where
        only the code path differs)."""
        cfg = self.config = config
        self.device, self.dtype, self.moe_exchange = torch.device(device), dtype, moe_exchange
        self.vision = self.span_cache = None  # V4.1's vision tower (mini/model/vision.py), before the text model
        if cfg.vision:
            from mini.model.vision import SpanCache, VisionTower
            self.vision = VisionTower.take(state, cfg, self.device, dtype, consume_state)
            self.span_cache = SpanCache(self.vision)  # an engine's steps: each image encoded once
        table_bytes = sum(t.numel() * t.element_size() for n, t in state.items() if _is_engram_table(n))
        self.engram_on_device = bool(cfg.engram_layer_ids) and table_bytes <= engram_device_bytes
        self.hasher = None  # EngramHasher for Batch.build; load_model sets it
        # DSpark (V4.1 `mtp.*`) is loaded when the config has it (mini/model/dspark.py); V4's MTP block is skipped
        skip = {k: v for k, v in _SKIPPED.items() if not (k == "mtp." and cfg.has_dspark)}
        state = _on_device(state, self.device, consume_state, self.engram_on_device, skip)
        self.embed = state["embed.weight"]
        self.norm = state["norm.weight"]
        # the reference keeps the head in fp32; on CUDA a bf16 head stays bf16 for the fast path's exact-product
        # GEMM (ops.linear.head_logits), which widens it itself on the reference path
        head = state["head.weight"]
        lossless = head.dtype == torch.bfloat16 and self.device.type == "cuda"
        self.head = head if lossless else head.float()
        self.hc_head = None if cfg.is_v41 else HCWeights.from_state(state, "hc_head")
        self.blocks = []
        for plan in cfg.layers:
            p = f"layers.{plan.layer}"
            self.blocks.append(BlockWeights(
                plan, state[f"{p}.attn_norm.weight"], state[f"{p}.ffn_norm.weight"],
                HCWeights.from_state(state, f"{p}.hc_attn"), HCWeights.from_state(state, f"{p}.hc_ffn"),
                AttentionWeights.from_state(state, f"{p}.attn", cfg, plan, dtype),
                MoEWeights.from_state(state, f"{p}.ffn", cfg, plan.layer, experts, device=self.device, consume=True),
                EngramWeights.from_state(state, f"{p}.", cfg) if plan.engram else None))
        self.dspark = DSparkWeights.from_state(state, cfg, self.device, dtype) if cfg.has_dspark else None
        self.target_features: torch.Tensor | None = None  # DSpark's input, [T, n·D], set by each forward

    def _pre_norm(self, h: torch.Tensor, w: HCWeights, norm_weight: torch.Tensor, pre_in: torch.Tensor | None):
        """(rms_norm(collapse(h, pre_in or this site's pre)), pre, post, comb) of one mHC site."""
        c = self.config
        return mhc.pre_norm(h, w.fn, w.scale, w.base, norm_weight, pre_in, hc_mult=c.hc_mult,
                            iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, norm_eps=c.norm_eps)

    @staged("moe")
    def _ffn(self, x: torch.Tensor, blk: BlockWeights, input_ids: torch.Tensor,
             image_mask: torch.Tensor | None = None, step: StepPlan | None = None) -> torch.Tensor:
        """The block's MoE (image rows route with bias_vl) under the step's plan; the EP exchange runs the op's
        pieces itself, each deciding for its call."""
        if self.moe_exchange is not None:
            return self.moe_exchange(x, blk.moe, self.config, blk.plan, input_ids, image_mask)
        return moe(x, blk.moe, self.config, blk.plan, input_ids, image_mask, step=step)

    # ---------------------------------------------------------- what the engine steps (mini.step.StepModel)
    def build_batch(self, chunks: list[SeqChunk], device) -> Batch:
        """The flat batch; with images, their rows (each image encoded once, SpanCache) and their positions dead in
        the histories Engram hashes (their input ids stay the image id)."""
        if not any(c.images for c in chunks):
            return Batch.build(chunks, self.config, device, hasher=self.hasher)
        if self.span_cache is None:
            raise ValueError("this model has no vision tower: it cannot read images")
        from mini.model.image_input import dead_at_images
        back = self.hasher.lookback if self.hasher is not None else 0
        marked = []
        for c in chunks:  # only the positions the hash reads: the chunk and the lookback before it
            first = max(0, c.start - back)
            marked.append(replace(c, tokens=c.tokens[:first] + dead_at_images(c.tokens[first:], first, c.images)))
        batch = Batch.build(marked, self.config, device, hasher=self.hasher)
        batch.input_ids = batch.input_ids.masked_fill(batch.input_ids < 0, self.config.image_token_id)
        batch.images = self.span_cache.step_rows(chunks, device)
        return batch

    def release_images(self, digests: list[str]) -> None:
        if self.span_cache is not None:
            self.span_cache.release(digests)

    @property
    def reads_images(self) -> bool:
        return self.vision is not None

    @property
    def drafter(self):
        """DSpark as the engine's drafter (mini.model.dspark_drafter), None without `mtp.*`."""
        if self.dspark is None:
            return None
        from mini.model.dspark_drafter import DSparkDrafter
        return DSparkDrafter(self)

    def new_cache(self, n_slots: int, n_blocks: int, block_tokens: int, device, dtype) -> KVCache:
        return KVCache(self.config, n_slots, n_blocks, block_tokens, device, dtype)

    def cache_bytes(self, block_tokens: int, dtype) -> tuple[int, int]:
        """(bytes per block, bytes per slot) of the KVCache pools."""
        return KVCache.bytes_per_block(self.config, block_tokens, dtype), KVCache.bytes_per_slot(self.config, dtype)

    @property
    def capturable(self) -> bool:
        """Decode steps may be captured in CUDA graphs unless an EP exchange replaces `moe`: it sizes its messages
        from each step's token counts, which only a wrapper that agrees on them (mini.parallel.dp.DPModel) fixes."""
        return self.moe_exchange is None

    def agree_step(self, n_tokens: int, bucket: int | None) -> int | None:
        """One process: nothing to agree on."""
        return bucket

    def static_decode(self, max_seqs: int, max_len: int, block_tokens: int, pad_slot: int, pad_block: int, device,
                      dtype, max_rows: int = 1) -> StaticDecodeInputs:
        """Static decode buffers (mini.model.static_decode). Engram: with the tables on the device the graph hashes
        and looks up itself (the buffers carry each token's predecessors); else the buffers take the rows looked up
        on the host."""
        engram_shape, engram_lookback = None, 0
        if self.hasher is not None and self.engram_on_device:
            engram_lookback = self.hasher.lookback
        elif self.hasher is not None:
            engram_shape = (*self.hasher.primes.shape, self.config.engram_head_dim)
        buffers = DecodeBuffers(max_seqs, max_len, block_tokens, pad_slot=pad_slot, pad_block=pad_block,
                                device=torch.device(device), engram_shape=engram_shape, engram_dtype=dtype,
                                engram_lookback=engram_lookback, max_rows=max_rows)
        return StaticDecodeInputs(buffers, self.hasher, self.engram_rows, self)

    @property
    def hasher(self):
        """EngramHasher (host) of the model, or None; setting it also makes its device copy when the tables are on
        the device (before any capture: the copy comes from the host)."""
        return self._hasher

    @hasher.setter
    def hasher(self, hasher) -> None:
        self._hasher = hasher
        self._device_hasher = hasher.on_device(self.device) if hasher is not None and self.engram_on_device else None

    def hash_on_device(self, prefix: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Engram hash ids [B, n_engram_layers, n_hash_cols] of decode tokens `last` [B] whose predecessors are
        `prefix` [B, lookback - 1] (-1 before the sequence's start), on the device (EngramInput "prefix")."""
        if self._device_hasher is None:
            raise ValueError("hashing on the device needs the Engram tables there and the model's hasher set")
        return self._device_hasher.hash_last(torch.cat([prefix, last[:, None]], 1))

    def engram_rows(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """[T, n_engram_layers, n_hash_cols, head_dim] table rows of hash ids (EngramInput "ids"), where the
        tables are (the host, normally): the lookup that a captured decode step (EngramInput "rows") does before its
        replay, leaving one copy to the device."""
        tables = [blk.engram for blk in self.blocks if blk.engram is not None]
        return torch.stack([w.lookup(hash_ids[:, i], self.dtype, w.embed.device) for i, w in enumerate(tables)], 1)

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: KVCache) -> torch.Tensor:
        """logits fp32 [len(batch.logit_rows), vocab]; writes the step's KV into `cache`. `batch.images`: the step's
        image positions (mini.model.vision.ImageRows), whose ids may be -1 (dead for Engram, as `mini logits` builds
        its batch; their embedding is replaced)."""
        cfg, eps = self.config, self.config.norm_eps
        lay = batch.layout(cache.block_tokens, cfg.window_size)
        cache.drafts = lay.draft_rows  # a verify step's drafts, kept aside until cache.commit_drafts
        shared = StepShared(lay.plan(self.dtype))  # what runs, and what index sources publish, in this forward
        images = batch.images
        h = self.embed[batch.input_ids if images is None else batch.input_ids.clamp(min=0)].to(self.dtype)
        image_mask = text_mask = None
        if images is not None:  # image spans: their embeddings, bias_vl in the gates, no Engram (spec §2.8)
            h, image_mask = images.merge(h)
            text_mask = ~image_mask
        h = h.unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # [T, hc, D]
        pre_mix = torch.zeros(h.shape[0], cfg.hc_mult, device=h.device)
        pre_mix[:, 0] = 1.0  # V4.1: layer 0 starts from copy 0 (all copies are equal)
        engram_col, eng = 0, batch.engram
        if any(blk.engram is not None for blk in self.blocks) and eng is None:
            raise ValueError("the batch has no Engram input (Batch.build needs a hasher)")
        if eng is not None and eng.form == "prefix":  # a static decode step with the tables on the device
            eng = EngramInput("ids", self.hash_on_device(eng.data, batch.input_ids))
        # DSpark's target features (spec §2.7): the mean over the hc copies of each target layer's input, after
        # Engram, taken on the way (no extra pass); the draft module reads them from `self.target_features`
        targets, features = cfg.dspark_target_layers if self.dspark is not None else (), []
        for blk in self.blocks:
            if blk.engram is not None:
                if eng.form == "rows":  # looked up on the host before a CUDA-graph replay
                    h = engram(h, None, blk.engram, cfg, text_mask, rows=eng.data[:, engram_col])
                elif eng.form == "pending":  # host tables, looked up ahead (mini.model.engram_host)
                    h = engram(h, None, blk.engram, cfg, text_mask, rows=eng.data.rows(engram_col, h.dtype))
                else:
                    h = engram(h, eng.data[:, engram_col], blk.engram, cfg, text_mask)
                engram_col += 1
            if blk.plan.layer in targets:
                features.append(h.mean(1))
            # each site's mixes come from its own input; its collapse uses the previous site's pre (V4.1) or its own
            x, a_pre, a_post, a_comb = self._pre_norm(h, blk.hc_attn, blk.attn_norm, pre_mix if cfg.is_v41 else None)
            h = mhc.expand(attention(x, blk.attn, blk.plan, cfg, lay, cache, shared), h, a_post, a_comb)
            x, f_pre, f_post, f_comb = self._pre_norm(h, blk.hc_ffn, blk.ffn_norm, a_pre if cfg.is_v41 else None)
            h = mhc.expand(self._ffn(x, blk, batch.input_ids, image_mask, shared.step), h, f_post, f_comb)
            pre_mix = f_pre
        self.target_features = lay.keep("target_features", torch.cat(features, -1)) if features else None
        h = h[batch.logit_rows]
        if cfg.is_v41:
            x = mhc.collapse(h, pre_mix[batch.logit_rows])
        else:
            w = self.hc_head
            x = mhc.hc_head(h, w.fn, w.scale, w.base, hc_eps=cfg.hc_eps, norm_eps=eps)
        return head_logits(self._final_norm(x), self.head)

    @staged("hc_norm_other.norm")
    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm, self.config.norm_eps)
