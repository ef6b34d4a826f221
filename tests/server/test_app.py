"""The OpenAI-compatible server through the official `openai` client and raw HTTP."""

import httpx
import openai
import pytest

from server_apps import MODEL
from mini.chat_format import render_chat
from mini.testing.background_server import wait_idle


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_completion_and_streaming_agree(server):
    url, _ = server
    c = _client(url)
    full = c.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 5
    chunks = list(c.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_chat_streaming_and_not(server):
    url, _ = server
    c = _client(url)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, seed=3,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 4
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_logprobs(server):
    url, _ = server
    c = _client(url)
    r = c.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)
    ch = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                   temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = ch.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 3 for e in content)


def test_models_health_metrics(server):
    url, _ = server
    assert [m.id for m in _client(url).models.list().data] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200
    _client(url).completions.create(model=MODEL, prompt="count me", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(url + "/metrics").text
    for name in ["mini_num_requests_running", "mini_num_requests_waiting", "mini_cache_usage_ratio",
                 "mini_prefill_tokens_total", "mini_decode_tokens_total", "mini_prefix_cache_hit_rate", "mini_time_to_first_token_seconds_bucket",
                 "mini_time_per_output_token_seconds_count"]:
        assert name in text
    assert float(text.split("\nmini_decode_tokens_total ")[1].split()[0]) > 0


BAD = [
    (b'{"model": "fake", "prompt": "hi"', "invalid JSON"),
    (b'{"model": "fake", "prompt": "\xff\xfe"}', "UTF-8"),
    (b'{"model": "fake", "prompt": "\\ud800"}', "Unicode"),
    (b'[1, 2]', "JSON object"),
    (b'{"model": "fake", "prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"model": "fake", "prompt": "hi", "max_tokens": -5}', "max_tokens"),
    (b'{"model": "fake", "prompt": "hi", "max_tokens": 100000000}', "max_tokens"),
    (b'{"model": "fake", "prompt": "hi", "temperature": -1}', "temperature"),
    (b'{"model": "fake", "prompt": "hi", "top_p": 1.5}', "top_p"),
    (b'{"model": "fake", "prompt": "hi", "top_k": -7}', "top_k"),
    (b'{"model": "fake", "prompt": "hi", "temperature": "hot"}', "temperature"),
    (b'{"model": "fake", "prompt": ""}', "empty"),
    (b'{"model": "fake", "prompt": [5, 100000]}', "token ids"),
    (b'{"model": "fake", "prompt": [' + b"7, " * 1100 + b'7]}', "context"),
    (b'{"model": "fake", "prompt": [5, 6], "max_tokens": 1023}', "context"),
    (b'{"model": "fake"}', "prompt"),
]


@pytest.mark.parametrize("body,needle", BAD)
def test_bad_completion_requests_are_400(server, body, needle):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle.lower() in err["message"].lower(), err


@pytest.mark.parametrize("body,needle", [
    ({"model": "fake", "messages": []}, "messages"),
    ({"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"model": "fake", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 99, "logprobs": True},
     "top_logprobs"),
])
def test_bad_chat_requests_are_400(server, body, needle):
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_openai_client_sees_bad_request(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError, match="temperature"):
        _client(url).completions.create(model=MODEL, prompt="hi", temperature=-3)


def test_disconnect_mid_stream_aborts_and_frees_cache(server):
    url, app = server
    engine = app.state.server.llm.engine
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    wait_idle(engine)
    assert not engine.requests and not engine.scheduler.running
    assert engine.blocks.usage == 0.0
    assert 'reason="abort"' in httpx.get(url + "/metrics").text


def test_split_reasoning_holds_back_a_partial_marker():
    from mini.server.app import split_reasoning
    assert split_reasoning("think hard</think>answer", final=False) == ("think hard", "answer")
    assert split_reasoning("think hard</th", final=False) == ("think hard", "")
    assert split_reasoning("think hard</th", final=True) == ("think hard</th", "")
    assert split_reasoning("a < b", final=False) == ("a < b", "")


def test_chat_thinking_mode_separates_reasoning(server):
    url, _ = server
    c = _client(url)
    msgs = [{"role": "user", "content": "why?"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body={"ignore_eos": True,
                                                                                    "chat_template_kwargs": {"thinking": True}})
    full = c.chat.completions.create(**kw).choices[0].message
    plain = c.completions.create(model=MODEL, prompt=render_chat(msgs, thinking=True), max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    reasoning = full.model_extra["reasoning_content"]
    assert reasoning + ("</think>" if "</think>" in plain else "") + full.content == plain
    chunks = list(c.chat.completions.create(**kw, stream=True))
    streamed = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks)
    assert streamed == reasoning


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(server):
    url, app = server
    engine, finished = app.state.server.llm.engine, app.state.server.metrics.finished
    aborted_before = finished.get("abort", 0)
    body = {"model": MODEL, "prompt": "a long wait", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=1.0)
    wait_idle(engine)
    assert not engine.requests and engine.blocks.usage == 0.0
    assert finished.get("abort", 0) == aborted_before + 1
