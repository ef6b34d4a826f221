"""load_model: presets become a random checkpoint made once; draft and vision weights are skipped with a log line."""
import logging

import pytest
import torch

import mini.model.load as load
from mini.checkpoint.make import random_state
from mini.config import preset
from mini.model import Batch, KVCache, Model, SeqChunk, load_model


def test_preset_checkpoint_is_made_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "CACHE_DIR", tmp_path)
    model, cfg, tok = load_model("tiny-v4.1", dtype=torch.float32)
    assert cfg == preset("tiny-v4.1") and model.hasher is not None
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == ["tiny-v4.1-seed0"]
    stamp = (tmp_path / made[0] / "config.json").stat().st_mtime_ns
    again, _, _ = load_model(tmp_path / made[0], dtype=torch.float32)  # a directory path works too
    assert (tmp_path / made[0] / "config.json").stat().st_mtime_ns == stamp
    ids = tok.encode("the quick brown fox", add_bos=True)
    batch = Batch.build([SeqChunk(ids, 0, 0, [0])], cfg, "cpu", model.hasher)
    a = model.forward(batch, KVCache(cfg, 1, 1, 32, "cpu", torch.float32))
    b = again.forward(batch, KVCache(cfg, 1, 1, 32, "cpu", torch.float32))
    assert torch.equal(a, b) and torch.isfinite(a).all()


def test_draft_and_vision_weights_are_skipped_with_one_log_line(caplog):
    cfg = preset("tiny-v4")
    state = random_state(cfg)
    state["mtp.0.attn.wkv.weight"] = torch.zeros(2, 2)
    state["mtp.0.e_proj.weight"] = torch.zeros(2, 2)
    state["vision.blocks.0.wqkv.weight"] = torch.zeros(2, 2)
    with caplog.at_level(logging.INFO, logger="mini.model.model"):
        Model(cfg, state, "cpu", torch.float32)
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "2 MTP/DSpark draft" in lines[0] and "1 vision" in lines[0]


def test_engram_tables_go_to_the_device_up_to_a_size_limit():
    """Tables of at most engram_device_bytes (all layers, values and scales) move to the device and the model can
    hash there; one byte over the limit (V4.1-Flash: ~200 GB, far over the default) and they stay on the host."""
    from mini.ops.engram import EngramHasher
    from mini.checkpoint.tiny_tokenizer import build_tiny_tokenizer
    from mini.tokenizer import compressed_token_map
    cfg = preset("tiny-v4.1")
    state = random_state(cfg)
    tables = sum(t.numel() * t.element_size() for n, t in state.items() if ".engram.embed." in n)
    assert 0 < tables < 1 << 30  # the tiny model's fit under the default limit
    assert Model(cfg, dict(state), "cpu", torch.float32).engram_on_device
    hasher = EngramHasher(cfg, compressed_token_map(build_tiny_tokenizer(cfg.vocab_size)))
    window = torch.tensor([[-1, -1, 5], [7, 8, 9]])
    for limit, on_device in ((tables, True), (tables - 1, False)):
        model = Model(cfg, dict(state), "cpu", torch.float32, engram_device_bytes=limit)
        model.hasher = hasher
        assert model.engram_on_device == on_device
        if on_device:
            got = model.hash_on_device(window, torch.tensor([11, 12]))
            assert torch.equal(got, hasher.hash_last(torch.cat([window, torch.tensor([[11], [12]])], 1).numpy()))
        else:
            with pytest.raises(ValueError, match="tables"):
                model.hash_on_device(window, torch.tensor([11, 12]))
    assert not Model(preset("tiny-v4"), random_state(preset("tiny-v4")), "cpu", torch.float32).engram_on_device
