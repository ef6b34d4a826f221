"""Every tensor of an official V4.1 / V4 checkpoint, derived from a ModelConfig (spec §4.2).

Names carry no `model.` prefix and equal the reference module paths; a quantized `X.weight` has its scale in
`X.scale`. The inventory is built from `Weight`s: one logical matrix or vector each, which expands to the one or
two stored tensors of its format:

    bf16 / f32 / i64   one tensor, stored as is
    fp8                float8_e4m3fn [out, in] + E8M0 block scale [ceil(out/B), ceil(in/B)] (B = config.fp8_block)
    fp8_rows           float8_e4m3fn [rows, dim] + E8M0 [rows, dim/B]: one scale per row per B channels (Engram)
    mxfp4              int8 [out, in/2] (two E2M1 codes per byte) + E8M0 [out, in/32]

V4.1's DSpark draft module (`mtp.0..n-1.*`, `_dspark`) is part of the inventory when the config has it; its
routed experts are always all listed (a rank holds the whole draft); so is V4.1's vision tower (`vision.*`,
`aligner.*`, `image_*`, `_vision`) when the config has one. V4's MTP block, `mtp.*` of a config without DSpark,
and the vision tensors (with `bias_vl`) of a config without vision are recognised by `skip_reason` and never
loaded.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from mini.config import ModelConfig

MXFP4_BLOCK = 32  # one E8M0 scale per 32 K-elements of a routed expert (V4 and V4.1)


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Weight:
    """One logical parameter. `name` is its data tensor; `shape` is logical ([out, in] before FP4 packing)."""
    name: str
    fmt: str  # "bf16" | "f32" | "i64" | "fp8" | "fp8_rows" | "mxfp4"
    shape: tuple[int, ...]
    expert: int = -1  # routed expert index, -1 for everything else

    @property
    def scale_name(self) -> str:
        return self.name.removesuffix(".weight") + ".scale"

    def tensors(self, block: int) -> dict[str, TensorSpec]:
        plain = {"bf16": torch.bfloat16, "f32": torch.float32, "i64": torch.int64}
        if self.fmt in plain:
            return {self.name: TensorSpec(plain[self.fmt], self.shape)}
        out, inp = self.shape
        if self.fmt == "fp8":
            data, scale = (out, inp), (-(-out // block), -(-inp // block))
        elif self.fmt == "fp8_rows":
            data, scale = (out, inp), (out, inp // block)
        elif self.fmt == "mxfp4":
            data, scale = (out, inp // 2), (out, inp // MXFP4_BLOCK)
        else:
            raise ValueError(f"unknown weight format {self.fmt!r} for {self.name}")
        dtype = torch.int8 if self.fmt == "mxfp4" else torch.float8_e4m3fn
        return {self.name: TensorSpec(dtype, data), self.scale_name: TensorSpec(torch.float8_e8m0fnu, scale)}


def weights(config: ModelConfig, experts: range | None = None) -> list[Weight]:
    """All logical parameters in checkpoint order (embed, blocks, norm, head, V4 hc_head, DSpark stages).
    `experts` keeps only those routed experts of the blocks (None: all)."""
    c = config
    out = [Weight("embed.weight", "bf16", (c.vocab_size, c.dim))]
    for i in range(c.n_layers):
        out += _block(c, i, experts)
    if c.vision:
        out += _vision(c)
    out += [Weight("norm.weight", "bf16", (c.dim,)), Weight("head.weight", "bf16", (c.vocab_size, c.dim))]
    if not c.is_v41:
        out += [Weight("hc_head_fn", "f32", (c.hc_mult, c.hc_mult * c.dim)),
                Weight("hc_head_base", "f32", (c.hc_mult,)), Weight("hc_head_scale", "f32", (1,))]
    if c.has_dspark:
        out += _dspark(c)
    return out


def expected_tensors(config: ModelConfig, experts: range | None = None) -> dict[str, TensorSpec]:
    """name -> TensorSpec(dtype, shape) of every tensor the engine loads (routed experts limited to `experts`)."""
    specs: dict[str, TensorSpec] = {}
    for w in weights(config, experts):
        specs.update(w.tensors(config.fp8_block))
    return specs


_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")
_VISION = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def expert_index(name: str) -> int:
    """Routed expert number of a tensor name (`layers.L.ffn.experts.E.…`), -1 if it is not a routed expert."""
    m = _EXPERT.match(name)
    return int(m.group(1)) if m else -1


def skip_reason(name: str, config: ModelConfig) -> str | None:
    """'mtp' or 'vision' for tensors of the parts mini recognises but does not run; None otherwise."""
    if name.startswith("mtp.") and not config.has_dspark:
        return "mtp"
    if not config.vision and (name.startswith(_VISION) or name.endswith(".ffn.gate.bias_vl")):
        return "vision"
    return None


def expert_range(config: ModelConfig, rank: int, world: int) -> range:
    """The routed experts EP rank `rank` of `world` holds: a contiguous, equal slice (as the reference splits)."""
    n = config.n_routed_experts
    if world < 1 or not 0 <= rank < world or n % world:
        raise ValueError(f"cannot split {n} experts over EP rank {rank} of {world}")
    per = n // world
    return range(rank * per, (rank + 1) * per)


# ---------------------------------------------------------------------- vision (V4.1 images, spec §2.8)
def _vision(c: ModelConfig) -> list[Weight]:
    """The ViT (patch embedding, blocks, final norm), the aligner and the span delimiters: all bf16, as released
    (official vision.py; the Linears carry biases, the MLP's do not)."""
    C, inter, D, r = c.vision_dim, c.vision_inter_dim, c.dim, c.vision_downsample_ratio
    w = [Weight("vision.patch_embed.proj.weight", "bf16", (C, 3 * c.vision_patch_size ** 2)),
         Weight("vision.patch_embed.proj.bias", "bf16", (C,))]
    for i in range(c.vision_n_layers):
        pre = f"vision.blocks.{i}."
        w += [Weight(pre + "norm1.weight", "bf16", (C,)), Weight(pre + "attn.wqkv.weight", "bf16", (3 * C, C)),
              Weight(pre + "attn.wqkv.bias", "bf16", (3 * C,)), Weight(pre + "attn.wo.weight", "bf16", (C, C)),
              Weight(pre + "attn.wo.bias", "bf16", (C,)), Weight(pre + "norm2.weight", "bf16", (C,)),
              Weight(pre + "mlp.w1.weight", "bf16", (2 * inter, C)), Weight(pre + "mlp.w2.weight", "bf16", (C, inter))]
    w += [Weight("vision.norm.weight", "bf16", (C,)),
          Weight("aligner.w1.weight", "bf16", (D, C * r * r)), Weight("aligner.w1.bias", "bf16", (D,)),
          Weight("aligner.w2.weight", "bf16", (D, D)), Weight("aligner.w2.bias", "bf16", (D,))]
    return w + [Weight(f"image_{k}", "bf16", (D,)) for k in ("start", "newline", "end")]


# ---------------------------------------------------------------------- one block
def _block(c: ModelConfig, i: int, experts: range | None) -> list[Weight]:
    p, D, hc = c.layers[i], c.dim, c.hc_mult
    pre = f"layers.{i}."
    w = [Weight(pre + "attn_norm.weight", "bf16", (D,)), Weight(pre + "ffn_norm.weight", "bf16", (D,))]
    for site in ("attn", "ffn"):
        w += [Weight(f"{pre}hc_{site}_fn", "f32", (c.hc_mix, hc * D)),
              Weight(f"{pre}hc_{site}_base", "f32", (c.hc_mix,)), Weight(f"{pre}hc_{site}_scale", "f32", (3,))]
    w += _attention(c, i, pre + "attn.")
    w += _moe(c, pre + "ffn.", experts, c.n_routed_experts, c.n_activated_experts, p.hash_routed)
    if p.engram:
        j = c.engram_layer_ids.index(i)
        w += [Weight(pre + "engram.embed.weight", "fp8_rows", (c.engram_num_embeddings[j], c.engram_head_dim)),
              Weight(pre + "engram.wkv.weight", "fp8", ((hc + 1) * D, c.n_hash_cols * c.engram_head_dim)),
              Weight(pre + "engram.q_weight", "bf16", (hc, D)), Weight(pre + "engram.k_weight", "bf16", (hc, D))]
    return w


def _attention(c: ModelConfig, i: int, pre: str) -> list[Weight]:
    p = c.layers[i]
    w = _window_attention(c, pre)
    idx_q = [Weight(pre + "indexer.wq_b.weight", "fp8", (c.index_n_heads * c.index_head_dim, c.q_lora_rank)),
             Weight(pre + "indexer.weights_proj.weight", "bf16", (c.index_n_heads, c.dim))]
    if c.is_v41:
        # only KV sources compress; ratio 1 is a plain projection (no gate)
        if p.owns_kv:
            w.append(Weight(pre + "compressor.wkv.weight", "bf16", (c.head_dim, c.dim)))
            if p.ratio > 1:
                w.append(Weight(pre + "compressor.wgate.weight", "bf16", (c.head_dim, c.dim)))
            w.append(Weight(pre + "compressor.norm.weight", "bf16", (c.head_dim,)))
        if p.runs_indexer:
            if p.owns_index_keys:  # index keys come from the compressor's latent
                w += [Weight(pre + "indexer.wk.weight", "bf16", (c.index_head_dim, c.head_dim)),
                      Weight(pre + "indexer.k_norm.weight", "bf16", (c.index_head_dim,))]
            w += idx_q
        return w
    # V4: every compressed layer compresses; ratio 4 overlaps two windows (2x wide) and runs an indexer with its
    # own compressor over index_head_dim
    if p.ratio:
        w += _v4_compressor(c, pre + "compressor.", p.ratio, c.head_dim)
    if p.runs_indexer:
        w += idx_q + _v4_compressor(c, pre + "indexer.compressor.", p.ratio, c.index_head_dim)
    return w


def _window_attention(c: ModelConfig, pre: str) -> list[Weight]:
    """What every attention has: projections, norms, sink (a window-only layer has nothing else)."""
    D, hd, H = c.dim, c.head_dim, c.n_heads
    return [Weight(pre + "attn_sink", "f32", (H,)),
         Weight(pre + "wq_a.weight", "fp8", (c.q_lora_rank, D)),
         Weight(pre + "q_norm.weight", "bf16", (c.q_lora_rank,)),
         Weight(pre + "wq_b.weight", "fp8", (H * hd, c.q_lora_rank)),
         Weight(pre + "wkv.weight", "fp8", (hd, D)),
         Weight(pre + "kv_norm.weight", "bf16", (hd,)),
         Weight(pre + "wo_a.weight", "fp8", (c.o_groups * c.o_lora_rank, H * hd // c.o_groups)),
         Weight(pre + "wo_b.weight", "fp8", (D, c.o_groups * c.o_lora_rank))]


def _v4_compressor(c: ModelConfig, pre: str, ratio: int, head_dim: int) -> list[Weight]:
    width = (2 if ratio == 4 else 1) * head_dim
    return [Weight(pre + "ape", "f32", (ratio, width)), Weight(pre + "wkv.weight", "bf16", (width, c.dim)),
            Weight(pre + "wgate.weight", "bf16", (width, c.dim)), Weight(pre + "norm.weight", "bf16", (head_dim,))]


def _moe(c: ModelConfig, pre: str, experts: range | None, E: int, k: int, hash_routed: bool) -> list[Weight]:
    D, inter = c.dim, c.moe_inter_dim
    w = [Weight(pre + "gate.weight", "bf16", (E, D))]
    if hash_routed:
        w.append(Weight(pre + "gate.tid2eid", "i64", (c.vocab_size, k)))
    else:
        w.append(Weight(pre + "gate.bias", "f32", (E,)))
        if c.is_v41 and c.vision:
            w.append(Weight(pre + "gate.bias_vl", "f32", (E,)))
    fmt = "mxfp4" if c.expert_dtype == "fp4" else "fp8"
    for e in experts if experts is not None else range(E):
        if not 0 <= e < E:
            raise ValueError(f"expert {e} out of range: the config has {E} routed experts")
        ep = f"{pre}experts.{e}."
        w += [Weight(ep + "w1.weight", fmt, (inter, D), e), Weight(ep + "w2.weight", fmt, (D, inter), e),
              Weight(ep + "w3.weight", fmt, (inter, D), e)]
    sh = inter * c.n_shared_experts
    w += [Weight(pre + "shared_experts.w1.weight", "fp8", (sh, D)),
          Weight(pre + "shared_experts.w2.weight", "fp8", (D, sh)),
          Weight(pre + "shared_experts.w3.weight", "fp8", (sh, D))]
    return w


# ---------------------------------------------------------------------- DSpark (V4.1 `mtp.*`)
def _dspark(c: ModelConfig) -> list[Weight]:
    """The draft stages (official DSparkBlock): each a block without compressor, indexer or Engram and with the
    draft MoE; stage 0 adds main_proj / main_norm (the target features -> D), the last one the final norm, the
    Markov head (rank r: an embedding and a head over the vocabulary) and the confidence head. The draft shares
    the model's embed and head, so the checkpoint has no copies of them."""
    D, hc, n = c.dim, c.hc_mult, c.n_mtp_layers
    out = []
    for s in range(n):
        pre = f"mtp.{s}."
        if s == 0:
            out += [Weight(pre + "main_proj.weight", "fp8", (D, len(c.dspark_target_layers) * D)),
                    Weight(pre + "main_norm.weight", "bf16", (D,))]
        out += [Weight(pre + "attn_norm.weight", "bf16", (D,)), Weight(pre + "ffn_norm.weight", "bf16", (D,))]
        for site in ("attn", "ffn"):
            out += [Weight(f"{pre}hc_{site}_fn", "f32", (c.hc_mix, hc * D)),
                    Weight(f"{pre}hc_{site}_base", "f32", (c.hc_mix,)), Weight(f"{pre}hc_{site}_scale", "f32", (3,))]
        out += _window_attention(c, pre + "attn.")
        out += _moe(c, pre + "ffn.", None, c.dspark_n_routed_experts, c.dspark_n_activated_experts, False)
        if s == n - 1:
            r = c.dspark_markov_rank
            out += [Weight(pre + "norm.weight", "bf16", (D,)),
                    Weight(pre + "markov_head.embed.weight", "bf16", (c.vocab_size, r)),
                    Weight(pre + "markov_head.head.weight", "bf16", (c.vocab_size, r)),
                    Weight(pre + "confidence_head.proj.weight", "bf16", (1, D + r))]
    return out
