"""mini against DeepSeek's own V4.1 inference code: the official-reference fixtures (tests/fixtures/v41_reference,
README there; harness and measures in official_fixture.py). Reference backend, bf16, CPU.

The reference's numbers depend on the BLAS it ran on: its fp32 GEMMs (the FP8/FP4 GEMMs' K-block sums, the mHC and
gate projections, attention's QK and PV) sum in the order of MKL's kernel for the machine, and a last-bit difference
there flips an FP8/FP4 rounding now and then, which these random models amplify. MKL's AVX2 code path reproduces
the fixtures' sums: the checks run the harness in a subprocess with MKL_CBWR=AVX2,STRICT (one thread, as the
reference ran). Under it mini reproduces the reference bit for bit on f0 and f2 (prefill, replay, six of eight
decode steps) and on f1's first 44 prompt rows; with MKL's default path on an AVX-512 machine f1/f2 sit at about
the reference's own noise instead (docs/fidelity.md).

Bounds, from the reference's own movement (noise: its prefix prefills vs its single prefill; decode noise: its
decode steps vs its replay prefill, which already differ by more than the prefix noise):
* bit-level (max |diff| <= 1e-5) where the reference is reproduced: f0 prefill and decode, f2 prefill and its first
  six decode steps, f1's rows 0-43 (to 1e-3: row 3 differs by 1.5e-4);
* prefill: rel-MAE <= 1.5 x noise and top-1 agreement >= the reference's own;
* forced decode (fed greedy_ids[:8]) vs the replay: rel-MAE <= 1.5 x decode noise, top-1 >= the reference's own.
A wiring or kernel error moves the logits by O(1) (rel-MAE ~1), far past all of these.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import official_fixture as of

BOUND = 1.5  # x the reference's own noise (issue 12)
GPU_BOUND = 2.0  # the fast backend on the GPU
F0_GPU_REL_MAE = 0.1  # f0's own noise is 0: the fast backend gets about 2x the other fixtures' noise
BITS = 1e-5  # "bit-identical" logits: fp32 rounding of the last operations only
REFERENCE_BLAS = of.REFERENCE_BLAS
# The bit-level checks need the fixture machine's vector kernels: MKL's AVX2 path (pinned by REFERENCE_BLAS) and
# ATen's AVX2 / AVX-512 ones (exp, sums). ATen's scalar `default` kernels round differently (f2 then sits at the
# reference's own noise from row 4 on, inside the bounds below), as does a CPU without AVX2.
AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_avx2 = pytest.mark.skipif(not AVX2, reason="bit-level checks need ATen's AVX2 / AVX-512 kernels (this run has "
                                f"{torch.backends.cpu.get_cpu_capability()}: ATEN_CPU_CAPABILITY or the CPU)")


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory) -> dict:
    """The harness's rows for every fixture, computed in a subprocess on the reference's BLAS path."""
    out = tmp_path_factory.mktemp("official") / "rows.json"
    script = Path(of.__file__)
    proc = subprocess.run([sys.executable, str(script), "--json", str(out)], capture_output=True, text=True,
                          env={**os.environ, **REFERENCE_BLAS}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    return {r["fixture"]: of.FixtureResult.from_row(r) for r in json.loads(out.read_text())}


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
    assert of.own_noise("f0").max_abs == 0 and of.decode_noise("f0").max_abs == 0
    assert abs(of.own_noise("f1").rel_mae - 0.068) < 5e-4 and abs(of.own_noise("f2").rel_mae - 0.058) < 5e-4


def test_window_only_model_is_bit_identical(cpu_results):
    r = cpu_results["f0"]
    assert max(r.prefill_rows) <= BITS and max(r.decode_rows) <= BITS, r.row()
    assert r.decode.max_abs <= BITS, r.decode  # the reference's decode equals its replay here


@needs_avx2
def test_mixed_schedule_prefill_is_bit_identical(cpu_results):
    """f2 (ratio 2 -> 1 -> 2, two Engram layers, KV / index sharing): every prompt row."""
    assert max(cpu_results["f2"].prefill_rows) <= BITS, cpu_results["f2"].prefill


@needs_avx2
def test_mixed_schedule_decode_steps_are_bit_identical(cpu_results):
    """f2's forced decode equals the reference's own decode steps (index-key defect corrected, spec §3) for the
    first six steps; steps 6-7 differ (0.63 / 0.33 max; docs/fidelity.md)."""
    assert max(cpu_results["f2"].decode_rows[:6]) <= BITS, cpu_results["f2"].decode_rows


@needs_avx2
def test_candidate_schedule_prefill_matches_to_row_43(cpu_results):
    """f1 (ratio 2 then 1, candidate blocks, a non-owner index source): rows 0-43 to rounding; row 44 on differ."""
    assert max(cpu_results["f1"].prefill_rows[:44]) <= 1e-3, cpu_results["f1"].prefill_rows[:44]


@pytest.mark.parametrize("name", ["f1", "f2"])
def test_prefill_within_the_references_own_noise(cpu_results, name):
    _within(cpu_results[name].prefill, of.own_noise(name), BOUND)


def test_forced_decode_within_the_references_own_noise(cpu_results):
    _within(cpu_results["f2"].decode, of.decode_noise("f2"), BOUND)


def test_f1_forced_decode_rel_mae_within_the_references_own_noise(cpu_results):
    r = cpu_results["f1"].decode
    assert r.rel_mae <= BOUND * of.decode_noise("f1").rel_mae, r


def test_f1_forced_decode_top1_at_least_the_references_own(cpu_results):
    """f1's forced decode reads caches that carry the prompt rows 44-63. Where this machine reproduces those rows
    (the fixture machine's bits: its `exp` at layer 3's Sinkhorn), the decode must agree with the replay as often as
    the reference with itself. Where it does not (one fp32 last bit there moves the rows by O(0.1); measured: 5 of 8
    argmaxes then, on ATen's AVX2, AVX-512 and default kernels alike), the top-1 count is a property of those
    bits, not of mini: the premise fails and the test says so. The rel-MAE bound above holds on every machine."""
    r = cpu_results["f1"]
    rows = max(r.prefill_rows[44:])
    if rows > BITS:
        pytest.skip(f"premise not met on this machine: f1's prompt rows 44-63 differ from the fixture machine's by "
                    f"up to {rows:.3g} (its exp's last bit; docs/fidelity.md), so the decode's top-1 count is not "
                    f"mini's to meet (here {r.decode.top1:.3f} vs the reference's own {of.decode_noise('f1').top1:.3f})")
    assert r.decode.top1 >= of.decode_noise("f1").top1


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
    """The fast backend on CUDA, in this process (the GPU's own kernels; no BLAS path to pin)."""
    return _on_cuda("fast", of.NAMES)


@pytest.fixture(scope="module")
def gpu_official() -> dict:
    """The official algorithm on CUDA: the reference backend (which reproduces the fixtures on MKL's AVX2 path) with
    the GPU's own fp32 GEMMs, exp and top-k."""
    return _on_cuda("reference", ("f1", "f2"))


def _on_cuda(backend: str, names) -> dict:
    from mini import ops
    with ops.using_backend(backend):
        return {name: of.measure(name, "cuda") for name in names}


def _meets(got: of.Agreement, noise: of.Agreement, factor: float) -> bool:
    return got.rel_mae <= factor * noise.rel_mae and got.top1 >= noise.top1


# The figures of the reasons: tools/fidelity_diag.py on the H200 at 803b499 (docs/fidelity.md, "Why the fast
# backend lands outside"); test_official_algorithm_on_the_gpu_misses_the_bound re-checks the premise each GPU run.
_OFFICIAL_MISSES = {
    "f1": "the official algorithm itself misses the bound on the H200: the reference backend on CUDA lands at prefill "
          "rel-MAE 0.181 (bound 0.136), top-1 0.688 (the reference's own 0.891); the fast backend at 0.198 / 0.656, "
          "forced decode 0.219 (bound 0.210; the official on CUDA 0.201). Any last-bit difference from the "
          "fixture machine's sums (its MKL's order of the mHC mixes, its exp, its top-k ties) grows through these "
          "random models to this size (docs/fidelity.md)",
    "f2": "the official algorithm itself misses the bound on the H200: the reference backend on CUDA lands at prefill "
          "rel-MAE 0.102 (bound 0.116) with top-1 0.771 (the reference's own 0.812); the fast backend at 0.132 / "
          "0.677, forced decode 0.152 (bound 0.176). Any last-bit difference from the fixture machine's sums grows "
          "through these random models to this size (docs/fidelity.md)",
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_OFFICIAL_MISSES[n]))
                                  for n in ("f1", "f2")])
def test_fast_backend_within_twice_the_references_noise(gpu_results, name):
    """Prefill: rel-MAE and top-1 as on the CPU, at 2x; forced decode: rel-MAE at 2x (top-1 over 8 rows moves by
    one row at the reference's own noise, see the f1 top-1 test above)."""
    r = gpu_results[name]
    print(r.row())
    _within(r.prefill, of.own_noise(name), GPU_BOUND)
    assert r.decode.rel_mae <= GPU_BOUND * of.decode_noise(name).rel_mae, r.decode


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["f1", "f2"])
def test_official_algorithm_on_the_gpu_misses_the_bound(gpu_official, name):
    """The premise of the xfails above: on this GPU the official algorithm itself (the reference backend) does not
    meet the fast backend's prefill bound. When it does, this fails, and the fast backend must meet it too."""
    r = gpu_official[name]
    print("official algorithm on CUDA:", r.row())
    assert not _meets(r.prefill, of.own_noise(name), GPU_BOUND), r.prefill


@pytest.mark.gpu
def test_fast_backend_window_only_model(gpu_results):
    r = gpu_results["f0"]
    print(r.row())
    assert r.prefill.rel_mae <= F0_GPU_REL_MAE and r.decode.rel_mae <= F0_GPU_REL_MAE, r.row()
    assert r.prefill.top1 >= 0.9 and r.decode.top1 >= 0.9, r.row()
