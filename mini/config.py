"""Model configuration: the official config.json (V4.1 `deepseek_v41`, V4 `deepseek_v4`) -> ModelConfig, presets,
and the per-layer schedule (which caches a layer reads, which indexer it runs) as LayerPlan.

Field names follow the reference `inference/config.json` (ModelArgs). `from_hf` also accepts the Hugging Face names.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path


# ---------------------------------------------------------------------- vision block of config.json
_VISION_KEYS = {  # config.json `vision_config` key -> ModelConfig field
    "num_hidden_layers": "vision_n_layers", "hidden_size": "vision_dim", "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim", "patch_size": "vision_patch_size", "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio", "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels", "max_wh_ratio": "vision_max_wh_ratio",
}


def _vision_fields(cfg: dict) -> dict:
    """The vision block's fields from a (flattened) config.json: the release's nested `vision_config`, or the
    reference ModelArgs' flat `vision_*` names. `vision_n_layers` 0 (or no block) means no vision tower."""
    nested = cfg.get("vision_config") or {}
    out = {}
    for hf, ours in _VISION_KEYS.items():
        value = nested.get(hf, cfg.get(ours))
        if value is not None or (hf == "max_wh_ratio" and hf in nested):
            out[ours] = value
    if cfg.get("image_token_id") is not None:
        out["image_token_id"] = int(cfg["image_token_id"])
    out["vision"] = bool(nested or cfg.get("vision_n_layers")) and out.get("vision_n_layers", 0) > 0
    return out


@dataclass(frozen=True)
class ModelConfig:
    version: str = "v4.1"  # "v4.1" or "v4"
    vocab_size: int = 129280
    dim: int = 5120
    n_layers: int = 40
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20  # backbone layers only
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)  # V4.1; empty for V4 (every compressed layer owns its cache)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer: int = 20  # < 0: no two-level top-k
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536  # YaRN; 0 disables
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    max_position_embeddings: int = 1048576
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2304
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    n_hash_layers: int = 0  # V4: the first n layers route by token id (tid2eid)
    # hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-20
    # engram (V4.1)
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # quantization of the checkpoint
    fp8_block: int = 32  # 32x32 weight blocks and 1x32 activation blocks (V4.1); 128 for V4
    expert_dtype: str = "fp4"  # MXFP4 routed experts
    # recognised and skipped (separate work)
    n_mtp_layers: int = 0
    # ---- vision tower (V4.1; spec §2.8, official vision.py / image_processor.py). Defaults: the official ModelArgs
    vision: bool = False  # the checkpoint has a ViT + aligner (config.json `vision_config`)
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816  # SwiGLU: mlp.w1 is [2 * inter, dim]
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3  # the aligner's pixel-unshuffle: ratio x ratio patches -> one LLM token
    vision_max_n_token: int = 1024  # token cap of one image span (start, rows + newlines, end)
    vision_min_pixels: int = 544 * 544  # smaller images are upscaled to about this area
    vision_max_wh_ratio: float | None = None  # wider images are squashed to this aspect ratio (None: never)
    image_token_id: int = 129264  # every position of an image span carries this id
    # ---- end of the vision block
    bos_id: int = 0
    eos_id: int = 1
    # ---- DSpark, V4.1's draft module (`mtp.*`; spec §2.7, official DSparkBlock). It has `n_mtp_layers` stages
    # (0 or dspark_block_size 0: none); a stage is a window-only block with its own smaller MoE. Defaults: V4.1-Flash's
    # values, except the block size, 0 as in the official ModelArgs (V4.1-Flash's config.json says 5): a config.json
    # without DSpark keys has no draft module, and the presets keep theirs
    dspark_block_size: int = 0  # draft positions per step: [anchor, noise x (block - 1)] in, block draft logits out
    dspark_noise_id: int = 128799  # the token id of the block's 4 unknown positions
    dspark_target_layers: tuple[int, ...] = (37, 38, 39)  # whose block inputs (mean over hc copies) feed the draft
    dspark_markov_rank: int = 256  # the Markov head: logits += head(embed(previous token)), rank r
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # ---- end of the DSpark block

    # ------------------------------------------------------------------ derived
    @property
    def is_v41(self) -> bool:
        return self.version == "v4.1"

    @property
    def n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def hc_mix(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @cached_property
    def layers(self) -> tuple["LayerPlan", ...]:
        return tuple(_plan(self, i) for i in range(self.n_layers))

    @property
    def kv_cache_layers(self) -> tuple[int, ...]:
        """Layers that own a compressed KV cache (V4.1: the KV sources; V4: every compressed layer)."""
        return tuple(p.layer for p in self.layers if p.owns_kv)

    @property
    def index_key_layers(self) -> tuple[int, ...]:
        """Layers that own an index-key cache (V4.1: the KV sources; V4: every ratio-4 layer)."""
        return tuple(p.layer for p in self.layers if p.owns_index_keys)

    def validate(self) -> "ModelConfig":
        def need(cond, msg):
            if not cond:
                raise ValueError(f"invalid model config: {msg}")

        need(self.version in ("v4.1", "v4"), f"version must be 'v4.1' or 'v4', got {self.version!r}")
        if self.has_dspark:
            need(len(self.dspark_target_layers) > 0
                 and all(0 <= t < self.n_layers for t in self.dspark_target_layers), "bad dspark_target_layers")
            need(0 <= self.dspark_noise_id < self.vocab_size, "dspark_noise_id outside the vocabulary")
            need(0 < self.dspark_n_activated_experts <= self.dspark_n_routed_experts, "bad DSpark expert counts")
        need(len(self.compress_ratios) == self.n_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries for {self.n_layers} layers")
        need(self.n_heads % self.o_groups == 0, "n_heads must be a multiple of o_groups")
        need(self.head_dim > self.rope_head_dim and self.rope_head_dim % 2 == 0, "bad head_dim / rope_head_dim")
        need(self.dim % self.fp8_block == 0, f"dim {self.dim} must be a multiple of the fp8 block {self.fp8_block}")
        need(self.moe_inter_dim % 32 == 0, "moe_inter_dim must be a multiple of 32 (MXFP4 scale blocks)")
        need(self.n_activated_experts <= self.n_routed_experts, "more activated than routed experts")
        if self.is_v41:
            for s in self.kv_source_layers:
                need(self.compress_ratios[s] > 0, f"KV source layer {s} has ratio 0")
            for i, r in enumerate(self.compress_ratios):
                if r > 0:
                    src = [s for s in self.kv_source_layers if s <= i]
                    need(src and self.compress_ratios[src[-1]] == r,
                         f"layer {i} (ratio {r}) has no KV source of the same ratio at or below it")
                    idx = [s for s in self.index_source_layers if s <= i]
                    need(idx, f"layer {i} has no index source at or below it")
            if self.candidate_source_layer >= 0:
                need(self.candidate_source_layer in self.index_source_layers,
                     "candidate_source_layer must be an index source")
                need(self.candidate_topk_blocks * self.candidate_block_size >= self.index_topk,
                     "candidate blocks must cover at least index_topk positions")
            need(len(self.engram_num_embeddings) == len(self.engram_layer_ids),
                 "engram_num_embeddings must have one entry per engram layer")
            if self.vision:
                need(self.vision_n_layers > 0 and self.vision_dim % self.vision_n_heads == 0
                     and (self.vision_dim // self.vision_n_heads) % 4 == 0,
                     "the vision tower needs layers and a head dim that is a multiple of 4 (2D RoPE halves)")
                need(self.vision_max_n_token >= 4, "vision_max_n_token must leave room for one token row")
                need(0 <= self.image_token_id < self.vocab_size, "image_token_id outside the vocabulary")
        else:
            need(all(r in (0, 4, 128) for r in self.compress_ratios), "V4 ratios must be 0, 4 or 128")
        return self

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from an official `config.json` dict (V4.1 nested text_config, V4 flat, or the reference's
        inference/config.json)."""
        model_type = cfg.get("model_type", "")
        if "text_config" in cfg:
            cfg = {**cfg["text_config"], "model_type": model_type, "quantization_config":
                   cfg.get("quantization_config", cfg["text_config"].get("quantization_config")),
                   "vision_config": cfg.get("vision_config"), "image_token_id": cfg.get("image_token_id")}
        is_v41 = model_type.startswith("deepseek_v41") or "kv_source_layer_ids" in cfg or "kv_source_layers" in cfg

        def get(*names, default=None):
            for n in names:
                if n in cfg and cfg[n] is not None:
                    return cfg[n]
            return default

        n_layers = get("num_hidden_layers", "n_layers")
        if n_layers is None:
            raise ValueError("config.json has neither num_hidden_layers nor n_layers")
        ratios = tuple(int(r) for r in get("compress_ratios", default=[0] * n_layers))[:n_layers]
        rope_scaling = get("rope_scaling", default={}) or {}
        quant = get("quantization_config", default={}) or {}
        block = quant.get("weight_block_size", [32, 32] if is_v41 else [128, 128])
        expert_dtype = quant.get("expert_dtype", cfg.get("expert_dtype", "fp4"))
        mtp = int(get("num_nextn_predict_layers", "n_mtp_layers", default=0))
        kw = dict(
            version="v4.1" if is_v41 else "v4",
            vocab_size=get("vocab_size", default=129280),
            dim=get("hidden_size", "dim"),
            n_layers=n_layers,
            n_heads=get("num_attention_heads", "n_heads"),
            head_dim=get("head_dim", default=512),
            rope_head_dim=get("qk_rope_head_dim", "rope_head_dim", default=64),
            q_lora_rank=get("q_lora_rank"),
            o_groups=get("o_groups", default=8),
            o_lora_rank=get("o_lora_rank", default=1024),
            window_size=get("sliding_window", "window_size", default=128),
            compress_ratios=ratios,
            index_n_heads=get("index_n_heads", default=32 if is_v41 else 64),
            index_head_dim=get("index_head_dim", default=128),
            index_topk=get("index_topk", default=512),
            rope_theta=float(get("rope_theta", default=10000.0)),
            compress_rope_theta=float(get("compress_rope_theta", default=160000.0)),
            original_seq_len=int(rope_scaling.get("original_max_position_embeddings", get("original_seq_len", default=0))),
            rope_factor=float(rope_scaling.get("factor", get("rope_factor", default=1.0))),
            beta_fast=int(rope_scaling.get("beta_fast", get("beta_fast", default=32))),
            beta_slow=int(rope_scaling.get("beta_slow", get("beta_slow", default=1))),
            max_position_embeddings=get("max_position_embeddings", default=1048576),
            n_routed_experts=get("n_routed_experts"),
            n_shared_experts=get("n_shared_experts", default=1),
            n_activated_experts=get("num_experts_per_tok", "n_activated_experts"),
            moe_inter_dim=get("moe_intermediate_size", "moe_inter_dim"),
            score_func=get("scoring_func", "score_func", default="sqrtsoftplus"),
            gate_temp=float(get("gate_temp", default=1.0)),
            norm_topk_prob=bool(get("norm_topk_prob", default=True)),
            route_scale=float(get("routed_scaling_factor", "route_scale", default=1.0)),
            swiglu_limit=float(get("swiglu_limit", default=0.0)),
            n_hash_layers=0 if is_v41 else int(get("num_hash_layers", "n_hash_layers", default=0)),
            hc_mult=get("hc_mult", default=4),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters", default=20),
            hc_eps=float(get("hc_eps", default=1e-6)),
            norm_eps=float(get("rms_norm_eps", "norm_eps", default=1e-20 if is_v41 else 1e-6)),
            fp8_block=int(block[0]),
            expert_dtype=expert_dtype or "fp4",
            n_mtp_layers=mtp,
            **_vision_fields(cfg),
            bos_id=get("bos_token_id", default=0),
            eos_id=get("eos_token_id", default=1),
        )
        if is_v41:
            kw.update(
                kv_source_layers=tuple(get("kv_source_layer_ids", "kv_source_layers")),
                index_source_layers=tuple(get("index_source_layer_ids", "index_source_layers")),
                candidate_source_layer=int(get("candidate_source_layer_id", "candidate_source_layer", default=-1)),
                candidate_topk_blocks=get("candidate_topk_blocks", default=0),
                candidate_block_size=get("candidate_block_size", default=1),
                engram_layer_ids=tuple(get("engram_layer_ids", default=())),
                engram_vocab_size=get("engram_vocab_size", default=0),
                engram_num_embeddings=tuple(get("engram_num_embeddings", default=())),
                engram_max_ngram_size=get("engram_max_ngram_size", default=1),
                engram_n_heads=get("engram_n_heads", default=0),
                engram_head_dim=get("engram_head_dim", default=0),
                engram_pad_id=get("engram_pad_id", default=2),
                engram_compressed_vocab_size=get("engram_compressed_vocab_size", default=0),
            )
        else:
            kw.update(kv_source_layers=(), index_source_layers=(), candidate_source_layer=-1,
                      candidate_topk_blocks=0, candidate_block_size=1, engram_layer_ids=(),
                      engram_num_embeddings=(), engram_max_ngram_size=1, engram_n_heads=0, engram_head_dim=0,
                      engram_compressed_vocab_size=0)
        if is_v41:
            kw.update(_dspark_fields(cfg))
        return cls(**kw).validate()

    def to_hf(self) -> dict:
        """The official config.json layout (V4.1: nested text_config; V4: flat `deepseek_v4`)."""
        text = {
            "vocab_size": self.vocab_size, "hidden_size": self.dim, "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads, "num_key_value_heads": 1, "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim, "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank, "sliding_window": self.window_size,
            "compress_ratios": list(self.compress_ratios) + [0] * self.n_mtp_layers,
            "compress_rope_theta": self.compress_rope_theta, "rope_theta": self.rope_theta,
            "rope_scaling": {"rope_type": "yarn", "factor": self.rope_factor, "beta_fast": self.beta_fast,
                             "beta_slow": self.beta_slow, "original_max_position_embeddings": self.original_seq_len},
            "max_position_embeddings": self.max_position_embeddings,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts, "moe_intermediate_size": self.moe_inter_dim,
            "scoring_func": self.score_func, "topk_method": "noaux_tc", "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.route_scale, "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps, "num_nextn_predict_layers": self.n_mtp_layers,
            "bos_token_id": self.bos_id, "eos_token_id": self.eos_id, "torch_dtype": "bfloat16",
        }
        if self.has_dspark:
            text.update(self._dspark_hf())
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                 "weight_block_size": [self.fp8_block, self.fp8_block]}
        if self.is_v41:
            text.update({
                "model_type": "deepseek_v41_text", "gate_temp": self.gate_temp,
                "kv_source_layer_ids": list(self.kv_source_layers),
                "index_source_layer_ids": list(self.index_source_layers),
                "candidate_source_layer_id": self.candidate_source_layer,
                "candidate_topk_blocks": self.candidate_topk_blocks,
                "candidate_block_size": self.candidate_block_size,
                "engram_layer_ids": list(self.engram_layer_ids), "engram_vocab_size": self.engram_vocab_size,
                "engram_num_embeddings": list(self.engram_num_embeddings),
                "engram_max_ngram_size": self.engram_max_ngram_size, "engram_n_heads": self.engram_n_heads,
                "engram_head_dim": self.engram_head_dim, "engram_pad_id": self.engram_pad_id,
                "engram_compressed_vocab_size": self.engram_compressed_vocab_size,
            })
            quant["expert_dtype"] = self.expert_dtype
            out = {"architectures": ["DeepseekV41ForConditionalGeneration"], "model_type": "deepseek_v41",
                   "text_config": text, "quantization_config": quant, "torch_dtype": "bfloat16",
                   "bos_token_id": self.bos_id, "eos_token_id": self.eos_id}
            if self.vision:
                out["image_token_id"] = self.image_token_id
                out["vision_config"] = {"model_type": "deepseek_v41_vision",
                                        **{hf: getattr(self, ours) for hf, ours in _VISION_KEYS.items()}}
            return out
        text.update({"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
                     "num_hash_layers": self.n_hash_layers, "quantization_config": {**quant, "fmt": "e4m3"},
                     "expert_dtype": self.expert_dtype})
        return text

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf(cfg)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw).validate()

    # ------------------------------------------------------------------ DSpark (the draft module)
    @property
    def has_dspark(self) -> bool:
        """V4.1 with DSpark stages (V4's single MTP block is another design, recognised and skipped)."""
        return self.is_v41 and self.n_mtp_layers > 0 and self.dspark_block_size > 0

    @cached_property
    def dspark_layers(self) -> tuple["LayerPlan", ...]:
        """The stages as layers n_layers.. (as the reference numbers them): window only, RoPE base rope_theta
        without YaRN (every ratio-0 layer's), no Engram."""
        return tuple(LayerPlan(
            layer=self.n_layers + s, ratio=0, kv_layer=-1, owns_kv=False, index_layer=-1, runs_indexer=False,
            index_key_layer=-1, owns_index_keys=False, candidate_source=False, uses_candidates=False, engram=False,
            hash_routed=False, rope_base=self.rope_theta, yarn=False) for s in range(self.n_mtp_layers))

    @cached_property
    def dspark_moe(self) -> "ModelConfig":
        """This config with the draft MoE's expert counts: what `mini.ops.moe` reads for a stage's FFN."""
        return dataclasses.replace(self, n_routed_experts=self.dspark_n_routed_experts,
                                   n_activated_experts=self.dspark_n_activated_experts)

    def _dspark_hf(self) -> dict:
        return {"dspark_block_size": self.dspark_block_size, "dspark_noise_token_id": self.dspark_noise_id,
                "dspark_target_layer_ids": list(self.dspark_target_layers),
                "dspark_markov_rank": self.dspark_markov_rank,
                "dspark_n_routed_experts": self.dspark_n_routed_experts,
                "dspark_num_experts_per_tok": self.dspark_n_activated_experts}


@dataclass(frozen=True)
class LayerPlan:
    """What one layer does, derived from the config (spec §1.2)."""
    layer: int
    ratio: int  # compressed cache the layer reads: 0 = window only
    kv_layer: int  # layer owning the compressed KV this layer reads (-1: none)
    owns_kv: bool  # runs a compressor and writes compressed KV
    index_layer: int  # layer whose top-k this layer uses (-1: none / all visible rows, V4 ratio 128)
    runs_indexer: bool  # scores and publishes its own top-k
    index_key_layer: int  # layer owning the index keys the indexer scores (-1: none)
    owns_index_keys: bool
    candidate_source: bool  # V4.1: publishes candidate blocks
    uses_candidates: bool  # V4.1: restricts its scores to the candidate blocks
    engram: bool
    hash_routed: bool  # V4: experts chosen by token id
    rope_base: float
    yarn: bool  # YaRN applies (ratio > 0)


def _plan(cfg: ModelConfig, i: int) -> LayerPlan:
    r = cfg.compress_ratios[i]
    if cfg.is_v41:
        kv_layer = max((s for s in cfg.kv_source_layers if s <= i), default=-1) if r else -1
        index_layer = max((s for s in cfg.index_source_layers if s <= i), default=-1) if r else -1
        runs_indexer = r > 0 and i in cfg.index_source_layers
        cand = cfg.candidate_source_layer
        return LayerPlan(
            layer=i, ratio=r, kv_layer=kv_layer, owns_kv=r > 0 and i in cfg.kv_source_layers,
            index_layer=index_layer, runs_indexer=runs_indexer,
            index_key_layer=kv_layer if runs_indexer else -1, owns_index_keys=r > 0 and i in cfg.kv_source_layers,
            candidate_source=runs_indexer and i == cand, uses_candidates=runs_indexer and 0 <= cand < i,
            engram=i in cfg.engram_layer_ids, hash_routed=False,
            rope_base=cfg.compress_rope_theta if r else cfg.rope_theta, yarn=r > 0 and cfg.original_seq_len > 0)
    csa = r == 4  # V4: ratio 4 = CSA (own indexer), ratio 128 = HCA (all visible rows)
    return LayerPlan(
        layer=i, ratio=r, kv_layer=i if r else -1, owns_kv=r > 0, index_layer=i if csa else -1,
        runs_indexer=csa, index_key_layer=i if csa else -1, owns_index_keys=csa, candidate_source=False,
        uses_candidates=False, engram=False, hash_routed=i < cfg.n_hash_layers,
        rope_base=cfg.compress_rope_theta if r else cfg.rope_theta, yarn=r > 0 and cfg.original_seq_len > 0)


# ---------------------------------------------------------------------- presets
V41_FLASH = ModelConfig()

V4_FLASH = ModelConfig(
    version="v4", dim=4096, n_layers=43, n_heads=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4,), kv_source_layers=(), index_source_layers=(),
    candidate_source_layer=-1, candidate_topk_blocks=0, candidate_block_size=1, index_n_heads=64,
    n_routed_experts=256, moe_inter_dim=2048, route_scale=1.5, n_hash_layers=3, norm_eps=1e-6,
    engram_layer_ids=(), engram_num_embeddings=(), engram_max_ngram_size=1, engram_n_heads=0, engram_head_dim=0,
    engram_compressed_vocab_size=0, fp8_block=128, n_mtp_layers=1)

V4_PRO = V4_FLASH.replace(
    dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16,
    compress_ratios=(128, 128) + (4, 128) * 29 + (4,), index_topk=1024, n_routed_experts=384,
    moe_inter_dim=3072, route_scale=2.5)

# Tiny models keep every layer kind of the real schedule at small widths. Engram table sizes come from the prime
# walk (mini/ops/engram.py) and the compressed vocabulary from the tiny tokenizer make-checkpoint writes
# (mini/checkpoint/tiny_tokenizer.py); tests/ops/test_engram.py and tests/test_tokenizer.py recompute both.
TINY_V41 = ModelConfig(
    vocab_size=512, dim=64, n_layers=8, n_heads=8, head_dim=64, rope_head_dim=16, q_lora_rank=32, o_groups=2,
    o_lora_rank=32,
    # 0: window only; 1: window + engram; 2: ratio-2 KV + index source (+ engram, like 14); 3: its consumer;
    # 4: ratio-1 KV + index + candidate source (like 20); 5: consumer; 6: reindex source (like 24); 7: its consumer
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
    candidate_source_layer=4, candidate_topk_blocks=8, candidate_block_size=4, index_n_heads=4,
    index_head_dim=32, index_topk=24, original_seq_len=256, rope_factor=4.0, max_position_embeddings=4096,
    n_routed_experts=16, n_activated_experts=4, moe_inter_dim=64, route_scale=1.5,
    engram_layer_ids=(1, 2), engram_vocab_size=1000, engram_num_embeddings=(6126, 6332),
    engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=32, engram_compressed_vocab_size=445,
    fp8_block=32)

TINY_V4 = ModelConfig(
    version="v4", vocab_size=512, dim=128, n_layers=6, n_heads=8, head_dim=128, rope_head_dim=64, q_lora_rank=128,
    o_groups=2, o_lora_rank=64,
    # 0-1: window only (0-2 hash-routed); 2, 4: ratio-4 CSA with its indexer; 3, 5: ratio-128 HCA.
    # Widths are multiples of 128 so V4's 128x128 weight blocks and 1x128 activation blocks apply as in V4-Flash; the
    # indexer keeps V4's 64 unrotated + 64 RoPE dims (with fewer heads, exact score ties at the top-k cut are common).
    compress_ratios=(0, 0, 4, 128, 4, 128), kv_source_layers=(), index_source_layers=(),
    candidate_source_layer=-1, candidate_topk_blocks=0, candidate_block_size=1, index_n_heads=8,
    index_head_dim=128, index_topk=24, original_seq_len=256, rope_factor=4.0, max_position_embeddings=4096,
    n_routed_experts=16, n_activated_experts=4, moe_inter_dim=128, route_scale=1.5, n_hash_layers=3,
    norm_eps=1e-6, engram_layer_ids=(), engram_num_embeddings=(), engram_max_ngram_size=1, engram_n_heads=0,
    engram_head_dim=0, engram_compressed_vocab_size=0, fp8_block=128)

# tiny-v4.1 with a vision tower: a 2-block ViT at f3's widths (dim 64, 2 heads), images of up to 64 tokens.
# A preset of its own, so tiny-v4.1's cached checkpoint (and every figure measured on it) stays as it is.
TINY_V41_VL = TINY_V41.replace(
    vision=True, vision_n_layers=2, vision_dim=64, vision_n_heads=2, vision_inter_dim=64, vision_max_n_token=64,
    vision_min_pixels=84 * 84, image_token_id=510)

PRESETS: dict[str, ModelConfig] = {
    "v4.1-flash": V41_FLASH, "v4-flash": V4_FLASH, "v4-pro": V4_PRO, "tiny-v4.1": TINY_V41, "tiny-v4": TINY_V4,
    "tiny-v4.1-vl": TINY_V41_VL,
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


# ---------------------------------------------------------------------- DSpark keys of config.json
def _dspark_fields(cfg: dict) -> dict:
    """The DSpark fields from a (flattened) V4.1 config.json, under the release's or the reference's names. No
    `dspark_block_size` (or 0) means no draft module, whatever `num_nextn_predict_layers` says."""
    if not cfg.get("dspark_block_size"):
        return {}

    def get(*names, default):
        return next((cfg[n] for n in names if cfg.get(n) is not None), default)

    return dict(
        dspark_block_size=int(get("dspark_block_size", default=0)),
        dspark_noise_id=int(get("dspark_noise_token_id", "dspark_noise_id", default=128799)),
        dspark_target_layers=tuple(get("dspark_target_layer_ids", "dspark_target_layers", default=())),
        dspark_markov_rank=int(get("dspark_markov_rank", default=256)),
        # 0 or absent: the backbone's counts (the reference's ModelArgs.get_moe_config)
        dspark_n_routed_experts=int(get("dspark_n_routed_experts", default=0)
                                    or get("n_routed_experts", default=0)),
        dspark_n_activated_experts=int(get("dspark_num_experts_per_tok", "dspark_n_activated_experts", default=0)
                                       or get("num_experts_per_tok", "n_activated_experts", default=0)))


# tiny-v4.1 with DSpark's three stages (block 5, 8 of 16 experts top-2, targets = the last three layers' inputs).
# A preset of its own, so tiny-v4.1's cached checkpoint (and every figure measured on it) stays as it is.
TINY_V41_DSPARK = TINY_V41.replace(
    n_mtp_layers=3, dspark_block_size=5, dspark_noise_id=TINY_V41.vocab_size - 1, dspark_target_layers=(5, 6, 7),
    dspark_markov_rank=16, dspark_n_routed_experts=8, dspark_n_activated_experts=2)
PRESETS["tiny-v4.1-dspark"] = TINY_V41_DSPARK
