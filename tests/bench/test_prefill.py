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


def test_skewed_routing_has_the_documented_load_shape():
    """RoutingSkew at rank4's shape (V4.1-Flash: 384 experts, k 6, 4 x 4,096 rows, this rank holding 0..95): hot
    experts at ~2.5 x the mean, the busiest at 2.4-3.0 x, this rank ~1.07 x its even share (docstring figures)."""
    local, E = range(96), 384
    for layer in (0, 17, 39):
        ids = prefill.SKEW.draw(16384, 6, E, local, 4, 0, layer)
        assert ids.shape == (16384, 6)
        assert all(len(set(r)) == 6 for r in ids[:512].tolist())  # k distinct experts per row
        c = torch.bincount(ids.flatten(), minlength=E).double()
        p = prefill.SKEW.probabilities(E, local, 4, 0, layer)
        hot = p > p.min()
        assert int(hot.sum()) == 48 and int(hot[:96].sum()) == 16
        assert p.sum().item() == pytest.approx(1.0) and (p.max() / p.mean()).item() == pytest.approx(2.5)
        assert 2.4 <= (c.max() / c.mean()).item() <= 3.0
        assert 2.3 <= (c[hot].mean() / c.mean()).item() <= 2.6
        assert 1.04 <= (c[:96].sum() / c.sum() * 4).item() <= 1.10
    # fixed: the same draw every time; the hot set moves between layers
    assert torch.equal(prefill.SKEW.draw(64, 6, E, local, 4, 0, 3), prefill.SKEW.draw(64, 6, E, local, 4, 0, 3))
    assert not torch.equal(prefill.SKEW.probabilities(E, local, 4, 0, 0), prefill.SKEW.probabilities(E, local, 4, 0, 1))


def test_uniform_routing_is_the_gate_over_all_rows_as_before(tiny_moe):
    """The gate now runs over the own rows only and the remote rows take their copies' routing: the same ids and
    weights as gating all rows (what rank4 did before), so the same pairs per expert, and the same output."""
    from mini.ops.moe import gate, routed, shared
    cfg, w = tiny_moe
    plan = cfg.layers[3]
    g = torch.Generator().manual_seed(5)
    x, ids = torch.randn(13, cfg.dim, generator=g), torch.randint(0, cfg.vocab_size, (13,), generator=g)
    ep = prefill.EmulatedEP(4, 0)
    rows = ep.remote_rows(13, "cpu")
    x_old, ids_old = torch.cat([x, x[rows]]), torch.cat([ids, ids[rows]])
    weights_before, ids_before = gate(x_old, w, cfg, plan, ids_old)
    x_all, weights_now, ids_now = ep.route(x, w, cfg, plan, ids)
    assert torch.equal(x_all, x_old) and torch.equal(ids_now, ids_before)
    torch.testing.assert_close(weights_now, weights_before, rtol=1e-6, atol=0)
    ep.recording = True
    out = ep(x, w, cfg, plan, ids)
    assert ep.pairs[3].tolist() == torch.bincount(ids_before.flatten(), minlength=cfg.n_routed_experts).tolist()
    before = (routed(x_old, w, cfg, weights_before, ids_before)[:13] + shared(x, w)).to(x.dtype)
    torch.testing.assert_close(out, before, rtol=1e-6, atol=1e-7)


def test_skewed_routing_replaces_the_gates_ids_only(tiny_moe):
    cfg, w = tiny_moe
    x, ids = torch.randn(9, cfg.dim), torch.randint(0, cfg.vocab_size, (9,))
    uni, skew = prefill.EmulatedEP(4, 0), prefill.EmulatedEP(4, 0, "skewed", range(0, 4))
    xu, wu, _ = uni.route(x, w, cfg, cfg.layers[3], ids)
    xs, ws, ids_s = skew.route(x, w, cfg, cfg.layers[3], ids)
    assert torch.equal(xu, xs) and torch.equal(wu, ws)
    assert torch.equal(ids_s, prefill.SKEW.draw(36, cfg.n_activated_experts, cfg.n_routed_experts, range(0, 4), 4,
                                                0, 3))
    with pytest.raises(ValueError, match="routing 'zipf'"):
        prefill.EmulatedEP(4, 0, "zipf")


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_rank4_records_routing_and_pairs_per_local_expert(routing, tmp_path):
    from mini.bench import main
    out = tmp_path / "r.json"
    assert main(["rank4", "--json", str(out), "--routing", routing, "--ep", "4"] + TINY) == 0
    res = json.loads(out.read_text())
    m, raw = res["metrics"], res["raw"]["pairs_per_local_expert"]
    assert res["definition"].get("routing", "uniform") == routing  # uniform: the key of older revisions' workload
    cfg = preset("tiny-v4.1")
    moe_layers = [p.layer for p in cfg.layers]
    assert sorted(map(int, raw)) == moe_layers and all(len(v) == 4 for v in raw.values())  # 16 / 4 local experts
    flat = sorted(n for v in raw.values() for n in v)
    assert (m["pairs_per_local_expert_min"], m["pairs_per_local_expert_max"]) == (flat[0], flat[-1])
    assert m["pairs_per_local_expert_min"] <= m["pairs_per_local_expert_median"] <= m["pairs_per_local_expert_max"]
    assert 0 < sum(flat) <= len(moe_layers) * 24 * 4 * cfg.n_activated_experts  # 24 own + 72 remote rows
    assert set(res["env"]["backends"]) >= {"ops", "moe_gemm", "sparse_attn"}


def test_rank4_refuses_a_forced_library_it_cannot_run(monkeypatch, capsys):
    from mini.bench import main
    from mini.ops import backends
    import mini.kernels.humming_experts as humming
    monkeypatch.setenv("MINI_MOE_GEMM", "humming")
    monkeypatch.setattr(backends, "_libraries", {})
    monkeypatch.setattr(humming, "available", lambda: False)  # also where the wheel is installed
    assert main(["rank4"] + TINY) == 2
    err = capsys.readouterr().err
    assert "MINI_MOE_GEMM=humming, but humming does not import" in err
    if not torch.cuda.is_available():
        assert "no CUDA device" in err


def test_rank4_refuses_a_step_that_bypasses_the_emulation():
    from mini.bench import SuiteError
    args = _args()
    r, setup_s = prefill.setup(args)
    r.model.moe_exchange = None  # the plain MoE: no EP rank's step
    with pytest.raises(SuiteError, match="no MoE layer ran through the EP emulation"):
        prefill.measure(r, setup_s, args)


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
