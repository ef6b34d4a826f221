"""mini against DeepSeek's own V4.1 inference code: the official-reference fixtures (tests/fixtures/v41_reference,
README there; harness and measures in official_fixture.py). Reference backend, bf16, CPU.

Bounds, from the reference's own movement (NOISE below: its prefix prefills vs its single prefill; DECODE_NOISE:
its decode steps vs its replay prefill, which already differ by more than the prefix noise on f1 and f2):
* f0 (window only: no top-k, no compression) is bit-stable in the reference, so mini must reproduce its logits to
  the last fp32 bits (max |diff| <= 1e-5), prefill and decode;
* prefill: rel-MAE <= 1.5 x NOISE and top-1 agreement >= the reference's own;
* forced decode (fed greedy_ids[:8]) vs the replay: rel-MAE <= 1.5 x DECODE_NOISE, top-1 >= the reference's own.
f1 does not meet them yet (docs/fidelity.md): its checks are strict xfails, and a guard keeps it from getting worse
than measured. A wiring or kernel error moves the logits by O(1) (rel-MAE ~1), far past all of these.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import official_fixture as of

BOUND = 1.5  # x the reference's own noise (issue 12)
GPU_BOUND = 2.0  # the fast backend on the GPU
F0_GPU_REL_MAE = 0.1  # f0's own noise is 0: the fast backend gets about 2x the other fixtures' noise
F1_GUARD = {"prefill": 0.18, "decode": 0.22}  # measured 0.162 / 0.203 (before issue 12: 0.282 / 0.284)


def decode_noise(name: str) -> of.Agreement:
    ref = of.reference(name)
    return of.compare(ref["decode_logits"], ref["replay_logits"], of.scale_of(name))


def _measure(device: str, backend: str) -> dict:
    from mini import ops
    prev, threads = ops.backend(), torch.get_num_threads()
    ops.set_backend(backend)
    torch.set_num_threads(1)  # the reference ran on one thread
    try:
        return {name: of.measure(name, device) for name in of.NAMES}
    finally:
        ops.set_backend(prev)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cpu_results() -> dict:
    return _measure("cpu", "reference")


def _within(got: of.Agreement, noise: of.Agreement, factor: float) -> None:
    assert got.rel_mae <= factor * noise.rel_mae, f"rel-MAE {got.rel_mae:.4f} > {factor} x {noise.rel_mae:.4f}"
    assert got.top1 >= noise.top1, f"top-1 {got.top1:.3f} < the reference's own {noise.top1:.3f}"


def test_fixtures_are_the_official_ones():
    """The copied data is what the reference produced: shapes, and its own noise as its README states it."""
    for name, rows in (("f0", 48), ("f1", 64), ("f2", 96)):
        ref = of.reference(name)
        assert ref["prefill_logits"].shape == ref["prefix_logits"].shape == (rows, 1024)
        assert ref["replay_logits"].shape == ref["decode_logits"].shape == (8, 1024)
        assert ref["greedy_ids"].shape == (9,)
    assert of.own_noise("f0").max_abs == 0 and decode_noise("f0").max_abs == 0
    assert abs(of.own_noise("f1").rel_mae - 0.068) < 5e-4 and abs(of.own_noise("f2").rel_mae - 0.058) < 5e-4


def test_window_only_model_is_bit_identical(cpu_results):
    r = cpu_results["f0"]
    assert r.prefill.max_abs <= 1e-5, r.prefill
    assert r.decode.max_abs <= 1e-5, r.decode


def test_prefill_within_the_references_own_noise(cpu_results):
    _within(cpu_results["f2"].prefill, of.own_noise("f2"), BOUND)  # f0: bit-identical, above


def test_forced_decode_within_the_references_own_noise(cpu_results):
    _within(cpu_results["f2"].decode, decode_noise("f2"), BOUND)


@pytest.mark.xfail(strict=True, reason="f1 deviates from its first ratio-2/ratio-1 row on (docs/fidelity.md)")
def test_f1_prefill_within_the_references_own_noise(cpu_results):
    _within(cpu_results["f1"].prefill, of.own_noise("f1"), BOUND)


@pytest.mark.xfail(strict=True, reason="f1 deviates from its first ratio-2/ratio-1 row on (docs/fidelity.md)")
def test_f1_forced_decode_within_the_references_own_noise(cpu_results):
    _within(cpu_results["f1"].decode, decode_noise("f1"), BOUND)


def test_f1_no_worse_than_measured(cpu_results):
    r = cpu_results["f1"]
    assert r.prefill.rel_mae <= F1_GUARD["prefill"], r.prefill
    assert r.decode.rel_mae <= F1_GUARD["decode"], r.decode
    assert r.prefill.top1 >= 0.7, r.prefill


def test_cli_logits_force_tokens(tmp_path):
    """`mini logits --force-tokens` feeds the given tokens (decode by definition): its decode rows are the forced
    decode measured above, and feeding another token changes the row of that position."""
    from mini.cli import main
    ref = of.reference("f2")
    ids, forced = [int(t) for t in ref["prompt_ids"]], [int(t) for t in ref["greedy_ids"][:3]]

    def run(tokens, out):
        argv = ["logits", "--model", str(of.FIXTURES / "f2"), "--device", "cpu", "--backend", "reference",
                "--ids", ",".join(map(str, ids)), "--force-tokens", ",".join(map(str, tokens)), "--out", str(out)]
        assert main(argv) == 0
        return np.load(out)

    a = run(forced, tmp_path / "a.npz")
    assert a["tokens"].tolist() == forced and a["decode"].shape == (3, 1024)
    assert np.array_equal(a["decode"], of.run_logits(*of.load("f2"), ids, forced)[1])
    b = run([forced[0], (forced[1] + 1) % 1024, forced[2]], tmp_path / "b.npz")
    assert np.array_equal(a["decode"][0], b["decode"][0]) and not np.array_equal(a["decode"][1], b["decode"][1])


@pytest.fixture(scope="module")
def gpu_results() -> dict:
    return _measure("cuda", "fast")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["f1", "f2"])
def test_fast_backend_within_twice_the_references_noise(gpu_results, name):
    r = gpu_results[name]
    print(r.row())
    _within(r.prefill, of.own_noise(name), GPU_BOUND)
    _within(r.decode, decode_noise(name), GPU_BOUND)


@pytest.mark.gpu
def test_fast_backend_window_only_model(gpu_results):
    r = gpu_results["f0"]
    print(r.row())
    assert r.prefill.rel_mae <= F0_GPU_REL_MAE and r.decode.rel_mae <= F0_GPU_REL_MAE, r.row()
    assert r.prefill.top1 >= 0.9 and r.decode.top1 >= 0.9, r.row()
