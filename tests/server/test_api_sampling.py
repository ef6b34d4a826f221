"""n > 1 (one prefill of the shared prompt, n samples) and logit_bias, through the official `openai` client."""
import openai

from server_apps import MODEL
from mini.testing.background_server import wait_idle

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # several 16-token blocks of the test cache


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_n_choices_share_one_prefill(server):
    url, app = server
    engine = app.state.server.llm.engine
    n_prompt = len(engine.tokenizer.encode(PROMPT))
    shared = (n_prompt - 1) // engine.blocks.block_tokens * engine.blocks.block_tokens
    assert shared >= 32
    prefill_before, hits_before = engine.stats.prefill_tokens, engine.blocks.stats.hits
    r = _client(url).completions.create(model=MODEL, prompt=PROMPT + "n3", n=3, max_tokens=5, temperature=1.0, seed=7,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 15
    assert len({c.text for c in r.choices}) > 1  # seeds 7, 8, 9
    n_prompt = r.usage.prompt_tokens
    # choice 0 computes the prompt; choices 1 and 2 take its full blocks from the prefix cache
    assert engine.blocks.stats.hits - hits_before >= 2 * shared
    assert engine.stats.prefill_tokens - prefill_before <= n_prompt + 2 * (n_prompt - shared) + 3 * 5


def test_n_streamed_equals_not_streamed(server):
    url, _ = server
    c = _client(url)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "tell me"}], n=2, max_tokens=6, temperature=0.9,
              seed=11, extra_body={"ignore_eos": True})
    full = c.chat.completions.create(**kw)
    texts, finish = ["", ""], [None, None]
    for ch in c.chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [ch.message.content for ch in full.choices] and finish == ["length", "length"]
    # choice i with seed s samples as a single request with seed s + i
    single = c.chat.completions.create(**{**kw, "n": 1, "seed": 12})
    assert single.choices[0].message.content == full.choices[1].message.content


def test_logit_bias_forces_and_forbids_tokens(server):
    url, app = server
    tok = app.state.server.llm.engine.tokenizer
    c = _client(url)
    target = tok.encode(" fox")[0]
    r = c.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0, logit_bias={str(target): 100},
                             logprobs=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([target] * 4)
    plain = c.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
    first = tok.encode(plain.choices[0].text)[0]
    banned = c.completions.create(model=MODEL, prompt="hello", max_tokens=1, temperature=0,
                                  logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert tok.encode(banned.choices[0].text)[:1] != [first]


def test_disconnect_mid_stream_aborts_every_choice(server):
    import httpx
    url, app = server
    engine = app.state.server.llm.engine
    body = {"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:
                break
    wait_idle(engine)
    assert not engine.requests and not engine.scheduler.running and engine.blocks.usage == 0.0


def test_logit_bias_in_a_chat_stream(server):
    url, app = server
    tok = app.state.server.llm.engine.tokenizer
    target = tok.encode(" dog")[0]
    stream = _client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=1.0, seed=3,
        logit_bias={str(target): 100}, stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == tok.decode([target] * 5)
