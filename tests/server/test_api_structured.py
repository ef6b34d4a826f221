"""Structured outputs through the official `openai` client over tiny-v4.1 (random weights): response_format
json_schema (strict) and json_object give JSON that validates (checked with `jsonschema`), streamed and not."""
import json

import jsonschema
import openai
import pytest

from server_apps import MODEL

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
    "pet": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/pet"}]}},
    "required": ["name", "age", "tags", "pet"], "additionalProperties": False,
    "$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
                      "additionalProperties": False}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "Describe a person as JSON."}]


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_validates_streamed_and_not(server, seed):
    url, _ = server
    c = _client(url)
    kw = dict(model=MODEL, messages=MSGS, response_format=FORMAT, max_tokens=200, temperature=1.0, seed=seed)
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True))
    assert streamed == r.choices[0].message.content


def test_json_schema_with_n_and_greedy(server):
    url, _ = server
    r = _client(url).chat.completions.create(model=MODEL, messages=MSGS, response_format=FORMAT, max_tokens=200,
                                             temperature=0, n=2)
    assert [c.message.content for c in r.choices][0] == r.choices[1].message.content  # greedy: the same
    for ch in r.choices:
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)


def test_json_object(server):
    url, _ = server
    r = _client(url).chat.completions.create(model=MODEL, messages=MSGS, response_format={"type": "json_object"},
                                             max_tokens=300, temperature=0.8, seed=4)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_text_format_is_unconstrained(server):
    url, _ = server
    c = _client(url)
    kw = dict(model=MODEL, messages=MSGS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert c.chat.completions.create(**kw, response_format={"type": "text"}).choices[0].message.content == \
        c.chat.completions.create(**kw).choices[0].message.content


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},  # no name
    {"type": "yaml"},
])
def test_bad_response_format_is_400(server, fmt):
    url, _ = server
    with pytest.raises(openai.BadRequestError):
        _client(url).chat.completions.create(model=MODEL, messages=MSGS, response_format=fmt, max_tokens=4)
