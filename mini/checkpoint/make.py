"""Random checkpoints in the official layout, and the same random weights directly in memory on any device.

Every weight is drawn from its own generator, seeded by (seed, tensor name): a checkpoint is deterministic for a
seed, and an EP subset draws exactly the experts the full model has. Values are scaled so that activations stay
in a sane range through every layer:

* projections: N(0, 1/fan_in), so a unit-RMS input gives a unit-RMS output; the output projections that feed the
  residual stream (`attn.wo_b`, expert `w2`) are further scaled by 1/sqrt(n_layers);
* mHC: `hc_*_fn` ~ N(0, 1/(hc*D)) (unit-variance mixes), `hc_*_scale` ~ 0.5, `hc_*_base` such that pre ~ 1/hc,
  post ~ 1 and comb ~ a softened identity;
* norms and Engram q/k weights ~ 1, attention sinks and gate biases ~ 0, embeddings ~ N(0, 1);
* FP8 weights are quantized with `mini.formats.quantize_fp8`, routed experts with `quantize_mxfp4`.

`make_checkpoint` draws on the CPU shard by shard; `random_state` draws on `device` without a host round trip
(CPU and CUDA generators differ, so a GPU state is a different — equally valid — random model).
"""
from __future__ import annotations

import json
import math
import zlib
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from mini.checkpoint.inventory import Weight, weights
from mini.checkpoint.load import INDEX_FILE
from mini.config import ModelConfig, preset
from mini.formats import float_to_e8m0, pow2_ceil_scale, quantize_fp8, quantize_mxfp4
from mini.formats.fp8 import FP8_MAX, to_e4m3

DEFAULT_SHARDS = 4  # shard_bytes=None splits the checkpoint into about this many shards
_CHUNK_ELEMENTS = 1 << 26  # large tensors are drawn in row chunks of at most this many fp32 values


def make_checkpoint(config_or_preset: ModelConfig | str, out_dir: str | Path, seed: int = 0,
                    shard_bytes: int | None = None, progress: bool = False, tokenizer: bool = True) -> Path:
    """Write `model-0000N-of-0000M.safetensors` shards (each at most `shard_bytes`, unless one weight is larger;
    None: about DEFAULT_SHARDS shards), `model.safetensors.index.json`, `config.json`, `generation_config.json`
    and (unless `tokenizer=False`, for vocabularies the tiny tokenizer cannot cover) the tiny tokenizer into
    `out_dir`. The DSpark stages (`mtp.*`) and the vision tower are written when the config has them.
    Returns `out_dir`."""
    config = preset(config_or_preset) if isinstance(config_or_preset, str) else config_or_preset
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(config, shard_bytes)
    n, weight_map, total = len(shards), {}, 0
    bar = tqdm(total=checkpoint_bytes(config), unit="B", unit_scale=True, desc=f"writing {out.name}",
               disable=None if progress is None else not progress)  # None: a bar on a terminal only
    with bar:
        for k, group in enumerate(shards, start=1):
            file = f"model-{k:05d}-of-{n:05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            with _one_cpu_thread():
                for w in group:
                    drawn = _draw(w, config, seed, torch.device("cpu"))
                    tensors.update(drawn)
                    bar.update(sum(t.numel() * t.element_size() for t in drawn.values()))
            save_file(tensors, out / file, metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_id, "eos_token_id": config.eos_id, "do_sample": True,
                  "temperature": 1.0, "top_p": 1.0}  # the model card's recommended sampling
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer:
        from mini.checkpoint.tiny_tokenizer import write_tiny_tokenizer  # lazy: the tokenizer pulls in `tokenizers`
        write_tiny_tokenizer(out, config.vocab_size)
    return out


def checkpoint_bytes(config: ModelConfig) -> int:
    """Bytes of the weights `make_checkpoint` writes for `config` (the shards, without their small headers)."""
    return sum(s.nbytes for w in weights(config) for s in w.tensors(config.fp8_block).values())


def random_state(config: ModelConfig, device: str | torch.device = "cpu", seed: int = 0,
                 experts: range | None = None, engram_rows: int | None = None) -> dict[str, torch.Tensor]:
    """The state dict `load_state` would return for a random checkpoint, drawn directly on `device`.

    `experts` keeps only those routed experts (an EP rank). `engram_rows` caps the rows of each Engram table
    (V4.1-Flash's have 384M rows = 98 GB each): the shapes then differ from the inventory's, and the model must
    take hash ids modulo the table's rows. On the CPU the result equals `load_state` of `make_checkpoint` with
    the same seed (for the same expert range; engram_rows=None)."""
    device = torch.device(device)
    state: dict[str, torch.Tensor] = {}
    with _one_cpu_thread() if device.type == "cpu" else nullcontext():
        for w in weights(config, experts):
            rows = min(w.shape[0], engram_rows) if (engram_rows is not None and w.fmt == "fp8_rows") else None
            state.update(_draw(w, config, seed, device, rows))
    return state


@contextmanager
def _one_cpu_thread():
    """Draw CPU weights on one thread: they are many small tensors, for which OpenMP fan-out costs more than it
    saves (on a busy 2-core machine, 40x more)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------- shards
def _plan_shards(config: ModelConfig, shard_bytes: int | None) -> list[list[Weight]]:
    """Consecutive weights (a weight and its scale stay together) packed greedily up to `shard_bytes`."""
    ws = weights(config)
    sizes = [sum(s.nbytes for s in w.tensors(config.fp8_block).values()) for w in ws]
    limit = shard_bytes or -(-sum(sizes) // DEFAULT_SHARDS)
    shards: list[list[Weight]] = [[]]
    used = 0
    for w, size in zip(ws, sizes):
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(w)
        used += size
    return shards


# ---------------------------------------------------------------------- one weight
def _draw(w: Weight, c: ModelConfig, seed: int, device: torch.device, rows: int | None = None
          ) -> dict[str, torch.Tensor]:
    """The stored tensor(s) of one weight, drawn from a generator seeded by (seed, name)."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 0x9E3779B1 + zlib.crc32(w.name.encode())) % 2**63)
    shape = w.shape if rows is None else (rows, *w.shape[1:])
    if w.fmt == "i64":  # V4 tid2eid: n_activated distinct experts per token id
        order = torch.rand(shape[0], c.n_routed_experts, generator=gen, device=device).argsort(dim=-1)
        return {w.name: order[:, : shape[1]].contiguous()}
    # draw big tensors in row chunks (a multiple of every FP8 block) to bound the fp32 scratch
    step = max(128, _CHUNK_ELEMENTS // max(1, math.prod(shape[1:])) // 128 * 128)
    parts = [_encode(w, _values(w, c, (min(step, shape[0] - r0), *shape[1:]), gen, device), c.fp8_block)
             for r0 in range(0, max(shape[0], 1), step)]  # one (possibly empty) chunk at least
    return {name: torch.cat([p[name] for p in parts]) if len(parts) > 1 else parts[0][name] for name in parts[0]}


def _values(w: Weight, c: ModelConfig, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    """fp32 values of (a row chunk of) weight `w`."""
    name = w.name.rsplit(".", 1)[0] if w.name.endswith(".weight") else w.name
    leaf = name.rsplit(".", 1)[-1]
    noise = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return noise / math.sqrt(shape[1])
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return 0.5 + 0.05 * noise
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        return _hc_base(c.hc_mult, shape[0], device) + 0.1 * noise
    if leaf.endswith("norm") or leaf in ("norm1", "norm2", "q_weight", "k_weight"):  # norm1/2: the ViT blocks'
        return 1.0 + 0.05 * noise
    if leaf in ("attn_sink", "ape"):
        return 0.1 * noise
    if leaf in ("bias", "bias_vl"):
        return 0.02 * noise
    if name == "embed" or w.fmt == "fp8_rows" or name.startswith("image_"):  # token, Engram, image delimiters
        return noise
    gain = 1 / math.sqrt(c.n_layers) if name.endswith(("attn.wo_b", ".w2")) else 1.0
    return noise * (gain / math.sqrt(shape[1]))


def _hc_base(hc: int, n: int, device) -> torch.Tensor:
    """Biases of the mHC mixes [pre (hc) | post (hc) | comb (hc*hc)]: sigmoid(pre) = 1/hc, 2*sigmoid(post) = 1,
    comb rows softmax to ~0.7 on the diagonal. An HC head (V4) has only the pre part."""
    base = torch.zeros(n, device=device)
    base[:hc] = -math.log(hc - 1)
    if n > 2 * hc:
        base[2 * hc:] = 2.0 * torch.eye(hc, device=device).flatten()
    return base


def _encode(w: Weight, x: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """Store fp32 values in the weight's checkpoint format."""
    if w.fmt == "bf16":
        return {w.name: x.to(torch.bfloat16)}
    if w.fmt == "f32":
        return {w.name: x}
    if w.fmt == "fp8":
        q, s = quantize_fp8(x, block)
    elif w.fmt == "fp8_rows":  # one power-of-two scale per row per `block` channels
        g = x.unflatten(-1, (-1, block))
        scale = pow2_ceil_scale(g.abs().amax(-1).clamp_min(1e-30) / FP8_MAX)
        q, s = to_e4m3(g / scale.unsqueeze(-1)).flatten(-2), float_to_e8m0(scale)
    elif w.fmt == "mxfp4":
        packed, s = quantize_mxfp4(x)
        q = packed.view(torch.int8)
    else:
        raise ValueError(f"cannot draw weight {w.name} of format {w.fmt}")
    return {w.name: q, w.scale_name: s.view(torch.float8_e8m0fnu)}

