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
