"""rank4 suite (mini/bench/rank4.py) and the per-stage profiler, on the tiny model on the CPU (the real shape needs
the H200)."""
import argparse
import json

import pytest
import torch

from mini.testing.suites import check_result
from mini.bench import rank4
from mini.bench.profile import main as profile_main
from mini.config import preset
from mini.testing.rank_model import prefill_batch
from mini.testing.rank_step import FreshSteps

TINY = ["--preset", "tiny-v4.1", "--tokens", "24", "--seqs", "2", "--steps", "2", "--warmup", "1",
        "--device", "cpu", "--dtype", "float32", "--block-tokens", "16"]


def _args(extra=()):
    p = argparse.ArgumentParser()
    rank4.add_args(p)
    return p.parse_args(TINY + list(extra))


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
    from mini.testing.suites import SuiteError
    args = _args()
    r, setup_s = rank4.setup(args)
    r.model.moe_exchange = None  # the plain MoE: no EP rank's step
    with pytest.raises(SuiteError, match="no MoE layer ran through the EP emulation"):
        rank4.measure(r, setup_s, args)


def test_rank4_suite_on_the_tiny_model():
    res = check_result("rank4", rank4.run(_args()))
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
    from mini.testing.stage_times import StageTimer
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
    d = rank4.definition(_args())
    assert set(d) == {"preset", "tokens", "seqs", "ep", "dtype", "block_tokens", "engram_rows", "seed", "device"}
    assert d["engram_rows"] == rank4.DEVICE_ENGRAM_ROWS
    a = _args(["--mode", "realistic"])
    d = rank4.definition(a)
    assert (d["mode"], d["engram"], d["fresh_steps"], d["routing"]) == ("realistic", "host", True, "skewed")
    assert d["engram_rows"] == rank4.HOST_ENGRAM_ROWS and d["engram_rows_real"] == [6126, 6332]
    d = rank4.definition(_args(["--mode", "realistic", "--engram", "device", "--no-fresh-steps"]))
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
    r, setup_s = rank4.setup(args)
    try:
        assert r.fresh is None and r.prefetcher is not None
        first = r.batch
        res = rank4.measure(r, setup_s, args)
        pend = [s.engram for s in r.stats]
        assert len(pend) == 1 + 2 and len({id(p) for p in pend}) == 3  # one lookup per step (warm-up 1, steps 2)
        assert all(p.gather_ms is not None for p in pend)
        assert r.batch.layout(16, r.config.window_size) is first.layout(16, r.config.window_size)  # reused layout
        assert res["metrics"]["engram_wait_ms_median"] >= 0 and "host_build_ms" not in res["raw"]
    finally:
        r.prefetcher.close()


def test_fresh_steps_draw_new_prompts_of_the_same_lengths():
    r, _ = rank4.setup(_args(["--fresh-steps", "--seqs", "3", "--tokens", "30"]))
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
    r, _ = rank4.setup(args)
    g = torch.Generator().manual_seed(11)
    tokens = [torch.randint(3, r.config.vocab_size, (n,), generator=g).tolist() for n in (17, 9)]
    batch, cache = prefill_batch(r.config, tokens, "cpu", torch.float32, 16, 1 << 20)
    want = r.model.forward(batch, cache)
    fresh = FreshSteps(r.config, [17, 9], "cpu", 16, 1 << 20, None, 0)
    assert torch.equal(r.model.forward(fresh.next(tokens), cache), want)
    r.model.engram_on_device = False  # tiny tables: in CPU memory either way
    pre = EngramPrefetcher([b.engram for b in r.model.blocks if b.engram is not None], "cpu", threads=2)
    try:
        fresh = FreshSteps(r.config, [17, 9], "cpu", 16, 1 << 20, pre, 0)
        batch = fresh.next(tokens)
        assert batch.engram.form == "pending"
        assert torch.equal(r.model.forward(batch, cache), want)
    finally:
        pre.close()


def test_host_tables_refused_when_the_host_lacks_the_memory(monkeypatch, capsys):
    from mini.bench import main
    monkeypatch.setattr(rank4, "host_memory_available", lambda: 20 << 30)
    assert main(["rank4", "--mode", "realistic"] + TINY) == 2
    assert "pass a smaller --engram-rows" in capsys.readouterr().err
