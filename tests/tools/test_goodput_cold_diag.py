"""tools/goodput_cold_diag.py: tiny-goodput with the server's warm-up trace summarized per burst."""
import argparse
import sys
from pathlib import Path

import goodput_cold_diag as cold
import torch

from mini.testing.suites import check_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # the engine tests' fake model
from fake_model import FakeConfig, FakeModel, FakeTokenizer  # noqa: E402


def _args(*argv):
    p = argparse.ArgumentParser()
    cold.add_args(p)
    return p.parse_args(list(argv))


def test_cold_diag_reads_the_server_trace_per_burst(tmp_path, monkeypatch):
    """With MINI_WARMUP_TRACE set, the warmed-up server traces its steps and the bench summarizes them per burst."""
    from mini.engine import warmup_trace
    from mini.server.app import build_app
    from mini.testing.background_server import BackgroundServer
    monkeypatch.setenv(warmup_trace.TRACE_ENV, str(tmp_path / "trace.jsonl"))
    cfg = FakeConfig(vocab_size=512)
    app = build_app(FakeModel(cfg), "tiny-v4.1", warmup=True, config=cfg, tokenizer=FakeTokenizer(), num_blocks=256,
                    block_tokens=4, device="cpu", dtype=torch.float32, max_num_seqs=8, max_num_batched_tokens=32)
    try:
        with BackgroundServer(app) as url:
            args = _args("--url", url, "--num-requests", "4", "--input-len", "6", "--output-len", "3",
                         "--repeat", "2")
            result = check_result("tiny-goodput", cold.run(args))
    finally:
        app.state.server.llm.engine.trace.close()
    d = result["cold_diag"]
    assert d["warmup"]["steps"] > 0 and len(d["bursts"]) == 2
    assert [b["adds"] for b in d["bursts"]] == [4, 4] and all(b["steps"] >= 3 for b in d["bursts"])
