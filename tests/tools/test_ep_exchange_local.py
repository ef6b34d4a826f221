"""tools/ep_exchange_local.py: the EP exchange's local work on one device (--glue, --parts) at tiny shapes, Triton
kernels under the interpreter."""
import json
from pathlib import Path

import pytest

import ep_exchange_local
from mini.testing.suites import SuiteError, check_result

TOOL = Path(ep_exchange_local.__file__)


def test_ep_exchange_glue_mode_on_cpu_interpreter(tmp_path):
    """--glue: one process, the eager and fused glue at a small shape, Triton kernels under the interpreter (a fresh
    process: TRITON_INTERPRET is read when the kernels are decorated); the two glues' bytes and rows must agree."""
    import os
    import subprocess
    import sys
    out = tmp_path / "g.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(TOOL), "--glue", "--ranks", "3",
                          "--tokens", "13", "--dim", "96", "--topk", "3", "--experts", "9", "--iters", "1",
                          "--warmup", "0", "--device", "cpu", "--json", str(out)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["definition"]["mode"] == "glue" and r["definition"]["ranks"] == 3
    m = r["metrics"]
    assert m["identical"] == 1 and m["gathered_rows"] == 39 and 0 < m["local_rows"] <= 39 * 3
    assert all(m[f"{p}_ms"] > 0 for p in ("eager.pack", "fused.pack", "fused.gather_decode", "fused.combine_add"))


def test_ep_exchange_glue_mode_needs_the_interpreter_on_cpu(capsys):
    import triton
    if triton.knobs.runtime.interpret:
        pytest.skip("this process runs the interpreter")
    assert ep_exchange_local.main(["--glue", "--device", "cpu"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_parts_bench_runs_and_checks_bits_interpreter(monkeypatch):
    """`--parts` (the overlap's compute side on one device) at tiny size under the
    interpreter: one piece and 2 / 3 parts timed, every partial-sum row identical to the one-piece one."""
    import argparse

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = argparse.ArgumentParser()
    ep_exchange_local.add_args(p)
    args = p.parse_args(["--parts", "3,2", "--ranks", "2", "--tokens", "7", "--preset", "tiny-v4.1", "--device",
                         "cpu", "--iters", "1", "--warmup", "0"])
    r = check_result("ep-exchange", ep_exchange_local.run(args))
    assert r["definition"]["parts"] == [1, 2, 3] and r["definition"]["local_experts"] == 8
    m = r["metrics"]
    assert m["parts1_overhead"] == 0 and m["shared_ms"] > 0
    for n in (1, 2, 3):
        assert m[f"parts{n}_identical"] == 1 and m[f"parts{n}_routed_ms"] > 0
    with pytest.raises(SuiteError, match="--parts"):
        ep_exchange_local.run(p.parse_args(["--parts", "2,x", "--device", "cpu"]))
