"""Many concurrent requests, with bad requests and disconnects mixed in: the good outputs equal offline
generation of each prompt alone (greedy), and the server keeps serving. Over the fake model here; the same
check over tiny-v4.1 is in test_tiny_determinism.py."""
import asyncio
import random

import httpx
import openai

from server_apps import MODEL, fake_app
from fake_model import fake_llm
from mini.engine import SamplingParams
from mini.testing.background_server import BackgroundServer, wait_idle

N_GOOD = 32


def token_prompts(n=N_GOOD, seed=11, max_len=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(2, max_len))] for _ in range(n)]


def _offline_alone(prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [fake_llm(num_blocks=256).generate([p], params)[0].text for p in prompts]


async def _good(client, prompt, i, max_tokens):
    await asyncio.sleep(random.Random(i).random() * 0.2)  # arrivals spread out and shuffled
    if i % 2:
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    return "".join([c.choices[0].text async for c in stream])


async def _bad(url, i):
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as h:  # no read deadline: pytest-timeout bounds it
        await asyncio.sleep(random.Random(100 + i).random() * 0.2)
        if i % 3 == 0:
            r = await h.post(url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": ',
                             headers={"content-type": "application/json"})
            assert r.status_code == 400
        elif i % 3 == 1:
            r = await h.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": -1})
            assert r.status_code == 400
        else:  # disconnect mid-stream
            body = {"model": MODEL, "prompt": f"drop {i}", "max_tokens": 300, "stream": True, "ignore_eos": True}
            async with h.stream("POST", url + "/v1/completions", json=body) as r:
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if n > 2:
                        break


async def _burst(url, prompts, max_tokens):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    good = [_good(client, p, i, max_tokens) for i, p in enumerate(prompts)]
    bad = [_bad(url, i) for i in range(12)]
    results = await asyncio.gather(*good, *bad)
    return results[:len(prompts)]


def burst(url, prompts, max_tokens):
    """32 good requests (half streamed) among 12 bad ones and disconnects; returns the good texts."""
    return asyncio.run(_burst(url, prompts, max_tokens))


def test_burst_matches_offline_alone():
    prompts, max_tokens = token_prompts(), 10
    app = fake_app(max_num_seqs=8, max_num_batched_tokens=48, num_blocks=128)
    with BackgroundServer(app) as url:
        got = burst(url, prompts, max_tokens)
        engine = app.state.server.llm.engine
        assert httpx.get(url + "/health").status_code == 200
        again = burst(url, prompts, max_tokens)  # prefix cache warm now
        # whether the bursts hit the prefix cache depends on where their chunks happened to end; a prompt sent
        # three times in a row must hit by its third time (the engine keeps a snapshot at a block boundary)
        hits = engine.blocks.stats.hits
        long_prompt = token_prompts(1, seed=5, max_len=40)[0] * 2
        for _ in range(3):
            httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 2},
                       timeout=None).raise_for_status()
        assert engine.blocks.stats.hits > hits
        wait_idle(engine)
    assert got == _offline_alone(prompts, max_tokens)
    assert again == got
    assert not engine.requests and engine.blocks.usage == 0.0
