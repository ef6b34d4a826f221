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


# ---------------------------------------------------------------------------------------------- modes (issue 13)
def test_uniform_mode_defines_the_workload_of_earlier_revisions():
    """The uniform mode's definition has exactly the keys it had before the modes (tools/bench_rev.py A/B)."""
    d = prefill.definition(_args())
    assert set(d) == {"preset", "tokens", "seqs", "ep", "dtype", "block_tokens", "engram_rows", "seed", "device"}
    assert d["engram_rows"] == prefill.DEVICE_ENGRAM_ROWS
    a = _args(["--mode", "realistic"])
    d = prefill.definition(a)
    assert (d["mode"], d["engram"], d["fresh_steps"], d["routing"]) == ("realistic", "host", True, "skewed")
    assert d["engram_rows"] == prefill.HOST_ENGRAM_ROWS and d["engram_rows_real"] == [6126, 6332]
    d = prefill.definition(_args(["--mode", "realistic", "--engram", "device", "--no-fresh-steps"]))
    assert "engram" not in d and "fresh_steps" not in d and d["routing"] == "skewed"


def test_rank4_realistic_mode_on_the_tiny_model(tmp_path):
    from mini.bench import main
    out = tmp_path / "r.json"
    assert main(["rank4", "--json", str(out), "--mode", "realistic", "--engram-rows", "1000",
                 "--engram-threads", "2"] + TINY) == 0
    res = json.loads(out.read_text())
    m, raw = res["metrics"], res["raw"]
    assert res["mode"] == "realistic" and res["definition"]["engram_rows"] == 1000
    for k in ("host_build_ms", "engram_gather_ms", "engram_host_wait_ms", "engram_wait_ms"):
        assert len(raw[k]) == 2 and m[f"{k}_median"] <= m[f"{k}_max"], k
    assert "engram_gpu_wait_ms" not in raw  # no CUDA stream on the CPU: nothing measured, nothing reported
    hd = preset("tiny-v4.1").engram_head_dim
    assert m["engram_gb"] == pytest.approx(2 * 1000 * (hd + hd // 32) / 1e9) and m["engram_pinned"] == 0
    assert len(raw["wall_step_ms"]) == 2 and m["wall_step_ms_median"] > 0


def test_uniform_mode_with_host_engram_looks_up_every_step():
    args = _args(["--engram", "host", "--engram-rows", "777"])
    r, setup_s = prefill.setup(args)
    try:
        assert r.fresh is None and r.prefetcher is not None
        first = r.batch
        res = prefill.measure(r, setup_s, args)
        pend = [s.engram for s in r.stats]
        assert len(pend) == 1 + 2 and len({id(p) for p in pend}) == 3  # one lookup per step (warm-up 1, steps 2)
        assert all(p.gather_ms is not None for p in pend)
        assert r.batch.layout(16, r.config.window_size) is first.layout(16, r.config.window_size)  # reused layout
        assert res["metrics"]["engram_wait_ms_median"] >= 0 and "host_build_ms" not in res["raw"]
    finally:
        r.prefetcher.close()


def test_fresh_steps_draw_new_prompts_of_the_same_lengths():
    r, _ = prefill.setup(_args(["--fresh-steps", "--seqs", "3", "--tokens", "30"]))
    seen = []
    for _ in range(3):
        b = r.batch
        seen.append(b.input_ids.tolist())
        assert b.lens_host == [10, 10, 10] and b._layouts  # the layout was built before the step
        r.step()
    assert len({tuple(s) for s in seen}) == 3
    assert all(s.build_ms is not None and s.build_ms > 0 for s in r.stats)


def test_a_fresh_batch_gives_the_reused_batchs_logits():
    """FreshSteps' build of given prompts (host build, then moved, layout made ahead) == prefill_batch's: the same
    logits, bit for bit; and with the Engram rows prefetched from host tables too."""
    from mini.model.engram_host import EngramPrefetcher
    args = _args()
    r, _ = prefill.setup(args)
    g = torch.Generator().manual_seed(11)
    tokens = [torch.randint(3, r.config.vocab_size, (n,), generator=g).tolist() for n in (17, 9)]
    batch, cache = prefill.prefill_batch(r.config, tokens, "cpu", torch.float32, 16, 1 << 20)
    want = r.model.forward(batch, cache)
    fresh = prefill.FreshSteps(r.config, [17, 9], "cpu", 16, 1 << 20, None, 0)
    assert torch.equal(r.model.forward(fresh.next(tokens), cache), want)
    r.model.engram_on_device = False  # tiny tables: in CPU memory either way
    pre = EngramPrefetcher([b.engram for b in r.model.blocks if b.engram is not None], "cpu", threads=2)
    try:
        fresh = prefill.FreshSteps(r.config, [17, 9], "cpu", 16, 1 << 20, pre, 0)
        batch = fresh.next(tokens)
        assert batch.engram.form == "pending"
        assert torch.equal(r.model.forward(batch, cache), want)
    finally:
        pre.close()


def test_host_tables_refused_when_the_host_lacks_the_memory(monkeypatch, capsys):
    from mini.bench import main
    monkeypatch.setattr(prefill, "host_memory_available", lambda: 20 << 30)
    assert main(["rank4", "--mode", "realistic"] + TINY) == 2
    assert "pass a smaller --engram-rows" in capsys.readouterr().err


def test_host_engram_tables_are_drawn_like_random_state():
    """Real row layout (fp8 values, one E8M0 scale per 32), values as random_state draws Engram rows: finite, each
    32-group's largest |value| fills the fp8 range (power-of-two scale), the dequantized rows ~ standard normal."""
    from mini.ops.engram import dequantize_rows
    cfg = preset("tiny-v4.1")
    tables, info = prefill.host_engram_tables(cfg, 3000, 0, "cpu")
    assert len(tables) == len(cfg.engram_layer_ids) and info["pinned"] is False  # no CUDA here
    for vals, scales in tables:
        assert vals.dtype == torch.float8_e4m3fn and vals.shape == (3000, cfg.engram_head_dim)
        assert scales.shape == (3000, cfg.engram_head_dim // 32)
        rows = dequantize_rows(vals.view(torch.uint8), scales.view(torch.uint8), torch.float32)
        assert torch.isfinite(rows).all() and abs(rows.std().item() - 1) < 0.05 and abs(rows.mean().item()) < 0.05
        top = vals.float().abs().unflatten(-1, (-1, 32)).amax(-1)
        assert (top >= 224).all() and (top <= 448).all()  # 448 / 2 < max |x| / scale <= 448, then rounded
    v2, _ = prefill.host_engram_tables(cfg, 3000, 0, "cpu")[0][0]
    assert torch.equal(v2.view(torch.uint8), tables[0][0].view(torch.uint8))  # fixed by the seed


def test_workloads_on_one_build(tmp_path):
    """python3 -m mini.bench.prefill --modes: three workloads on one build, one rank4 result each, defined as the
    separate runs define them; `configure` switches the Engram tables (device tables drawn at their row count,
    the host tables kept) and the routing."""
    from mini.bench import check_result
    assert prefill.main(TINY + ["--modes", "uniform,realistic,uniform_host", "--host-engram-rows", "500",
                                "--out", str(tmp_path)]) == 0
    for name in ("uniform", "realistic", "uniform_host"):
        res = check_result("rank4", json.loads((tmp_path / f"rank4_{name}.json").read_text()))
        alone = prefill.definition(_args(prefill.SAME_BUILD_MODES[name]
                                         + (["--engram-rows", "500"] if name != "uniform" else [])))
        assert res["definition"] == alone and res["raw"]["same_build"] == ["uniform", "realistic", "uniform_host"]
        assert ("engram_gb" in res["metrics"]) == (name != "uniform") and len(res["raw"]["step_ms"]) == 2
    r = prefill.build_rank(_args(["--engram", "host", "--engram-rows", "500"]))
    weights = [b.engram for b in r.model.blocks if b.engram is not None]
    # the build hands the prefetcher the host tables, not the model's stand-ins (on a GPU these are on the device
    # and the prefetcher refuses them: the H200 run at 56388c4 failed so)
    host_tables = r.tables["host"][1]
    assert all(w.embed is v and w.embed_scale is sc for w, (v, sc) in zip(r.host_prefetcher.tables, host_tables))
    prefill.configure(r, _args(["--engram-rows", "300", "--routing", "skewed"]))
    assert [w.embed.shape[0] for w in weights] == [300, 300] and r.model.engram_on_device and r.prefetcher is None
    assert r.exchange.routing == "skewed" and r.batch.engram.form == "ids"
    prefill.configure(r, _args(["--engram", "host", "--engram-rows", "500"]))
    assert [w.embed.shape[0] for w in weights] == [500, 500] and not r.model.engram_on_device
    assert r.exchange.routing == "uniform" and r.batch.engram.form == "pending"
    from mini.bench import SuiteError
    with pytest.raises(SuiteError, match="no host Engram tables of 600 rows"):
        prefill.configure(r, _args(["--engram", "host", "--engram-rows", "600"]))
    r.host_prefetcher.close()
    with pytest.raises(SystemExit):  # argparse's error: an unknown workload
        prefill.main(TINY + ["--modes", "uniform,fast", "--out", str(tmp_path)])
