"""The `ep-exact` check: greedy decoding on 2 EP/DP ranks against one rank holding every expert (gloo on the CPU;
NCCL on 2 GPUs, gpu-marked), and the comparison it reports."""
import argparse

import pytest
import torch

from mini.check import ep_exact
from mini.testing.suites import check_result


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ep_exact.add_args(p)
    p.add_argument("--json", default=None)
    return p.parse_args(["--nproc", "2", "--decode-steps", "3", *extra])


def test_two_cpu_ranks_decode_like_one():
    result = check_result("ep-exact", ep_exact.run(_args("--device", "cpu", "--cases", "tiny-reference-fp32")))
    m = result["metrics"]
    assert result["definition"]["ranks"] == 2 and result["definition"]["backend"] == "gloo"
    assert m["tiny-reference-fp32.tokens_identical"] == 1
    assert m["tiny-reference-fp32.logit_abs_max"] > 1  # real logits were compared
    # only the fp32 order of each token's expert sum differs (and with tiny-v4.1's FP8 x FP4 products not even that)
    assert m["tiny-reference-fp32.max_abs_logit_diff"] <= 1e-5
    assert m["tiny-reference-fp32.plain_vs_one_max_abs_logit_diff"] <= 1e-5


def test_compare_finds_a_planted_difference():
    want = torch.randn(4, 3, 50)
    got = want.clone()
    got[2, 1, 7] += 0.25
    m = ep_exact.compare(got, want)
    assert m["max_abs_logit_diff"] == pytest.approx(0.25)
    assert m["max_rel_logit_diff"] == pytest.approx(0.25 / want[2, 1].norm().item(), rel=1e-5)
    assert m["rows_bit_identical"] == pytest.approx(11 / 12)
    tokens = [[1, 2, 3]] * 4
    flipped = [[1, 2, 3]] * 3 + [[1, 2, 4]]
    assert ep_exact.case_metrics(tokens, got, flipped, want, want)["tokens_identical"] == 0
    assert ep_exact.case_metrics(tokens, want, tokens, want, want)["max_abs_logit_diff"] == 0


SITES = ("attn", "moe_in", "gate_ids", "gate_weights", "routed", "shared")


def test_trace_on_two_cpu_ranks_covers_every_layer_and_step():
    """`--trace` on gloo: each rank reports every (step, layer, site) of the prefill and the first decode step, in
    forward order, with the first difference (here at most fp32 reordering of the routed sum: an expert's outputs
    are summed in two partial sums under EP)."""
    from mini.config import preset
    n_layers = preset("tiny-v4.1").n_layers
    result = check_result("ep-exact", ep_exact.run(_args("--device", "cpu", "--cases", "tiny-reference-fp32",
                                                         "--trace", "--decode-steps", "1")))
    ranks = result["trace"]["tiny-reference-fp32"]
    assert [t["rank"] for t in ranks] == [0, 1] and result["definition"]["trace_steps"] == 2
    for t in ranks:
        want = [(step, layer, site) for step in (0, 1) for layer in range(n_layers) for site in SITES]
        want = [k for step in (0, 1) for k in [w for w in want if w[0] == step] + [(step, n_layers, "logits")]]
        assert [(d["step"], d["layer"], d["site"]) for d in t["sites"]] == want and not t["unmatched"]
        assert all(d["bit_identical"] for d in t["sites"] if d["site"] in ("attn", "gate_ids") and d["layer"] == 0)
        first = t["first_difference"]
        assert first is None or (first["site"] == "routed" and first["max_rel"] < 1e-6), first
        assert t["backends_at_start"]["ep"] == t["backends_at_start"]["one"]
    differing = max(sum(not d["bit_identical"] for d in t["sites"]) for t in ranks)
    assert result["metrics"]["tiny-reference-fp32.trace_sites_differing"] == differing


def test_tracer_finds_a_planted_difference():
    """The first site (in forward order) whose bits differ, with its size and first row; sites after it count
    too; a site EP never recorded is named."""
    tracer = ep_exact.Tracer(steps=1)
    a, b = torch.randn(5, 8), torch.randn(5, 8)
    ids = torch.arange(10).view(5, 2)
    tracer(0, "attn", a)
    tracer(0, "gate_ids", ids)
    tracer(1, "attn", b)
    tracer.step = 1
    tracer(0, "attn", a)  # past `steps`: not recorded
    tracer.compare()
    tracer.step = 0
    tracer(0, "attn", a.clone())
    ids2 = ids.clone()
    ids2[3, 1] = 0  # was 7
    tracer(0, "gate_ids", ids2)
    b2 = b.clone()
    b2[4, 2] += 0.5
    tracer(1, "attn", b2)
    tracer(2, "shared", a)
    s = tracer.summary()
    assert s["first_difference"]["site"] == "gate_ids" and s["first_difference"]["first_row"] == 3
    assert s["first_difference"]["elements_differing"] == 1 and s["first_difference"]["max_abs"] == 7
    assert s["sites"][0]["bit_identical"] and s["sites"][2]["max_abs"] == pytest.approx(0.5)
    assert s["sites"][2]["rows_differing"] == 1 and "problem" in s["sites"][3]


def test_unknown_case_is_refused():
    with pytest.raises(RuntimeError, match="unknown cases"):
        ep_exact.run(_args("--device", "cpu", "--cases", "tiny-nope"))


@pytest.mark.gpu
def test_two_gpus_decode_like_one():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    m = ep_exact.run(_args("--device", "cuda", "--cases", "tiny-fast-bf16,tiny-reference-fp32"))["metrics"]
    for case in ("tiny-fast-bf16", "tiny-reference-fp32"):
        assert m[f"{case}.tokens_identical"] == 1
    assert m["tiny-reference-fp32.max_abs_logit_diff"] <= 1e-5
    # bf16 activations: a flipped bf16 rounding of one MoE output may spread, but stays at bf16 noise
    assert m["tiny-fast-bf16.max_rel_logit_diff"] <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "deterministic"])
def test_two_gpus_wide_fast_bf16_bit_identical(mode):
    """The case that regressed (issue 18): V4.1-Flash widths on the fast path, bf16. Report 004 had every logit of
    EP2 equal to one rank's; an expert's rows come from both ranks under EP, so any kernel whose rounding depends
    on how many rows it sees breaks this. Both modes must hold it (the deterministic one by construction)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    extra = ("--deterministic",) if mode == "deterministic" else ()
    m = ep_exact.run(_args("--device", "cuda", "--cases", "wide-fast-bf16", *extra))["metrics"]
    assert m["wide-fast-bf16.tokens_identical"] == 1
    assert m["wide-fast-bf16.rows_bit_identical"] == 1, m
    assert m["wide-fast-bf16.max_abs_logit_diff"] == 0, m
