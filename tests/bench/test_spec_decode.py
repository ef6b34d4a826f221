"""spec-decode on tiny-v4.1-dspark on the CPU (the real width needs the H200), and its --tiny goodput pair."""
import argparse

import pytest
import torch

from mini.bench import spec_decode as sd
from mini.testing.suites import SuiteError, check_result

TINY = ["--preset", "tiny-v4.1-dspark", "--batch", "1,2", "--context", "37", "--steps", "2", "--warmup", "1",
        "--device", "cpu", "--dtype", "float32", "--block-tokens", "16"]


def _args(extra=(), base=TINY):
    p = argparse.ArgumentParser()
    sd.add_args(p)
    return p.parse_args(list(base) + list(extra))


def test_suite_runs_on_the_tiny_model_and_reports_every_figure():
    result = check_result("spec-decode", sd.run(_args(["--spec-tokens", "3"])))
    m, d = result["metrics"], result["definition"]
    assert d["spec_tokens"] == 3 and d["acceptance"] == [2.0, 2.8, 3.5] and "EMULATED" in d["acceptance_is"]
    assert "proxy" in d["verify"] and d["graphs"] is False
    for B in (1, 2):
        p = f"b{B}_c37."
        decode, draft = m[p + "decode_ms"], m[p + "draft_ms"]
        assert decode > 0 and m[p + "draft_propose_ms"] > 0 and m[p + "draft_write_ms"] > 0
        assert draft == pytest.approx(m[p + "draft_write_ms"] + m[p + "draft_propose_ms"])
        assert m[p + "draft_graph"] == 0  # no CUDA: eager, and said so
        assert m[p + "decode.per_gpu_tok_s"] == pytest.approx(B * m[p + "decode.per_user_tok_s"])
        for label in ("verify", "verify_proxy"):
            verify = m[p + label + "_ms"]
            assert verify > 0 and m[p + label + "_over_decode"] == pytest.approx(verify / decode)
            for L in (2.0, 2.8, 3.5):
                q = p + f"{label}.emulated_accept_{L}."
                assert m[q + "per_user_tok_s"] == pytest.approx(L * 1e3 / (verify + draft))
                assert m[q + "per_gpu_tok_s"] == pytest.approx(B * m[q + "per_user_tok_s"])
                assert m[q + "speedup"] == pytest.approx(L * decode / (verify + draft))
        # the verify step's graph: B sequences x (1 + k) rows (the proxy: B x (1 + k) sequences of one row)
        assert result["raw"][f"b{B}_c37"]["verify"]["step_ms"] and result["raw"][f"b{B}_c37"]["verify_proxy"]
    # B = 1 carries issue 27's target (2.0x at acceptance 2.8), B = 2 none
    assert m["b1_c37.target_speedup"] == 2.0
    for label in ("verify", "verify_proxy"):
        assert m[f"b1_c37.{label}.emulated_accept_2.8.meets_target"] == float(
            m[f"b1_c37.{label}.emulated_accept_2.8.speedup"] >= 2.0)
    assert not any(k.startswith("b2_c37.") and "target" in k for k in m)
    # the proxy's cache holds B x (1 + k) sequences; the draft step's work does not depend on k
    assert result["raw"]["b2_c37"]["draft"]["draft_graph_refused"] == "not CUDA"
    # the draft MoE's routing, one entry per stage's MoE call: every expert's rows, each of the block's positions
    # routed to the draft's top-k experts (what tools/humming_decode_study.py replays as step:b2_c37.draft)
    cfg = sd.dspark_config("tiny-v4.1-dspark")
    for B in (1, 2):
        calls = result["raw"][f"b{B}_c37"]["draft"]["pairs_per_local_expert"]
        assert len(calls) == cfg.n_mtp_layers
        for counts in calls.values():
            assert len(counts) == cfg.dspark_n_routed_experts
            assert sum(counts) == B * cfg.dspark_block_size * cfg.dspark_n_activated_experts


def test_a_proxy_that_does_not_fit_leaves_the_rest(monkeypatch, capsys):
    """B x (1 + k) contexts of their own may not fit (B = 256 at 32K): the proxy is reported missing, the decode
    and draft steps are still measured."""
    from mini.bench import rank4_decode
    measure = rank4_decode.measure_shape

    def small_only(model, cfg, exchange, args, batch, context, study=None, what="x", width=1):
        if batch > 2:
            raise SuiteError(f"{what}: B={batch} x C={context} needs a 99.0 GiB cache; 1.0 GiB free after the model")
        return measure(model, cfg, exchange, args, batch, context, study, what, width)

    monkeypatch.setattr(rank4_decode, "measure_shape", small_only)
    result = check_result("spec-decode", sd.run(_args(["--batch", "1", "--spec-tokens", "2"])))
    m = result["metrics"]
    assert m["b1_c37.decode_ms"] > 0 and m["b1_c37.draft_ms"] > 0 and m["b1_c37.target_speedup"] == 2.0
    assert m["b1_c37.verify_ms"] > 0 and "b1_c37.verify.emulated_accept_2.8.speedup" in m
    assert not any("verify_proxy" in k for k in m)
    assert "needs a 99.0 GiB cache" in result["raw"]["b1_c37"]["verify_proxy"]
    assert "spec-decode B=1 C=37: no verify_proxy: spec-decode: B=3 x C=37 needs" in capsys.readouterr().out


def test_verify_run_gives_each_sequence_its_token_and_draft_at_the_next_positions():
    import mini.ops
    from mini.bench import rank4_decode as rd
    from mini.checkpoint import expert_range
    from mini.config import preset
    from mini.testing.emulated_ep import EmulatedEP
    from mini.testing.rank_model import rank_model
    cfg = preset("tiny-v4.1-dspark")
    ex = EmulatedEP(4, 0, "uniform", expert_range(cfg, 0, 4))
    with mini.ops.using_backend("reference"):
        model = rank_model(cfg, torch.device("cpu"), torch.float32, 0, expert_range(cfg, 0, 4), None, ex)
        r = rd.DecodeRun(model, cfg, ex, 2, 40, 5, 16, torch.device("cpu"), torch.float32, 0, width=3)
        ids = r.buffers.ids
        assert ids[1, :6].tolist() == [40, 41, 42, 40, 41, 42]  # row b * 3 + i: sequence b at 40 + i
        # its token, then the draft: every row a token of its own (rows of one id route alike)
        assert ids[0, :6].tolist() == r.tokens[0:6] and len(set(r.tokens[0:6])) == 6
        r.fill()
        assert ids[1, :6].tolist() == [41, 42, 43, 41, 42, 43]
        assert ids[0, :6].tolist() == r.tokens[6:12]
        out = r.replay()
        assert out.shape == (2 * 3, cfg.vocab_size) and torch.isfinite(out).all()


def test_no_proxy_measures_the_verify_step_alone(capsys):
    result = check_result("spec-decode", sd.run(_args(["--batch", "1", "--spec-tokens", "1", "--no-proxy"])))
    m = result["metrics"]
    assert m["b1_c37.verify_ms"] > 0 and not any("verify_proxy" in k for k in m)
    assert "verify_proxy" not in result["raw"]["b1_c37"] and "no verify_proxy" not in capsys.readouterr().out


def test_speed_ups_from_hand_numbers():
    """decode 10 ms, verify 12 ms, draft 3 ms, 64 sequences: at 3 tokens per verify step 200 tok/s per user, 2x."""
    m = sd.speedups(64, 10.0, 12.0, 3.0, [3.0, 1.5], "v")
    assert m["v.emulated_accept_3.0.per_user_tok_s"] == pytest.approx(200.0)
    assert m["v.emulated_accept_3.0.per_gpu_tok_s"] == pytest.approx(12800.0)
    assert m["v.emulated_accept_3.0.speedup"] == pytest.approx(2.0)
    assert m["v.emulated_accept_1.5.speedup"] == pytest.approx(1.0)


def test_real_width_draft_module_is_v41_flash_s():
    """v4.1-flash has no DSpark block in its preset (the official ModelArgs' 0); the suite adds the released one."""
    cfg = sd.dspark_config("v4.1-flash")
    assert cfg.has_dspark and cfg.n_mtp_layers == 3 and cfg.dspark_block_size == 5
    assert (cfg.dspark_n_routed_experts, cfg.dspark_n_activated_experts, cfg.dspark_markov_rank) == (128, 3, 256)
    assert cfg.dspark_target_layers == (37, 38, 39) and cfg.dim == 5120
    assert sd.dspark_config("tiny-v4.1-dspark").dspark_n_routed_experts == 8  # a preset's own is kept


def test_draft_step_writes_each_sequence_s_ring_slots_and_drafts_the_block():
    from mini.checkpoint.make import random_state
    from mini.config import preset
    from mini.model import Model
    cfg = preset("tiny-v4.1-dspark")
    model = Model(cfg, random_state(cfg, seed=0), "cpu", torch.float32)
    step = sd.DraftStep(model, 3, 130, 2, 0, torch.float32)  # 3 sequences committed positions 129 and 130
    step.write()
    for ring in step.rings.rings:  # ring slots 129 % 128 and 130 % 128 of each sequence's ring, nothing else
        written = ring.abs().sum(-1) > 0
        assert written[:, 1:3].all() and written.sum() == 3 * 2
    ids = step.propose()
    assert ids.shape == (3, cfg.dspark_block_size) and ids.dtype == torch.int64


def test_bad_options_are_refused():
    with pytest.raises(SuiteError, match="--spec-tokens must be 1..5"):
        sd.run(_args(["--spec-tokens", "6"]))
    with pytest.raises(SuiteError, match="--acceptance needs lengths >= 1"):
        sd.run(_args(["--acceptance", "0.5,2"]))
    with pytest.raises(SuiteError, match="spec-decode: --batch takes comma-separated integers"):
        sd.run(_args(["--batch", "x"]))
    with pytest.raises(SuiteError, match="no DSpark draft module"):
        sd.run(_args(["--preset", "tiny-v4"]))


def test_tiny_goodput_without_and_with_speculation():
    """`mini serve` twice (tiny-v4.1-dspark): the same workload, plain and --speculative dspark; the speculating
    server's draft counters come back from its /metrics."""
    args = _args(["--tiny", "--tiny-args", "--num-requests 3 --input-len 12 --output-len 6"],
                 base=["--device", "cpu", "--dtype", "float32"])
    result = check_result("spec-decode", sd.run(args))
    m, d = result["metrics"], result["definition"]
    assert d["model"] == "tiny-v4.1-dspark" and d["speculative"] == ["none", "dspark"] and d["num_requests"] == 3
    for name in ("plain", "speculative"):
        assert m[f"{name}.completed"] == 3 and m[f"{name}.failed"] == 0 and m[f"{name}.output_tok_s"] > 0
    assert "plain.spec_draft_tokens" not in m
    assert m["speculative.spec_verified_drafts"] > 0 and m["speculative.spec_draft_tokens"] > 0
    assert m["speculative.spec_tokens_per_verify"] == pytest.approx(
        1 + m["speculative.spec_accepted_tokens"] / m["speculative.spec_verified_drafts"])
    assert m["speculative_over_plain.output_tok_s"] == pytest.approx(
        m["speculative.output_tok_s"] / m["plain.output_tok_s"])
    # where each server's time went, by step kind: the plain server ran no verify step, the speculating one did
    assert m["plain.steps_verify"] == 0 and "plain.step_ms_verify" not in m and m["plain.steps_decode"] > 0
    assert m["speculative.steps_verify"] > 0 and m["speculative.step_ms_verify"] == pytest.approx(
        1000 * m["speculative.step_seconds_verify"] / m["speculative.steps_verify"])
