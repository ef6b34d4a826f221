"""rank4 suite and the per-stage profiler, on the tiny model on the CPU (the real shape needs the H200)."""
import argparse
import json

import pytest
import torch

from mini.bench import check_result
from mini.bench import prefill
from mini.bench.profile import main as profile_main
from mini.checkpoint import random_state
from mini.config import preset
from mini.ops.moe import MoEWeights, moe

TINY = ["--preset", "tiny-v4.1", "--tokens", "24", "--seqs", "2", "--steps", "2", "--warmup", "1",
        "--device", "cpu", "--dtype", "float32", "--block-tokens", "16"]


def _args(extra=()):
    p = argparse.ArgumentParser()
    prefill.add_args(p)
    return p.parse_args(TINY + list(extra))


@pytest.fixture(scope="module")
def tiny_moe():
    cfg = preset("tiny-v4.1")
    return cfg, MoEWeights.from_state(random_state(cfg, seed=4), "layers.3.ffn", cfg, 3)


def test_emulated_ep_of_one_rank_is_the_plain_moe(tiny_moe):
    cfg, w = tiny_moe
    x, ids = torch.randn(9, cfg.dim), torch.randint(0, cfg.vocab_size, (9,))
    assert torch.equal(prefill.EmulatedEP(1, 0)(x, w, cfg, cfg.layers[3], ids), moe(x, w, cfg, cfg.layers[3], ids))


def test_emulated_ep_routes_synthetic_remote_rows_but_returns_own(tiny_moe):
    cfg, w = tiny_moe
    ep = prefill.EmulatedEP(4, 0)
    rows = ep.remote_rows(9, "cpu")
    assert rows.shape == (27,) and all(sorted(rows[i * 9:(i + 1) * 9].tolist()) == list(range(9)) for i in range(3))
    x, ids = torch.randn(9, cfg.dim), torch.randint(0, cfg.vocab_size, (9,))
    # all experts are local here, so the own rows must equal the single-rank result (rows are independent)
    torch.testing.assert_close(ep(x, w, cfg, cfg.layers[3], ids), moe(x, w, cfg, cfg.layers[3], ids),
                               rtol=1e-5, atol=1e-6)


def test_rank4_suite_on_the_tiny_model():
    res = check_result("rank4", prefill.run(_args()))
    m = res["metrics"]
    assert res["definition"]["tokens"] == 24 and len(res["raw"]["step_ms"]) == 2
    assert m["tok_per_s_per_gpu"] == pytest.approx(24 / (m["mean_step_ms"] / 1e3))
    assert m["min_step_ms"] <= m["median_step_ms"] <= m["max_step_ms"]


def test_profile_stages_add_up_to_the_step(tmp_path):
    assert profile_main(["--suite", "rank4", "--out", str(tmp_path), "--profile-steps", "1"] + TINY) == 0
    rep = json.loads((tmp_path / "profile.json").read_text())
    s = rep["stages_ms_per_step"]
    top = ["sparse_attention_core", "key_gathering", "indexer_topk", "other_attention", "gate", "routed_experts",
           "shared_expert", "ep_emulation", "communication", "hc_norm_other", "unattributed"]
    assert sum(s[k] for k in top) == pytest.approx(s["step"], rel=1e-9)
    assert all(s[k] > 0 for k in ("sparse_attention_core", "indexer_topk", "routed_experts", "gate", "hc_norm_other"))
    # the 5 % target is for the GPU report; on a shared CPU, preemption can land outside the timed stages
    assert abs(s["unattributed_fraction"]) < 0.10, s
    assert (tmp_path / "trace.json.gz").stat().st_size > 0
    suite = json.loads((tmp_path / "rank4.json").read_text())
    assert suite["suite"] == "rank4" and suite["metrics"]["mean_step_ms"] > 0


def test_a_sub_stage_counts_only_calls_inside_its_parent():
    """The routed experts' FP8 act quant is the same function every linear layer calls: only the calls made
    inside the routed stage may count as its part (else `routed.other` goes negative). Stages are named ranges
    (mini.ops.stages); without a recorder they only run the function."""
    from mini.bench.profile import StageTimer
    from mini.ops.stages import recording, stage, staged
    calls = []

    @staged("moe.routed.act_quant")
    def quant(x):
        calls.append(x)
        return x

    @staged("moe.routed")
    def routed(x):
        with stage("not.a.profiled.stage"):
            return quant(x) + 1

    assert routed(0) == 1 and calls == [0]
    timer = StageTimer(cuda=False, stages=("moe.routed", "moe.routed.act_quant"))
    with recording(timer):
        quant(1)  # a linear layer's quant: outside the parent
        routed(2)
        quant(3)
    routed(4)  # after the recorder is gone: not timed
    assert calls == [0, 1, 2, 3, 4]  # every call still runs
    assert {k: len(v) for k, v in timer.pending.items()} == {"moe.routed": 1, "moe.routed.act_quant": 1}
