"""The Responses API (issue 30, item 1) through the official `openai` SDK over tiny-v4.1 (random weights):
create / stream / parse, function tools (forced calls validate against their schema, streamed arguments add up),
json_schema output, reasoning items, stored responses (get, delete, input_items, previous_response_id chains, a
restart over the same SQLite file, the retention limit), errors naming the field; and the OpenAI Agents SDK's
default (Responses) model running a tool-calling agent end to end."""
import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel

from server_apps import MODEL, fake_app
from mini.server.app import build_app
from mini.testing.background_server import BackgroundServer
from mini.server.store import ResponseStore

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY,
          "strict": True}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """tiny-v4.1, 4,096-token context (the tools section is ~1,000 tiny tokens), responses in a SQLite file."""
    db = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    app = build_app("tiny-v4.1", MODEL, device="cpu", dtype=torch.float32, num_blocks=256, block_tokens=16,
                    max_num_seqs=8, responses_db=str(db))
    with BackgroundServer(app) as url:
        yield url, app


def _client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, **kw)


def test_create_text_and_stored_response(server):
    url, _ = server
    c = _client(url)
    r = c.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=5,
                           temperature=0, metadata={"run": "1"})
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.metadata == {"run": "1"}
    assert [o.type for o in r.output] == ["message"] and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens == 5 and r.usage.input_tokens > 0
    got = c.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = c.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello")]
    assert c.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    unstored = c.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_stream_adds_up_to_the_response(server):
    url, _ = server
    c = _client(url)
    kw = dict(model=MODEL, input="A digit as JSON.", max_output_tokens=30, temperature=1.0, extra_body={"seed": 3},
              text={"format": {"type": "json_schema", "name": "digit", "schema": SCHEMA, "strict": True}})
    with c.responses.stream(**kw) as stream:
        kinds, text = [], ""
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.content_part.done", "response.output_item.done"} <= set(kinds)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert final.output_text == text and c.responses.retrieve(final.id).output_text == text
    assert c.responses.create(**kw).output_text == text
    # cut short by max_output_tokens: the stream ends with response.incomplete
    kinds = [e.type for e in c.responses.create(model=MODEL, input="Hi", max_output_tokens=3, stream=True)]
    assert kinds[-1] == "response.incomplete" and kinds.count("response.output_text.delta") >= 1


def test_forced_function_call_streamed_and_not_and_a_round_trip(server):
    url, _ = server
    c = _client(url)
    kw = dict(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice="required", max_output_tokens=300,
              temperature=1.0, extra_body={"seed": 5}, parallel_tool_calls=False)
    r = c.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), CITY)
    with c.responses.stream(**kw) as stream:
        args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert args == calls[0].arguments == [o for o in final.output if o.type == "function_call"][0].arguments
    # the tool's result goes back by previous_response_id (the stored conversation) or with the whole history
    follow = c.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=3, temperature=0,
                                input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                        "output": "sunny"}], tools=TOOLS)
    whole = c.responses.create(model=MODEL, max_output_tokens=3, temperature=0, tools=TOOLS, input=[
        {"role": "user", "content": "Weather in Paris?"}, *[o.model_dump() for o in r.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.usage.input_tokens == whole.usage.input_tokens and follow.output_text == whole.output_text
    assert follow.previous_response_id == r.id


def test_parse_json_schema_and_reasoning_items(server):
    url, _ = server

    class Digit(BaseModel):
        n: int

    c = _client(url)
    r = c.responses.parse(model=MODEL, input="A digit as JSON.", text_format=Digit, max_output_tokens=30,
                          temperature=1.0, extra_body={"seed": 1})
    assert isinstance(r.output_parsed, Digit)
    r = c.responses.create(model=MODEL, input="Think.", reasoning={"effort": "minimal"}, max_output_tokens=6,
                           temperature=1.0, include=["reasoning.encrypted_content"])
    assert r.output[0].type == "reasoning" and r.reasoning.effort == "minimal"
    reasoning = r.output[0].content[0].text if r.output[0].content else ""
    assert r.output[0].encrypted_content == reasoning


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),  # tiny-v4.1 has no vision tower (images: test_api_images_responses_anthropic.py)
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "previous_response_id": "resp_gone"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
])
def test_errors_name_the_field(server, body, param):
    url, _ = server
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, **body})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_agents_sdk_default_model_runs_a_tool_calling_agent(server):
    """The Agents SDK's default model (OpenAIResponsesModel) against mini: the first turn must call the tool
    (tool_choice required; the SDK resets it to auto after a call), the tool runs, its result goes back, and the
    run ends with the model's text."""
    agents = pytest.importorskip("agents")
    url, _ = server
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
                                     use_for_tracing=False)
    agents.set_default_openai_api("responses")
    called = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        called.append(city)
        return "sunny"

    class Answer(BaseModel):
        sunny: bool

    # a random model's free text (or string) would run to max_tokens (status incomplete, which the SDK raises):
    # the tool takes an enum, the final output is structured and short
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", model=MODEL, tools=[get_weather],
                         output_type=Answer,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=300, temperature=1.0,
                                                             store=True, metadata={"test": "agents"},
                                                             extra_body={"seed": 7}))
    async def both():  # one event loop: the SDK's client keeps its connections in it
        whole = await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)
        n_called = len(called)
        streamed = agents.Runner.run_streamed(agent, "Weather in Rome?", max_turns=4)  # streamed responses
        return whole, n_called, streamed, [e.type async for e in streamed.stream_events()]
    result, n_called, streamed, event_kinds = asyncio.run(both())
    assert n_called and isinstance(result.final_output, Answer)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert len(called) > n_called and isinstance(streamed.final_output, Answer)
    assert "raw_response_event" in event_kinds
    assert [item.type for item in streamed.new_items][:2] == ["tool_call_item", "tool_call_output_item"]


def test_store_survives_a_restart_and_keeps_the_newest(tmp_path):
    """Over the fake model (fast): a chain stored by one server continues on a new one over the same file."""
    db = tmp_path / "r.sqlite3"
    with BackgroundServer(fake_app(responses_db=str(db))) as url:
        first = _client(url).responses.create(model=MODEL, input="one", max_output_tokens=2)
    with BackgroundServer(fake_app(responses_db=str(db))) as url:
        c = _client(url)
        assert c.responses.retrieve(first.id).output_text == first.output_text
        second = c.responses.create(model=MODEL, input="two", max_output_tokens=2, previous_response_id=first.id)
        alone = c.responses.create(model=MODEL, input="two", max_output_tokens=2)
        assert second.usage.input_tokens > alone.usage.input_tokens
    store = ResponseStore(db, max_responses=2)
    store.put({"id": "resp_x", "output": []}, [])
    assert len(store) == 2 and store.get(first.id) is None and store.get("resp_x") is not None
