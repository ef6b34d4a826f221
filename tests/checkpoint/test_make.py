"""make_checkpoint / random_state: the official file layout, determinism, weight scales, and activations that stay
in a sane range through every layer of the model."""
import hashlib
import json
import math

import pytest
import torch

from mini.checkpoint import expected_tensors, load_state, make_checkpoint, random_state, weights
from mini.config import ModelConfig, preset
from mini.formats import dequant_fp8, dequant_mxfp4


def _digests(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_layout_matches_the_official_one(tmp_path):
    cfg = preset("tiny-v4.1")
    ck = make_checkpoint(cfg, tmp_path / "ck", shard_bytes=400_000)
    shards = sorted(ck.glob("model-*.safetensors"))
    n = len(shards)
    assert n >= 4 and [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected_tensors(cfg))
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in expected_tensors(cfg).values())
    for s in shards:  # over the limit (+ its JSON header) only when a shard holds one weight (+ its scale)
        held = [n for n, f in index["weight_map"].items() if f == s.name]
        assert s.stat().st_size <= 400_000 + 20_000 or len(held) <= 2
    hf = json.loads((ck / "config.json").read_text())
    assert hf["model_type"] == "deepseek_v41" and hf["text_config"]["hidden_size"] == cfg.dim
    assert ModelConfig.load(ck) == cfg
    gen = json.loads((ck / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (cfg.bos_id, cfg.eos_id)
    from mini.tokenizer import Tokenizer
    assert len(Tokenizer.from_dir(ck)) == cfg.vocab_size


def test_deterministic_for_a_seed(tmp_path):
    a = make_checkpoint("tiny-v4", tmp_path / "a", seed=7, shard_bytes=1_000_000)
    b = make_checkpoint("tiny-v4", tmp_path / "b", seed=7, shard_bytes=1_000_000)
    c = make_checkpoint("tiny-v4", tmp_path / "c", seed=8, shard_bytes=1_000_000)
    assert _digests(a) == _digests(b)
    da, dc = _digests(a), _digests(c)
    assert all(da[f] != dc[f] for f in da if f.startswith("model-"))


def test_expert_subset_draws_the_same_experts():
    cfg = preset("tiny-v4.1")
    full, sub = random_state(cfg, seed=2), random_state(cfg, seed=2, experts=range(12, 16))
    assert set(sub) == set(expected_tensors(cfg, range(12, 16)))
    for name, t in sub.items():
        assert torch.equal(t.view(torch.uint8), full[name].view(torch.uint8)), name


def test_engram_rows_cap():
    cfg = preset("tiny-v4.1")
    state = random_state(cfg, engram_rows=100)
    assert state["layers.1.engram.embed.weight"].shape == (100, cfg.engram_head_dim)
    assert state["layers.2.engram.embed.scale"].shape == (100, cfg.engram_head_dim // 32)
    assert state["layers.1.engram.wkv.weight"].shape == expected_tensors(cfg)["layers.1.engram.wkv.weight"].shape


@pytest.mark.parametrize("name", ["tiny-v4.1", "tiny-v4"])
def test_weight_scales(name):
    cfg = preset(name)
    state = random_state(cfg, seed=4)
    hc = cfg.hc_mult
    for w in weights(cfg):
        t = state[w.name]
        around_one = w.name.endswith(("norm.weight", "q_weight", "k_weight"))
        if w.fmt in ("fp8", "mxfp4") or (w.fmt == "bf16" and len(w.shape) == 2 and w.name != "embed.weight"
                                          and not around_one):
            if w.fmt == "fp8":
                dense = dequant_fp8(t, state[w.scale_name], cfg.fp8_block)
            elif w.fmt == "mxfp4":
                dense = dequant_mxfp4(t, state[w.scale_name])
            else:
                dense = t.float()
            gain = 1 / math.sqrt(cfg.n_layers) if w.name.endswith(("attn.wo_b.weight", ".w2.weight")) else 1.0
            # unit-RMS inputs give unit-RMS outputs (times the residual gain); FP4 rounding adds ~10% noise
            assert 0.85 < dense.std().item() * math.sqrt(w.shape[1]) / gain < 1.2, w.name
        elif around_one:
            assert abs(t.float().mean().item() - 1) < 0.05, w.name
        elif w.name.endswith(("_base", "hc_head_base")):
            pre = torch.sigmoid(t[:hc])
            assert (pre - 1 / hc).abs().max() < 0.1, w.name
            if t.numel() > hc:
                assert (2 * torch.sigmoid(t[hc:2 * hc]) - 1).abs().max() < 0.25, w.name
                comb = torch.softmax(t[2 * hc:].view(hc, hc), dim=-1)
                assert (comb.diagonal() > 0.5).all(), w.name
        elif w.name.endswith("tid2eid"):
            assert t.min() >= 0 and t.max() < cfg.n_routed_experts
            assert (t.sort(-1).values.diff(dim=-1) > 0).all()  # distinct experts per token
        elif w.name.endswith(("attn_sink", "gate.bias")):
            assert t.abs().max() < 0.5, w.name
    fn = state["layers.0.hc_attn_fn"]  # mixes of a unit-RMS stream have unit variance
    x = torch.randn(2000, fn.shape[1])
    assert 0.8 < (x @ fn.T).std().item() < 1.2


@pytest.mark.parametrize("name", ["tiny-v4.1", "tiny-v4"])
def test_activations_stay_sane_through_every_layer(name, tmp_path, monkeypatch):
    from mini.model.batch import Batch, SeqChunk
    from mini.model.cache import KVCache
    from mini.model.model import Model
    from mini.ops import mhc
    from mini.ops.engram import EngramHasher
    from mini.tokenizer import load_token_map

    cfg = preset(name)
    ck = make_checkpoint(cfg, tmp_path / name)
    model = Model(cfg, load_state(ck, cfg, progress=False), "cpu", torch.float32)
    seen, expand = [], mhc.expand

    def recording_expand(f, h, post, comb):
        out = expand(f, h, post, comb)
        seen.append((f.float().pow(2).mean().sqrt().item(), out.float().pow(2).mean().sqrt().item()))
        return out

    monkeypatch.setattr(mhc, "expand", recording_expand)
    hasher = EngramHasher(cfg, load_token_map(ck)) if cfg.engram_layer_ids else None
    tokens = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = KVCache(cfg, n_slots=1, n_blocks=3, block_tokens=128, device="cpu", dtype=torch.float32)
    logits = model.forward(Batch.build([SeqChunk(tokens, 0, 0, [0, 1, 2])], cfg, "cpu", hasher=hasher), cache)
    assert len(seen) == 2 * cfg.n_layers
    for site, (sublayer, stream) in enumerate(seen):
        assert 0.02 < sublayer < 3 and 0.5 < stream < 3, (site, sublayer, stream)
    assert torch.isfinite(logits).all() and 0.3 < logits.std().item() < 3


@pytest.mark.gpu
def test_random_state_on_gpu_at_real_shape():
    import time
    cfg = preset("v4.1-flash")
    experts = range(0, 8)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    state = random_state(cfg, "cuda", seed=0, experts=experts, engram_rows=1 << 16)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    specs = expected_tensors(cfg, experts)
    assert set(state) == set(specs)
    for name, t in state.items():
        assert t.is_cuda and t.dtype == specs[name].dtype, name
        if ".engram.embed." not in name:
            assert tuple(t.shape) == specs[name].shape, name
    print(f"random_state(v4.1-flash, 8 experts/layer) on GPU: {seconds:.1f} s")
