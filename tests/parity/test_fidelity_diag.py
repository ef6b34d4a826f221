"""tools/fidelity_diag.py, the tool that finds where two runs of an official fixture part (docs/fidelity.md): a run
compared with itself shows no difference; the reference backend with the fast path's indexer tie rule shows the
top-k ids as the first discrete difference and moves the logits. Each record runs in a subprocess: the tool wraps
module functions for the rest of its process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "fidelity_diag.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_CBWR": "AVX2,STRICT"}


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("diag")
    official = _run("record", "--fixture", "f2", "--out", str(out / "official_{fixture}.pt"))
    newer = _run("record", "--fixture", "f2", "--index-ties", "newer", "--out", str(out / "newer_{fixture}.pt"))
    summaries = [json.loads(line) for line in (official + newer).splitlines() if line.startswith("{")]
    assert [s["index_ties"] for s in summaries] == ["official", "newer"]
    return {"official": out / "official_f2.pt", "newer": out / "newer_f2.pt", "summaries": summaries}


def test_a_run_against_itself_differs_nowhere(records):
    text = _run("compare", str(records["official"]), str(records["official"]))
    decisions = text.split("discrete decisions that differ")[1].split("ops whose output differs")[0]
    ops = text.split("ops whose output differs")[1].split("first op at which")[0]
    assert decisions.strip().endswith(":") and ops.strip().endswith(":"), text[-2000:]
    assert "logits max|d| per row (first 16): [" + ", ".join(["0.0"] * 16) + "]" in text


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="reproducing f2 needs MKL's AVX2 code path (this CPU has no AVX2)")
def test_the_tie_rule_is_the_first_discrete_difference(records):
    """The reference reproduces f2's prefill (max |diff| ~1e-6 on this BLAS path, tests/parity/test_official_v41.py);
    ranking the indexer's equal scores as the fast path does is enough to move it (docs/fidelity.md)."""
    official, newer = records["summaries"]
    assert official["prefill"]["max_abs"] <= 1e-5 and newer["prefill"]["rel_mae"] > 0.01, (official, newer)
    text = _run("compare", str(records["official"]), str(records["newer"]))
    decisions = text.split("discrete decisions that differ")[1].splitlines()[1:]
    assert decisions and "top_groups" in decisions[0], text[:3000]
    first_ops = text.split("ops whose output differs")[1].splitlines()[1]
    assert "top_groups" in first_ops and "ORIGIN" in first_ops, text[:3000]


def _decode_search(step: int) -> list[dict]:
    """`decode-search` over every fed token of f2's decode step `step` (the whole vocabulary: ~1,000 forced steps,
    ~85 s on the CI machine; the two steps are two tests, so that xdist can run them side by side)."""
    lines = _run("decode-search", "--fixture", "f2", "--step", str(step), "--sites", "token", "--top", "1")
    return [json.loads(line) for line in lines.splitlines() if line.startswith("{")]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="reproducing f2 needs MKL's AVX2 code path (this CPU has no AVX2)")
def test_decode_search_finds_the_fed_token_at_f2_step_5():
    """`decode-search` reruns one forced decode step with one discrete decision changed. At f2's step 5 (which the
    reference backend reproduces bit for bit) the fed token is the only one that reproduces the reference's step:
    the search can find a cause."""
    head, best, summary = _decode_search(5)
    assert head["max_abs"] <= 1e-5 and summary["reproduced"] == [] and best["max_abs"] > 0.1, (head, best)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="reproducing f2 needs MKL's AVX2 code path (this CPU has no AVX2)")
def test_decode_search_finds_no_one_token_cause_of_f2_step_6():
    """At step 6 (0.63 off, docs/fidelity.md) no other fed token comes closer than the one fed, so the deviation
    is not an input mix-up."""
    head, best, summary = _decode_search(6)
    assert head["position"] == 102 and head["max_abs"] > 0.3, head
    assert summary["reproduced"] == [] and best["max_abs"] > head["max_abs"], (head, best)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="reproducing f2 needs MKL's AVX2 code path (this CPU has no AVX2)")
def test_one_ulp_on_the_mixes_moves_f2():
    """`order-ensemble --sites mixes_ulp`: every mHC mix moved by at most one fp32 ulp, at random per seed. The
    reference reproduces f2 bit for bit unperturbed; a seed's ulps alone move its logits (docs/fidelity.md: how
    far one ulp carries on these models), and two seeds move them differently."""
    lines = _run("order-ensemble", "--fixture", "f2", "--sites", "mixes_ulp", "--seeds", "2")
    rows = [json.loads(line) for line in lines.splitlines() if line.startswith("{")]
    assert len(rows) == 2 and all(r["prefill"]["rel_mae"] > 0.005 for r in rows), rows
    assert rows[0]["prefill"] != rows[1]["prefill"] and "meet both" in lines, lines
    control = _run("order-ensemble", "--fixture", "f2", "--sites", "mixes_copy", "--seeds", "1")
    assert json.loads(control.splitlines()[0])["prefill"]["max_abs"] <= 1e-5, control  # the wrapper alone: f2's bits
    with pytest.raises(AssertionError, match="only the mixes_ulp"):
        _run("order-ensemble", "--fixture", "f2", "--sites", "mhc", "--backend", "fast")
