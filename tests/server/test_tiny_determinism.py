"""Greedy outputs do not depend on batch composition or arrival order: 32 concurrent requests (with bad requests
and disconnects mixed in) through the server over tiny-v4.1 give the same text as offline LLM.generate of each
prompt alone. CPU, activations in fp32, in the deterministic mode (EngineOptions.deterministic): without it a
request's logits depend on its batch at the 1e-2 level here (torch 2.13's CPU matmuls are not batch-invariant and
the random tiny model's routing amplifies that), which flips prompt 12's greedy tokens."""
import pytest
import torch

import mini.ops
from mini.engine import LLM, SamplingParams
from mini.server.app import build_app
from mini.testing.background_server import BackgroundServer, wait_idle
from test_concurrency import burst, token_prompts


@pytest.fixture(autouse=True)
def mode_off_after():
    yield
    mini.ops.set_deterministic(False)  # process-wide: other tests of this worker run in the default mode


OPTS = dict(device="cpu", dtype=torch.float32, num_blocks=64, block_tokens=16, deterministic=True)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:deterministic mode")
def test_32_concurrent_requests_equal_offline_alone():
    prompts, max_tokens = token_prompts(seed=5, max_len=20), 3
    offline = LLM("tiny-v4.1", **OPTS, max_num_seqs=1, enable_prefix_caching=False)
    want = [offline.generate([p], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].text
            for p in prompts]
    app = build_app("tiny-v4.1", "fake", **OPTS, max_num_seqs=16, max_num_batched_tokens=96)
    engine = app.state.server.llm.engine
    with BackgroundServer(app) as url:
        got = burst(url, prompts, max_tokens)
        wait_idle(engine)  # the burst's disconnected streams are aborted at the engine's next step
    assert got == want
    assert not engine.requests and engine.blocks.usage == 0.0
