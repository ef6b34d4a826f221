"""tiny-goodput: workload is fixed by the seed; metrics are consistent; result has the suite shape."""
import argparse
import sys
from pathlib import Path

import pytest
import torch

from mini.bench import serve as goodput
from mini.testing.serving_load import make_workload, touch
from mini.testing.suites import check_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # the engine tests' fake model
from fake_model import FakeConfig, FakeModel, FakeTokenizer  # noqa: E402


def _args(*argv):
    p = argparse.ArgumentParser()
    goodput.add_args(p)
    return p.parse_args(list(argv))


def test_workload_is_fixed_by_seed():
    a = _args("--num-requests", "20", "--input-len", "10", "--output-len", "5", "--range-ratio", "0.5",
              "--request-rate", "4")
    w1, w2 = make_workload(a, 512), make_workload(a, 512)
    assert w1 == w2
    assert all(5 <= len(r.prompt) <= 15 and 2 <= r.max_tokens <= 7 for r in w1)
    gaps = [b.send_at - a.send_at for a, b in zip(w1, w1[1:])]
    assert all(g >= 0 for g in gaps) and 0.05 < sum(gaps) / len(gaps) < 1.0  # Poisson, mean 1/4 s
    assert make_workload(_args("--seed", "1", "--num-requests", "3"), 512) != \
        make_workload(_args("--num-requests", "3"), 512)


def test_against_a_running_server():
    from mini.server.app import build_app
    from mini.testing.background_server import BackgroundServer
    cfg = FakeConfig(vocab_size=512)
    app = build_app(FakeModel(cfg), "tiny-v4.1", config=cfg, tokenizer=FakeTokenizer(), num_blocks=256,
                    block_tokens=4, device="cpu", dtype=torch.float32, max_num_seqs=8)
    with BackgroundServer(app) as url:
        args = _args("--url", url, "--num-requests", "6", "--input-len", "12", "--output-len", "6",
                     "--request-rate", "50", "--repeat", "2", "--slo-ttft-ms", "10000", "--slo-tpot-ms", "10000")
        result = check_result("tiny-goodput", goodput.run(args))
    m = result["metrics"]
    assert m["completed"] == 6 and m["failed"] == 0 and len(result["runs"]) == 2
    assert m["goodput_req_s"] == pytest.approx(m["request_throughput"], rel=0.5)
    for run in result["runs"]:
        assert run["output_tok_s"] == pytest.approx(36 / run["duration_s"])
        assert run["itl_p99_ms"] > 0
    assert 0 < m["ttft_p50_ms"] <= m["ttft_p99_ms"] and 0 < m["tpot_p50_ms"] <= m["tpot_p99_ms"]
    assert result["definition"]["num_requests"] == 6 and result["definition"]["ignore_eos"] is True
    first, warm = result["runs"]  # the first burst apart, the metrics of the one after it
    assert m["first_ttft_p50_ms"] == first["ttft_p50_ms"] and m["ttft_p50_ms"] == warm["ttft_p50_ms"]
    assert m["first_ttft_p50_over_warm"] == pytest.approx(first["ttft_p50_ms"] / warm["ttft_p50_ms"])


def test_first_burst_apart_from_the_warm_median():
    runs = [{"ttft_p50_ms": 900.0, "ttft_p99_ms": 950.0, "tpot_p50_ms": 9.0, "request_throughput": 1.0,
             "goodput_req_s": 0.0, "failed": 0.0}] + \
        [{"ttft_p50_ms": t, "ttft_p99_ms": t, "tpot_p50_ms": 5.0, "request_throughput": 8.0, "goodput_req_s": 8.0,
          "failed": 0.0} for t in (100.0, 300.0, 200.0)]
    m = goodput.warm_and_first(runs)
    assert m["ttft_p50_ms"] == 200.0 and m["goodput_req_s"] == 8.0  # median of the three after the first
    assert m["first_ttft_p50_ms"] == 900.0 and m["first_goodput_req_s"] == 0.0
    assert m["first_ttft_p50_over_warm"] == 4.5
    one = goodput.warm_and_first(runs[:1])  # a single burst is its own "warm" median
    assert one["ttft_p50_ms"] == one["first_ttft_p50_ms"] == 900.0


def test_cpu_smoke_tiny_model_started_server():
    """The suite as `mini bench tiny-goodput` runs it: starts `mini serve` (tiny-v4.1, CPU) in a subprocess."""
    args = _args("--device", "cpu", "--num-requests", "3", "--input-len", "8", "--output-len", "3",
                 "--block-tokens", "16", "--num-blocks", "16", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000")
    result = check_result("tiny-goodput", goodput.run(args))
    m = result["metrics"]
    assert m["completed"] == 3 and m["failed"] == 0 and m["goodput_req_s"] == m["request_throughput"]
    assert m["total_tok_s"] == pytest.approx(m["output_tok_s"] * (8 + 3) / 3)


def test_the_client_warms_its_http_stack_on_health_only():
    """Before the first burst the bench touches GET /health with its async client: no request reaches the engine."""
    import asyncio
    from mini.server.app import build_app
    from mini.testing.background_server import BackgroundServer
    cfg = FakeConfig(vocab_size=512)
    app = build_app(FakeModel(cfg), "tiny-v4.1", config=cfg, tokenizer=FakeTokenizer(), num_blocks=64,
                    block_tokens=4, device="cpu", dtype=torch.float32, max_num_seqs=4)
    engine = app.state.server.llm.engine
    with BackgroundServer(app) as url:
        asyncio.run(touch(url))
    assert engine.stats.steps == 0 and not engine.requests
