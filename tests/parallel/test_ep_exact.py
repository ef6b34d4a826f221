"""The `ep-exact` check: greedy decoding on 2 EP/DP ranks against one rank holding every expert (gloo on the CPU;
NCCL on 2 GPUs, gpu-marked), and the comparison it reports."""
import argparse

import pytest
import torch

from mini.bench import check_result, ep_exact


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
