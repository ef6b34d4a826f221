"""The ep-exchange suite on 2 gloo ranks at a small shape: it runs the real exchange and reports sane numbers."""
import json

import pytest

import mini.bench as bench


def test_ep_exchange_suite_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    assert bench.main(["ep-exchange", "--ranks", "2", "--tokens", "24", "--dim", "96", "--topk", "3", "--experts",
                       "8", "--iters", "3", "--warmup", "1", "--device", "cpu", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["definition"] == {"ranks": 2, "tokens_per_rank": 24, "dim": 96, "topk": 3, "experts": 8, "block": 32,
                               "device": "cpu", "gpu": None, "iters": 3, "warmup": 1}
    m = r["metrics"]
    assert all(m[k] > 0 for k in ("exchange_ms", "all_gather_ms", "reduce_scatter_ms", "all_gather_GBps",
                                  "reduce_scatter_GBps"))
    # row: 3 ids + 3 weights (24 B) + 96 codes + 3 scales = 123 B, padded to 128; the other rank's 24 rows
    assert m["all_gather_GBps"] * m["all_gather_ms"] * 1e6 == pytest.approx(24 * 128)


def test_ep_exchange_glue_mode_on_cpu_interpreter(tmp_path):
    """--glue: one process, the eager and fused glue at a small shape, Triton kernels under the interpreter (a fresh
    process: TRITON_INTERPRET is read when the kernels are decorated); the two glues' bytes and rows must agree."""
    import os
    import subprocess
    import sys
    out = tmp_path / "g.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "mini.cli", "bench", "ep-exchange", "--glue", "--ranks", "3",
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
    assert bench.main(["ep-exchange", "--glue", "--device", "cpu"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
