"""The fields clients send as a matter of course (issue 30, item 3), over tiny-v4.1 (random weights) through the
official `openai` client: hints and the caller's records are accepted and change nothing in the prompt; vLLM's
extensions that change the output are honoured (min_tokens, skip_special_tokens, echo, return_tokens_as_token_ids,
structured_outputs / guided_*, continuous_usage_stats); reasoning_effort "minimal" is V4.1's "low"."""
import json
import re

import httpx
import jsonschema
import openai
import pytest

from server_apps import MODEL
from mini.server.protocol import ChatCompletionRequest
from mini.tokenizer import BOS

MSGS = [{"role": "user", "content": "Say something."}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _chat(url, **body):
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "max_tokens": 4,
                                                       "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _completion(url, **body):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4,
                                                  "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_hints_are_accepted_and_leave_the_prompt_alone(server):
    url, _ = server
    plain = _client(url).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, temperature=0)
    named = [{"role": "system", "content": "Be brief.", "name": "rules"}, {**MSGS[0], "name": "alice"},
             {"role": "assistant", "content": "Hi.", "name": "bot"}, {**MSGS[0], "name": "bob"}]
    unnamed = [{k: v for k, v in m.items() if k != "name"} for m in named]
    hints = dict(store=True, metadata={"run": "7"}, service_tier="flex", safety_identifier="user-1",
                 prompt_cache_key="k", verbosity="low", stream_options=None)
    r = _client(url).chat.completions.create(model=MODEL, messages=named, max_tokens=2, temperature=0, **hints)
    same = _client(url).chat.completions.create(model=MODEL, messages=unnamed, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == same.usage.prompt_tokens and r.choices[0].message.content == \
        same.choices[0].message.content
    assert r.service_tier == "default" and plain.service_tier is None
    chunks = list(_client(url).chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens == 2
    done = _completion(url, metadata={"a": "b"}, store=False, user="u", safety_identifier="s", prompt_cache_key="k")
    assert done["usage"]["completion_tokens"] == 4


def test_min_tokens_holds_back_eos(server):
    url, app = server
    eos = app.state.server.llm.engine.tokenizer.eos_id
    # the ending token counts as an output token (its text is not part of the output)
    ends_at_once = _completion(url, logit_bias={str(eos): 100}, max_tokens=8)
    assert ends_at_once["usage"]["completion_tokens"] == 1 and ends_at_once["choices"][0]["finish_reason"] == "stop"
    held = _completion(url, logit_bias={str(eos): 100}, max_tokens=8, min_tokens=5)
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"
    chat = _chat(url, logit_bias={str(eos): 100}, max_tokens=8, min_tokens=3, stop_token_ids=[eos])
    assert chat["usage"]["completion_tokens"] == 4


def test_skip_special_tokens_false_keeps_bos_in_the_text(server):
    url, app = server
    bos = app.state.server.llm.engine.tokenizer.bos_id
    kept = _completion(url, logit_bias={str(bos): 100}, max_tokens=2, skip_special_tokens=False)
    skipped = _completion(url, logit_bias={str(bos): 100}, max_tokens=2)
    assert kept["choices"][0]["text"] == BOS * 2 and skipped["choices"][0]["text"] == ""


def test_echo_puts_the_prompt_first_streamed_and_not(server):
    url, app = server
    r = _client(url).completions.create(model=MODEL, prompt="Once upon", max_tokens=3, temperature=0, echo=True)
    plain = _client(url).completions.create(model=MODEL, prompt="Once upon", max_tokens=3, temperature=0)
    assert r.choices[0].text == "Once upon" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in _client(url).completions.create(
        model=MODEL, prompt="Once upon", max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    ids = app.state.server.llm.engine.tokenizer.encode("Once upon")
    assert _completion(url, prompt=ids, echo=True, max_tokens=1)["choices"][0]["text"].startswith("Once upon")


def test_return_tokens_as_token_ids(server):
    url, _ = server
    r = _completion(url, logprobs=2, return_tokens_as_token_ids=True)
    lp = r["choices"][0]["logprobs"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp["tokens"]) and len(lp["tokens"]) == 4
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp["top_logprobs"] for t in top)
    c = _chat(url, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    assert all(re.fullmatch(r"token_id:\d+", e["token"]) for e in c["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("field,value,check", [
    ("guided_choice", ["yes", "no", "maybe"], lambda t: t in ("yes", "no", "maybe")),
    ("guided_regex", r"[0-9]{3}/[a-c]{2}", lambda t: re.fullmatch(r"[0-9]{3}/[a-c]{2}", t)),
    ("guided_json", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("structured_outputs", {"json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("structured_outputs", {"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ("structured_outputs", {"json_object": True}, lambda t: t.startswith("{")),  # free keys: may run long
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_structured_outputs_and_guided_fields(server, field, value, check, endpoint):
    url, _ = server
    for seed in (1, 2):
        if endpoint == "chat":
            text = _chat(url, **{field: value}, max_tokens=60, temperature=1.0, seed=seed)["choices"][0]["message"][
                "content"]
        else:
            text = _completion(url, **{field: value}, max_tokens=60, temperature=1.0, seed=seed)["choices"][0]["text"]
        assert check(text), text


def test_continuous_usage_stats_in_every_chunk(server):
    url, _ = server
    for path, body in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "Once"})):
        with httpx.stream("POST", url + path, json={"model": MODEL, **body, "max_tokens": 4, "stream": True,
                                                     "temperature": 0, "ignore_eos": True, "stream_options": {
                                                         "continuous_usage_stats": True}}, timeout=120) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        counted = [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]
        assert counted[-1] == 4 and counted == sorted(counted) and len(counted) >= 4, (path, chunks)


def test_reasoning_effort_minimal_is_v41_low():
    def prompt(effort):
        return ChatCompletionRequest(messages=MSGS, thinking=True, reasoning_effort=effort).prompt()
    assert prompt("minimal") == prompt("low") != prompt("high") == prompt("medium")
    assert prompt("xhigh") == prompt("max") != prompt("high")
    assert "Reasoning Effort: 50" in prompt("minimal")
