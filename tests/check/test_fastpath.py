"""`mini check fastpath` on the CPU at tiny sizes: there both backends run the reference, so the harness must report
exactly zero error; a fault planted in one backend's MoE of one layer must show up in that layer and below only."""
import argparse

import pytest

import mini.model.model as mm
from mini.model.attn_layer import attention
import mini.ops
from mini.formats.quant import fake_quant_enabled
from mini.testing.suites import check_result, get_suite
from mini.check import CHECKS
from mini.check import fastpath as fc

TINY = ["--preset", "tiny-v4.1", "--tokens", "150", "--experts", "16", "--candidate-blocks", "8",
        "--block-tokens", "16", "--prompt-len", "30", "--decode-steps", "5", "--device", "cpu"]
FAULT_LAYER = 3


def _args(extra=()):
    p = argparse.ArgumentParser()
    fc.add_args(p)
    return p.parse_args(TINY + list(extra))


def _layer_metrics(m, suffix):
    return {k: v for k, v in m.items() if k.startswith("L") and k.endswith(suffix)}


def test_registered():
    assert get_suite("fastpath", CHECKS).module == "mini.check.fastpath"


def test_layer_config_keeps_the_width_and_every_layer_kind():
    cfg = fc.layer_config(_args(["--preset", "v4.1-flash", "--experts", "32", "--candidate-blocks", "128"]))
    assert (cfg.dim, cfg.n_heads, cfg.moe_inter_dim) == (5120, 64, 2304)
    assert (cfg.n_routed_experts, cfg.n_activated_experts, cfg.candidate_topk_blocks) == (32, 6, 128)
    kinds = {(p.ratio, p.owns_kv, p.runs_indexer, p.candidate_source, p.uses_candidates, p.engram)
             for p in cfg.layers}
    # window, window + Engram, ratio-2 source (+ Engram), its consumer, ratio-1 candidate source, ratio-1
    # consumer (layers 5 and 7, of different index sources), reindex source inside the candidates
    assert cfg.n_layers == 8 and len(kinds) == 7, kinds
    assert [p.index_layer for p in cfg.layers] == [-1, -1, 2, 2, 4, 4, 6, 6]


def test_equal_backends_give_zero_error():
    res = check_result("fastpath", fc.run(_args()))
    m = res["metrics"]
    assert len(res["layers"]) == 16  # attention and MoE of 8 layers
    for suffix in ("_rel_err", "_rel_err_same_input"):
        errs = _layer_metrics(m, suffix)
        assert len(errs) == 16 and all(v == 0 for v in errs.values()), errs
    floor = _layer_metrics(m, "_bf16_vs_fp32")
    assert len(floor) == 16 and all(0 < v < 1 for v in floor.values()), floor
    assert m["logits_rel_err"] == 0 and m["logits_top1_agree"] == 1
    assert 0 < m["logits_bf16_vs_fp32_rel_err"] < 1
    assert m["decode_tokens_identical"] == 1 and m["decode_first_divergence_step"] == -1
    assert m["decode_max_logit_rel_err"] == 0 == m["decode_forced_max_logit_rel_err"]
    assert m["decode_forced_argmax_agree"] == 1 and "decode_ref_top2_gap_at_divergence" not in m
    assert -1 <= m["decode_bf16_vs_fp32_first_divergence_step"] <= 5
    assert mini.ops.backend() == "reference" and mm.attention is attention  # restored


@pytest.fixture
def faulty_fast_moe(monkeypatch):
    """Under the "fast" backend, the MoE of layer FAULT_LAYER returns its output scaled by 1.01."""
    moe = mm.moe

    def faulty(x, w, cfg, plan, input_ids, image_mask=None, step=None):
        y = moe(x, w, cfg, plan, input_ids, image_mask, step)
        return y * 1.01 if mini.ops.backend() == "fast" and plan.layer == FAULT_LAYER else y
    monkeypatch.setattr(mm, "moe", faulty)


def test_a_fault_shows_up_where_it_is(faulty_fast_moe):
    m = fc.run(_args(["--no-fp32"]))["metrics"]
    same = _layer_metrics(m, "_rel_err_same_input")
    assert same.pop(f"L{FAULT_LAYER}_moe_rel_err_same_input") == pytest.approx(0.01, rel=0.1)
    assert all(v == 0 for v in same.values()), same  # the same input isolates the faulty sub-layer
    chained = _layer_metrics(m, "_rel_err")
    order = [f"L{i}_{k}_rel_err" for i in range(8) for k in ("attn", "moe")]
    first = order.index(f"L{FAULT_LAYER}_moe_rel_err")
    assert all(chained[k] == 0 for k in order[:first]) and all(chained[k] > 0 for k in order[first:]), chained
    assert m["logits_rel_err"] > 0 and "logits_bf16_vs_fp32_rel_err" not in m
    assert m["decode_forced_max_logit_rel_err"] > 0
    diverged = m["decode_tokens_identical"] == 0
    assert diverged == (m["decode_first_divergence_step"] >= 0) == ("decode_ref_top2_gap_at_divergence" in m)


def test_decode_only_skips_the_layer_check(monkeypatch):
    seen = []
    real = fc.check_decode
    monkeypatch.setattr(fc, "check_decode", lambda a: seen.append(fake_quant_enabled()) or real(a))
    for extra in ([], ["--decode-no-fake-quant"]):
        res = fc.run(_args(["--decode-only", "--no-fp32"] + extra))
        assert res["layers"] == [] and not _layer_metrics(res["metrics"], "_rel_err")
        assert res["metrics"]["decode_tokens_identical"] == 1
    assert seen == [True, False] and fake_quant_enabled()  # off only inside the decode check, then restored


def test_clear_steps_are_those_above_bf16s_own_reach():
    """On the CPU both backends are the reference: every clear step agrees, and a step is clear exactly when the
    reference's top-2 gap is at least twice bf16's own logit error there."""
    m = fc.run(_args(["--decode-only", "--decode-no-fake-quant"]))["metrics"]
    assert 0 < m["decode_clear_steps"] <= 6 and m["decode_forced_argmax_disagree_at_clear_steps"] == 0, m
