"""`mini serve --speculative dspark` end to end (tiny-v4.1-dspark, CPU, fp32, the kernels' deterministic mode): a
completion through the HTTP API equals the plain engine's tokens and text, and /metrics counts the drafts."""
import httpx
import torch

import mini.ops
from mini.engine import LLM, SamplingParams
from mini.server.app import build_app
from mini.testing.background_server import BackgroundServer

OPTS = dict(device="cpu", dtype=torch.float32, num_blocks=32, block_tokens=16, max_num_seqs=4)


def test_speculative_server_equals_plain_engine():
    with mini.ops.deterministic_mode():
        llm = LLM("tiny-v4.1-dspark", **OPTS)
        want = llm.generate(["Hello, mini"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        app = build_app("tiny-v4.1-dspark", "m", speculative="dspark", **OPTS)
        with BackgroundServer(app) as url:
            body = {"model": "m", "prompt": "Hello, mini", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            got = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
            metrics = httpx.get(url + "/metrics").text
    assert got["choices"][0]["text"] == want.text
    assert got["usage"]["completion_tokens"] == len(want.token_ids)
    drafted = float(metrics.split("\nmini_spec_draft_tokens_total ")[1].split()[0])
    assert drafted > 0


def test_serve_refuses_speculation_without_dspark(capsys):
    from mini.cli import main
    assert main(["serve", "--model", "tiny-v4.1", "--device", "cpu", "--num-blocks", "8", "--speculative",
                 "dspark"]) == 2
    assert "no DSpark draft module (mtp.* weights)" in capsys.readouterr().err
