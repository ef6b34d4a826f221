"""rank4-decode on the tiny model on the CPU (the real shape needs the H200); its floor and kernel split:
tests/tools/test_rank4_decode_floor.py."""
import argparse

import pytest
import torch

from mini.testing.suites import SuiteError, check_result
from mini.bench import rank4_decode as rd
from mini.config import preset

TINY = ["--preset", "tiny-v4.1", "--batch", "3,5", "--context", "20,70", "--steps", "2", "--warmup", "1",
        "--profile-steps", "1", "--device", "cpu", "--dtype", "float32", "--block-tokens", "16"]


def _args(extra=()):
    p = argparse.ArgumentParser()
    rd.add_args(p)
    return p.parse_args(TINY + list(extra))


def test_suite_runs_on_the_tiny_model_and_reports_every_field():
    result = check_result("rank4-decode", rd.run(_args()))
    m, d = result["metrics"], result["definition"]
    assert d["batch"] == [3, 5] and d["context"] == [20, 70] and d["graphs"] is False
    for B in (3, 5):
        for C in (20, 70):
            p = f"b{B}_c{C}."
            for k in ("ms_per_step", "tok_per_s_per_gpu", "touched_local_experts", "cache_gb", "eager_ms_per_step",
                      "stage_ms.routed_experts", "stage_ms.sparse_attention_core"):
                assert p + k in m, p + k
            assert p + "floor_ms" not in m  # the floor is the study's (tools/rank4_decode_floor.py)
            assert m[p + "tok_per_s_per_gpu"] == pytest.approx(B / (m[p + "ms_per_step"] / 1e3))
            # tiny-v4.1: 16 experts over EP4 -> 4 local per layer, 8 MoE layers
            assert 1 <= m[p + "touched_local_experts"] <= 32


def test_decode_run_fills_the_cache_and_advances_positions():
    """The cache holds B x (C + steps) tokens of random values, and every step moves the positions one on."""
    import mini.ops
    from mini.testing.emulated_ep import EmulatedEP
    from mini.testing.rank_model import rank_model
    from mini.checkpoint import expert_range
    cfg = preset("tiny-v4.1")
    ex = EmulatedEP(4, 0, "uniform", expert_range(cfg, 0, 4))
    with mini.ops.using_backend("reference"):
        model = rank_model(cfg, torch.device("cpu"), torch.float32, 0, expert_range(cfg, 0, 4), None, ex)
        r = rd.DecodeRun(model, cfg, ex, 2, 40, 5, 16, torch.device("cpu"), torch.float32, 0)
        assert r.blocks_per_seq == 3 and r.cache.comp_kv[2].shape[0] == 2 * 3 + 1
        assert all(float(t.abs().sum()) > 0 for t in r.cache.window)
        assert r.buffers.ids[1, :2].tolist() == [40, 40]
        r.fill()
        assert r.buffers.ids[1, :2].tolist() == [41, 41]
        out = r.replay()
        assert out.shape == (2, cfg.vocab_size) and torch.isfinite(out).all()


def test_a_run_built_for_verify_rows_fills_decode_steps():
    """tools/graph_capture_time.py builds its run at the widest verify width, then times decode replays (width 1):
    the fill hands the buffers one Engram row a sequence, not the verify step's (a 64-to-384 mismatch on the H100)."""
    import mini.ops
    from mini.testing.emulated_ep import EmulatedEP
    from mini.testing.rank_model import rank_model
    from mini.checkpoint import expert_range
    cfg = preset("tiny-v4.1")
    assert cfg.engram_layer_ids  # the failure needs the Engram rows
    ex = EmulatedEP(4, 0, "uniform", expert_range(cfg, 0, 4))
    with mini.ops.using_backend("reference"):
        model = rank_model(cfg, torch.device("cpu"), torch.float32, 0, expert_range(cfg, 0, 4), None, ex)
        r = rd.DecodeRun(model, cfg, ex, 3, 40, 12, 16, torch.device("cpu"), torch.float32, 0, 6)
        r.width = 1
        r.fill()
        out = r.model.forward(r.buffers.batch(3, 1, r.graphs.spans[0]), r.cache)
        assert out.shape == (3, cfg.vocab_size) and torch.isfinite(out).all()


def test_bad_lists_are_refused():
    with pytest.raises(SuiteError, match="--batch takes comma-separated integers"):
        rd.run(_args(["--batch", "a,b"]))
    with pytest.raises(SuiteError, match="--context needs positive integers"):
        rd.run(_args(["--context", "0"]))


def test_shapes_pick_pairs_instead_of_the_product():
    """--shapes measures exactly its BxC pairs (the targets' shapes in one build), not every batch x context pair;
    --width > 1 measures verify steps of that many rows per sequence."""
    result = check_result("rank4-decode", rd.run(_args(["--shapes", "5x20,3x70", "--profile-steps", "0"])))
    measured = {k.split(".")[0] for k in result["metrics"] if k.startswith("b")}
    assert measured == {"b5_c20", "b3_c70"}
    assert result["definition"]["shapes"] == ["5x20", "3x70"]
    verify = check_result("rank4-decode", rd.run(_args(["--shapes", "3x20", "--width", "3", "--profile-steps", "0"])))
    assert verify["definition"]["width"] == 3 and verify["metrics"]["b3_c20.ms_per_step"] > 0
    with pytest.raises(SuiteError, match="--width takes 1"):
        rd.run(_args(["--width", "0"]))
    for bad in ("5", "5x", "0x20", "ax20"):
        with pytest.raises(SuiteError, match="--shapes takes comma-separated BxC pairs"):
            rd.run(_args(["--shapes", bad]))
