"""Anthropic's Messages API (issue 30, item 2) through the official `anthropic` SDK over tiny-v4.1 (random
weights): create and stream (the stream's blocks add up to the message), a tool-use round trip (forced calls
validate against input_schema), thinking blocks, stop_sequences, count_tokens, x-api-key auth and Anthropic's
error shape."""
import json

import httpx
import jsonschema
import pytest
import torch

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK (the test extra; the GPU image has none)")

from server_apps import MODEL
from mini.server.app import build_app
from mini.testing.background_server import BackgroundServer
from mini.server.guard import Policy

KEY = "sesame"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    """tiny-v4.1, 4,096-token context, an API key (Anthropic's SDK sends it as x-api-key)."""
    app = build_app("tiny-v4.1", MODEL, Policy(api_key=KEY), device="cpu", dtype=torch.float32, num_blocks=256,
                    block_tokens=16, max_num_seqs=8)
    with BackgroundServer(app) as url:
        yield url, app


def _client(url, key=KEY):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def test_create_and_stream_add_up(server):
    url, _ = server
    c = _client(url)
    kw = dict(model=MODEL, max_tokens=8, messages=USER, system="Be brief.", metadata={"user_id": "u1"},
              service_tier="auto", extra_body={"temperature": 1.0, "top_k": 50})
    m = c.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert [b.type for b in m.content] == ["text"] and m.usage.output_tokens == 8 and m.usage.input_tokens > 0
    with c.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_tool_use_round_trip_streamed_and_not(server):
    url, _ = server
    c = _client(url)
    kw = dict(model=MODEL, max_tokens=300, messages=USER, tools=TOOLS,
              tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    m = c.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, CITY)
    with c.messages.stream(**{**kw, "tool_choice": {"type": "any"}}) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and json.loads(partial) == streamed[0].input
    jsonschema.validate(streamed[0].input, CITY)
    # the result goes back as a tool_result block; the model answers (tool_choice none: text)
    history = USER + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                    "content": "sunny"}, {"type": "text", "text": "So?"}]}]
    answer = c.messages.create(model=MODEL, max_tokens=4, messages=history, tools=TOOLS,
                               tool_choice={"type": "none"})
    assert answer.content[0].type == "text"
    counted = c.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_thinking_blocks_and_stop_sequences(server):
    url, app = server
    c = _client(url)
    m = c.messages.create(model=MODEL, max_tokens=6, messages=USER, thinking={"type": "enabled",
                                                                             "budget_tokens": 2048})
    assert m.content[0].type == "thinking" and m.content[0].signature
    with c.messages.stream(model=MODEL, max_tokens=6, messages=USER,
                           thinking={"type": "enabled", "budget_tokens": 2048}) as stream:
        thought = "".join(e.delta.thinking for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == thought
    # a thinking turn sent back is the assistant's reasoning
    back = c.messages.create(model=MODEL, max_tokens=1, messages=USER + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]}, {"role": "user", "content": "ok"}])
    assert back.stop_reason == "max_tokens"
    hidden = c.messages.create(model=MODEL, max_tokens=6, messages=USER, thinking={
        "type": "adaptive", "display": "omitted"}, output_config={"effort": "xhigh"})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == "" and hidden.content[0].signature
    greedy = {"temperature": 0}
    plain = c.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=greedy)
    stop = plain.content[0].text[3:5]
    if stop:
        cut = c.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=greedy, stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert plain.content[0].text.startswith(cut.content[0].text)


def test_auth_and_errors_in_anthropics_shape(server):
    url, _ = server
    with pytest.raises(anthropic.AuthenticationError):
        _client(url, key="wrong").messages.create(model=MODEL, max_tokens=1, messages=USER)
    with pytest.raises(anthropic.NotFoundError):
        _client(url).messages.create(model="claude-x", max_tokens=1, messages=USER)
    for body, word in (({"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, "image"), ({"messages": USER}, "max_tokens"),
            ({"max_tokens": 1, "messages": USER, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools"),
            ({"max_tokens": 1, "messages": USER, "temperature": 3}, "temperature")):
        r = httpx.post(url + "/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and word in err["message"], err
    with pytest.raises(anthropic.BadRequestError):
        _client(url).messages.create(model=MODEL, max_tokens=1, messages=USER, tool_choice={"type": "any"})


def test_output_config_format_is_enforced(server):
    url, _ = server
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = _client(url).messages.create(model=MODEL, max_tokens=30, messages=USER, output_config={
        "format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_effort_of_thinking_budget():
    from mini.server.anthropic import effort_of_budget
    assert [effort_of_budget(b) for b in (1024, 4095, 4096, 16383, 16384, 64000)] == \
        ["low", "low", "high", "high", "max", "max"]
