"""Greedy outputs do not depend on batch composition or arrival order: 32 concurrent requests (with bad requests
and disconnects mixed in) through the server over tiny-v4.1 give the same text as offline LLM.generate of each
prompt alone. CPU, activations in fp32: in bf16 a near-tie could flip a greedy token between batch shapes."""
import pytest
import torch

from mini.engine import LLM, SamplingParams
from mini.server.app import BackgroundServer, build_app
from test_concurrency import burst, token_prompts

OPTS = dict(device="cpu", dtype=torch.float32, num_blocks=64, block_tokens=16)


@pytest.mark.slow
def test_32_concurrent_requests_equal_offline_alone():
    prompts, max_tokens = token_prompts(seed=5, max_len=20), 3
    offline = LLM("tiny-v4.1", **OPTS, max_num_seqs=1, enable_prefix_caching=False)
    want = [offline.generate([p], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].text
            for p in prompts]
    app = build_app("tiny-v4.1", "fake", **OPTS, max_num_seqs=16, max_num_batched_tokens=96)
    with BackgroundServer(app) as url:
        got = burst(url, prompts, max_tokens)
    assert got == want
    engine = app.state.server.llm.engine
    assert not engine.requests and engine.blocks.usage == 0.0
