"""transformers' DeepSeek-V4 port (`DeepseekV4ForCausalLM`) <-> the official DeepSeek checkpoint layout, for parity
tests of mini against transformers.

* `hf_config(cfg)`: a mini V4 ModelConfig as a transformers `DeepseekV4Config` (layer and MLP schedules, the two
  RoPE tables: plain base `rope_theta` for window-only layers, base `compress_rope_theta` + YaRN without mscale for
  compressed layers).
* `random_model(cfg, seed)`: a transformers model with unit-gain random weights. transformers initialises several
  parameters to constants (sinks, APE, mHC bias/scale, norm weights, router bias, hash table); those are randomised
  too, so that a convention mismatch on any of them shows up in the logits.
* `official_state(model, cfg)`: the model's weights under the official names (spec §4.2), quantized to the official
  formats: FP8 e4m3 + E8M0 `cfg.fp8_block`² block scales, MXFP4 routed experts, bf16, fp32, int64.
* `hf_state(official, cfg)`: the inverse, dequantized: what transformers must compute with so that both sides use
  identical weights. `quantize_model` does both and loads the result into the model.
* `write_checkpoint(official, cfg, dir)`: safetensors shards + index + config.json (`ModelConfig.to_hf()`), plus the
  tiny tokenizer mini's loader expects.

Name map (HF module path -> official path). The conventions behind each line were checked against the spec and the
official V4 `inference/model.py` (see the test module's docstring):

    model.embed_tokens / lm_head / model.norm          embed / head / norm                     bf16
    model.hc_head.hc_fn / hc_base / hc_scale           hc_head_fn / hc_head_base / hc_head_scale   f32
    layers.i.input_layernorm / post_attention_layernorm   attn_norm / ffn_norm                bf16
    layers.i.attn_hc.{fn,base,scale} / ffn_hc.*        hc_attn_{fn,base,scale} / hc_ffn_*      f32
    self_attn.sinks                                    attn.attn_sink                          f32
    self_attn.q_a_proj / q_a_norm / q_b_proj           attn.wq_a / q_norm / wq_b               fp8 / bf16 / fp8
    self_attn.kv_proj / kv_norm                        attn.wkv / kv_norm                      fp8 / bf16
    self_attn.o_a_proj / o_b_proj                      attn.wo_a / wo_b                        fp8 (same layout)
    self_attn.compressor.{kv_proj,gate_proj,kv_norm,position_bias}
                                                       attn.compressor.{wkv,wgate,norm,ape}     bf16 / f32 ape
    self_attn.compressor.indexer.{kv_proj,gate_proj,kv_norm,position_bias}
                                                       attn.indexer.compressor.{wkv,wgate,norm,ape}
    self_attn.compressor.indexer.q_b_proj              attn.indexer.wq_b                        fp8
    self_attn.compressor.indexer.scorer.weights_proj   attn.indexer.weights_proj                bf16
    mlp.gate.weight / e_score_correction_bias / tid2eid   ffn.gate.weight / bias / tid2eid     bf16 / f32 / i64
    mlp.experts.gate_up_proj[e] = [gate; up]           ffn.experts.e.w1 ; ffn.experts.e.w3     mxfp4
    mlp.experts.down_proj[e]                           ffn.experts.e.w2                        mxfp4
    mlp.shared_experts.{gate,up,down}_proj             ffn.shared_experts.{w1,w3,w2}           fp8
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from mini.config import ModelConfig
from mini.formats import dequant_fp8, dequant_mxfp4, quantize_fp8, quantize_mxfp4

LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}

# HF suffix -> (official suffix, format), global tensors
_GLOBAL = {
    "model.embed_tokens.weight": ("embed.weight", "bf16"),
    "lm_head.weight": ("head.weight", "bf16"),
    "model.norm.weight": ("norm.weight", "bf16"),
    "model.hc_head.hc_fn": ("hc_head_fn", "f32"),
    "model.hc_head.hc_base": ("hc_head_base", "f32"),
    "model.hc_head.hc_scale": ("hc_head_scale", "f32"),
}
_V4_COMPRESSOR = {"kv_proj.weight": ("wkv.weight", "bf16"), "gate_proj.weight": ("wgate.weight", "bf16"),
                  "kv_norm.weight": ("norm.weight", "bf16"), "position_bias": ("ape", "f32")}
# HF suffix inside `model.layers.{i}.` -> (official suffix inside `layers.{i}.`, format); routed experts aside
_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", "bf16"),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "bf16"),
    **{f"{hf}_hc.{p}": (f"hc_{off}_{p}", "f32") for hf, off in (("attn", "attn"), ("ffn", "ffn"))
       for p in ("fn", "base", "scale")},
    "self_attn.sinks": ("attn.attn_sink", "f32"),
    "self_attn.q_a_proj.weight": ("attn.wq_a.weight", "fp8"),
    "self_attn.q_a_norm.weight": ("attn.q_norm.weight", "bf16"),
    "self_attn.q_b_proj.weight": ("attn.wq_b.weight", "fp8"),
    "self_attn.kv_proj.weight": ("attn.wkv.weight", "fp8"),
    "self_attn.kv_norm.weight": ("attn.kv_norm.weight", "bf16"),
    "self_attn.o_a_proj.weight": ("attn.wo_a.weight", "fp8"),
    "self_attn.o_b_proj.weight": ("attn.wo_b.weight", "fp8"),
    **{f"self_attn.compressor.{k}": (f"attn.compressor.{v}", f) for k, (v, f) in _V4_COMPRESSOR.items()},
    **{f"self_attn.compressor.indexer.{k}": (f"attn.indexer.compressor.{v}", f)
       for k, (v, f) in _V4_COMPRESSOR.items()},
    "self_attn.compressor.indexer.q_b_proj.weight": ("attn.indexer.wq_b.weight", "fp8"),
    "self_attn.compressor.indexer.scorer.weights_proj.weight": ("attn.indexer.weights_proj.weight", "bf16"),
    "mlp.gate.weight": ("ffn.gate.weight", "bf16"),
    "mlp.gate.e_score_correction_bias": ("ffn.gate.bias", "f32"),
    "mlp.gate.tid2eid": ("ffn.gate.tid2eid", "i64"),
    "mlp.shared_experts.gate_proj.weight": ("ffn.shared_experts.w1.weight", "fp8"),
    "mlp.shared_experts.up_proj.weight": ("ffn.shared_experts.w3.weight", "fp8"),
    "mlp.shared_experts.down_proj.weight": ("ffn.shared_experts.w2.weight", "fp8"),
}
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


# ---------------------------------------------------------------------- config and model
def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV4Config

    if cfg.is_v41:
        raise ValueError("transformers' DeepseekV4 port covers V4 only")
    return DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=1, head_dim=cfg.head_dim,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.window_size,
        layer_types=[LAYER_TYPE[r] for r in cfg.compress_ratios],
        compress_rates={LAYER_TYPE[4]: 4, LAYER_TYPE[128]: 128},  # the only V4 ratios (ModelConfig.validate)
        mlp_layer_types=["hash_moe" if p.hash_routed else "moe" for p in cfg.layers],
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        # a flat dict is the "compress" table (YaRN, attention_factor forced to 1.0 = no mscale, as the reference);
        # window-only layers get the plain "main" table
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                         "beta_slow": cfg.beta_slow, "original_max_position_embeddings": cfg.original_seq_len},
        max_position_embeddings=cfg.max_position_embeddings, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, num_experts_per_tok=cfg.n_activated_experts,
        moe_intermediate_size=cfg.moe_inter_dim, scoring_func=cfg.score_func, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.route_scale, swiglu_limit=cfg.swiglu_limit, hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_norm_eps=cfg.norm_eps,
        num_nextn_predict_layers=0, tie_word_embeddings=False, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id)


@torch.no_grad()
def random_model(cfg: ModelConfig, seed: int):
    """fp32 DeepseekV4ForCausalLM with random weights at unit gain (every sub-layer contributes O(1) to the stream)."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(hf_config(cfg)).float().eval()
    g = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0):
        t.copy_(torch.randn(t.shape, generator=g) * std + mean)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            normal(p, 0.2, 1.0)
        elif leaf in ("sinks", "position_bias", "base", "hc_base"):
            normal(p, 1.0)
        elif leaf in ("scale", "hc_scale"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif name.endswith("embed_tokens.weight"):
            normal(p, 1.0)
        else:  # projections, mHC fn, experts: std 1/sqrt(fan_in)
            normal(p, p.shape[-1] ** -0.5)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):  # distinct experts per token
            scores = torch.rand(gate.tid2eid.shape[0], cfg.n_routed_experts, generator=g)
            gate.tid2eid.copy_(scores.argsort(-1)[:, : cfg.n_activated_experts])
        else:
            normal(gate.e_score_correction_bias, 0.1)
    return model


# ---------------------------------------------------------------------- formats
def encode(w: torch.Tensor, fmt: str, block: int) -> dict[str, torch.Tensor]:
    """One logical tensor -> its stored tensor(s): {'': data} or {'': data, 'scale': scale}."""
    if fmt == "bf16":
        return {"": w.to(torch.bfloat16).contiguous()}
    if fmt == "f32":
        return {"": w.float().contiguous()}
    if fmt == "i64":
        return {"": w.long().contiguous()}
    if fmt == "fp8":
        q, s = quantize_fp8(w, block)
        return {"": q, "scale": s.view(torch.float8_e8m0fnu)}
    if fmt == "mxfp4":
        q, s = quantize_mxfp4(w)
        return {"": q.view(torch.int8), "scale": s.view(torch.float8_e8m0fnu)}
    raise ValueError(f"unknown format {fmt!r}")


def decode(state: dict[str, torch.Tensor], name: str, fmt: str, block: int) -> torch.Tensor:
    """Stored tensor(s) of `name` (`X.weight`, scale in `X.scale`) -> fp32 (int64 for i64)."""
    w = state[name]
    if fmt in ("bf16", "f32"):
        return w.float()
    if fmt == "i64":
        return w.long()
    scale = state[_scale_name(name)]
    return dequant_fp8(w, scale, block) if fmt == "fp8" else dequant_mxfp4(w, scale)


def _scale_name(name: str) -> str:
    return name.removesuffix(".weight") + ".scale"


def _put(out: dict, name: str, stored: dict[str, torch.Tensor]):
    for k, t in stored.items():
        out[_scale_name(name) if k else name] = t


# ---------------------------------------------------------------------- name map
def _layer_index(hf_name: str) -> tuple[int, str]:
    _, _, i, rest = hf_name.split(".", 3)  # model.layers.{i}.rest
    return int(i), rest


def official_state(model, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's weights under official names and formats. Every HF tensor must be mapped (KeyError otherwise)."""
    out: dict[str, torch.Tensor] = {}
    block, inter = cfg.fp8_block, cfg.moe_inter_dim
    for name, w in model.state_dict().items():
        w = w.detach()
        if name in _GLOBAL:
            off, fmt = _GLOBAL[name]
            _put(out, off, encode(w, fmt, block))
            continue
        i, rest = _layer_index(name)
        pre = f"layers.{i}."
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, D]: gate rows first, then up rows (chunk(2) in HF)
            for e in range(w.shape[0]):
                _put(out, f"{pre}ffn.experts.{e}.w1.weight", encode(w[e, :inter], "mxfp4", block))
                _put(out, f"{pre}ffn.experts.{e}.w3.weight", encode(w[e, inter:], "mxfp4", block))
        elif rest == "mlp.experts.down_proj":  # [E, D, I]
            for e in range(w.shape[0]):
                _put(out, f"{pre}ffn.experts.{e}.w2.weight", encode(w[e], "mxfp4", block))
        else:
            off, fmt = _LAYER[rest]
            _put(out, pre + off, encode(w, fmt, block))
    return out


def hf_state(official: dict[str, torch.Tensor], model, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantized official tensors under the model's HF names (fp32; int64 hash table)."""
    block, out = cfg.fp8_block, {}
    for name in model.state_dict():
        if name in _GLOBAL:
            out[name] = decode(official, *_GLOBAL[name], block)
            continue
        i, rest = _layer_index(name)
        pre = f"layers.{i}.ffn.experts."
        n_exp = cfg.n_routed_experts
        if rest == "mlp.experts.gate_up_proj":
            out[name] = torch.stack([torch.cat([decode(official, f"{pre}{e}.w1.weight", "mxfp4", block),
                                                decode(official, f"{pre}{e}.w3.weight", "mxfp4", block)])
                                     for e in range(n_exp)])
        elif rest == "mlp.experts.down_proj":
            out[name] = torch.stack([decode(official, f"{pre}{e}.w2.weight", "mxfp4", block) for e in range(n_exp)])
        else:
            off, fmt = _LAYER[rest]
            out[name] = decode(official, f"layers.{i}.{off}", fmt, block)
    return out


@torch.no_grad()
def quantize_model(model, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Quantize the model's weights to the official formats, load the dequantized values back into the model (so it
    computes with exactly what the checkpoint holds) and return the official tensors."""
    official = official_state(model, cfg)
    missing, unexpected = model.load_state_dict(hf_state(official, model, cfg), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return official


# ---------------------------------------------------------------------- checkpoint files
def write_checkpoint(official: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                     n_shards: int = 2) -> Path:
    """The official on-disk layout: `model-0000k-of-0000n.safetensors` shards, `model.safetensors.index.json`,
    `config.json`; plus mini's tiny tokenizer (the loader wants one; no test here depends on its merges)."""
    from mini.checkpoint.tiny_tokenizer import write_tiny_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(official)
    per = math.ceil(len(names) / n_shards)
    weight_map, total = {}, 0
    for k in range(n_shards):
        shard = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: official[n].contiguous() for n in names[k * per:(k + 1) * per]}
        save_file(part, str(out_dir / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    write_tiny_tokenizer(out_dir, cfg.vocab_size)
    return out_dir
