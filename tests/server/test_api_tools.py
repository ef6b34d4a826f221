"""Tool calling through the official `openai` client over tiny-v4.1 (random weights): tools and tool history
reach the prompt exactly as mini.chat_format renders them, forced calls (tool_choice required / named) come back as
tool_calls whose arguments validate against the tool's schema, a stream's tool_call deltas rebuild the same call,
and whatever else the model writes comes back as content, never an error."""
import json
import random

import jsonschema
import openai
import pytest
import torch

from server_apps import MODEL, tiny_server
from mini.chat_format import render_chat
from mini.server.tool_calls import parse_tool_calls

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"type": "string", "enum": ["C", "F"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    """tiny-v4.1 with a 4,096-token context: the tools section alone is ~1,000 tiny tokens."""
    yield from tiny_server(num_blocks=256)


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _check_call(name, arguments):
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_tools_and_history_are_rendered_into_the_prompt(server):
    url, app = server
    tok = app.state.server.llm.engine.tokenizer
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "C"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]
    for msgs in (USER, history):
        r = _client(url).chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=1,
                                                 temperature=0)
        assert r.usage.prompt_tokens == len(tok.encode(render_chat(msgs, tools=TOOLS)))
    assert "<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>" in render_chat(history, tools=TOOLS)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_call_validates_and_streams_the_same(server, choice):
    url, _ = server
    c = _client(url)
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
              max_tokens=300, temperature=1.0, seed=5)
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _check_call(call.function.name, call.function.arguments)
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    # the stream: rebuild the call from its deltas, OpenAI style (by index; name and arguments accumulate)
    rebuilt, finish, content, pieces = {}, None, "", 0
    for chunk in c.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = rebuilt.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        content += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        if chunk.choices[0].delta.tool_calls and chunk.choices[0].delta.tool_calls[0].function.arguments:
            pieces += 1
    assert finish == "tool_calls" and content == "" and list(rebuilt) == [0]
    assert rebuilt[0]["id"].startswith("call_")
    assert (rebuilt[0]["name"], rebuilt[0]["arguments"]) == (call.function.name, call.function.arguments)
    assert pieces >= 3  # the arguments stream as they are decoded ("{", the parameters, "}"), not at the end


def test_required_parallel_calls_each_validate(server):
    url, _ = server
    r = _client(url).chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                             max_tokens=400, temperature=0.7, seed=2)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    for call in ch.message.tool_calls:
        _check_call(call.function.name, call.function.arguments)


def _warm_prefix(c, **kw):
    """One request of the prompt first: a prompt's first prefill and a prefix-cache hit compute its last block in
    other chunks (other rounding), and the seeded draws compared below must see the same logits."""
    c.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, **kw)


def _rebuild_stream(chunks):
    """(content, [(name, arguments)], ids, finish_reason) from a chat stream, rebuilt as an OpenAI client does."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = ch.finish_reason or finish
    return content, [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tool_choice", ["auto", None])  # None: left out, auto when tools are offered
def test_auto_is_content_or_valid_calls_and_streams_the_same(server, tool_choice, parallel):
    """tool_choice auto (any parallel_tool_calls) runs under a grammar: over several seeds the random model's
    output is content, or calls whose arguments validate (never a malformed block as content); the stream,
    rebuilt from its deltas, equals the full response."""
    url, _ = server
    c = _client(url)
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    _warm_prefix(c, tools=TOOLS)
    for seed in range(4):
        kw = dict(model=MODEL, messages=USER, tools=TOOLS, parallel_tool_calls=parallel, max_tokens=24,
                  temperature=1.0, seed=seed, **extra)
        ch = c.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        assert ch.finish_reason in ("stop", "length", "tool_calls")
        assert "<｜DSML｜ calls>" not in (ch.message.content or "")
        assert len(calls) <= (24 if parallel else 1)
        for name, arguments in calls if ch.finish_reason == "tool_calls" else []:
            _check_call(name, arguments)
        assert _rebuild_stream(c.chat.completions.create(**kw, stream=True)) == \
            ((ch.message.content or ""), calls, ch.finish_reason)


def test_tool_choice_none_and_no_tools_decode_without_a_grammar(server):
    """Only requests that read calls get the tools grammar: tool_choice none and requests without tools reach
    the engine with no grammar (decoding exactly as before grammars), auto / required with one."""
    url, app = server
    seen, llm = [], app.state.server.llm
    generate = llm.generate

    def spy(ids, params, request_id, images=None):  # AsyncLLM.generate's signature, images included
        seen.append(params.grammar)
        return generate(ids, params, request_id, images)
    llm.generate = spy
    try:
        c = _client(url)
        for kw in (dict(), dict(tools=TOOLS, tool_choice="none"), dict(tools=TOOLS), dict(tools=TOOLS,
                   tool_choice="required"), dict(response_format={"type": "json_object"})):
            r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, seed=0, **kw)
            if kw.get("tool_choice") == "none":
                assert r.choices[0].message.tool_calls is None
    finally:
        llm.generate = generate
    assert seen[0] is None and seen[1] is None
    assert all(g is not None and "invoke0" in g for g in seen[2:4]) and "%json" in seen[4] and "invoke" not in seen[4]


def _allowed(backend, matcher, vocab):
    from mini.engine.sampler import unpack_bitmask
    return torch.nonzero(unpack_bitmask(backend.bitmask([matcher], "cpu"), vocab)[0]).flatten().tolist()


@pytest.mark.parametrize("parallel,thinking", [(True, False), (False, False), (True, True)])
def test_an_auto_block_is_well_formed_by_construction(server, parallel, thinking):
    """The auto grammar over the tiny tokenizer: free text (any, EOS allowed) until the model starts a block;
    from there, random walks over the allowed tokens (seeded) always end in a block that parses into calls of
    offered tools whose arguments validate; one call at most unless parallel; an unknown tool cannot start.
    Thinking mode: the same after free reasoning up to `</think>`."""
    from mini.server.grammars import tool_call_grammar
    from mini.chat_format import TOOL_CALLS_START
    _, app = server
    engine = app.state.server.llm.engine
    tok, backend, vocab = engine.tokenizer, engine.grammars, engine.config.vocab_size
    grammar = tool_call_grammar(TOOLS, parallel=parallel, thinking=thinking, optional=True)
    reasoning = "why \n\n<｜DSML｜ calls> </thi</think>" if thinking else ""
    m = backend.matcher(grammar)
    assert m.consume_tokens(tok.encode(reasoning + "Free text, even \n\n< and <｜DSML｜ invoke")), m.get_error()
    assert tok.eos_id in _allowed(backend, m, vocab)
    assert not backend.matcher(grammar).consume_tokens(
        tok.encode(reasoning + TOOL_CALLS_START + '\n<｜DSML｜ invoke name="rm"'))
    counts = []
    for seed in range(12):
        rng, m = random.Random(seed), backend.matcher(grammar)
        ids = tok.encode(reasoning + "Sure." + TOOL_CALLS_START)
        assert m.consume_tokens(ids)
        for _ in range(2000):
            allowed = _allowed(backend, m, vocab)
            if tok.eos_id in allowed:
                break
            ids.append(rng.choice(allowed))
            assert m.consume_token(ids[-1])
        text = tok.decode(ids)[len(reasoning):]
        content, calls = parse_tool_calls(text, set(SCHEMAS))
        assert content == "Sure." and calls, text
        for call in calls:
            _check_call(call.name, call.arguments)
        counts.append(len(calls))
    assert max(counts) > 1 if parallel else set(counts) == {1}


def test_auto_with_a_response_format_is_that_json_or_calls(server):
    """tool_choice auto with response_format: the answer is the format's JSON or a calls block (the first token
    decides, so the random model takes both ways over a few seeds); calls validate, parallel ones too, and the
    stream rebuilt from its deltas equals the full response."""
    url, _ = server
    c = _client(url)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    ways = set()
    _warm_prefix(c, tools=TOOLS)
    for seed in range(4):
        kw = dict(model=MODEL, messages=USER, tools=TOOLS, response_format=fmt, max_tokens=400, temperature=1.0,
                  seed=seed)
        ch = c.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        if ch.finish_reason == "tool_calls":
            assert ch.message.content is None and calls
            for name, arguments in calls:
                _check_call(name, arguments)
            ways.add("calls")
        elif ch.finish_reason == "stop":
            jsonschema.validate(json.loads(ch.message.content), schema)
            ways.add("json")
        assert _rebuild_stream(c.chat.completions.create(**kw, stream=True)) == \
            ((ch.message.content or ""), calls, ch.finish_reason)
    assert ways == {"calls", "json"}


def test_auto_takes_a_schema_llguidance_cannot_enforce(server):
    """A keyword llguidance does not implement (if/then) is left unenforced under auto (the request may not call
    the tool at all), and refused where the call is forced."""
    url, _ = server
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "if": {"minLength": 1}, "then": {"maxLength": 3}}}}}}]
    c = _client(url)
    r = c.chat.completions.create(model=MODEL, messages=USER, tools=tools, max_tokens=4, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="if"):
        c.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required", max_tokens=4)


def test_bad_tool_requests_are_400(server):
    url, _ = server
    c = _client(url)
    bad = [dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
           dict(tools=[{"type": "retrieval"}]),
           dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}),
           dict(tools=TOOLS + TOOLS[:1]),
           dict(messages=[{"role": "tool", "content": "r"}]),  # no tool_call_id
           dict(messages=[{"role": "user", "content": "x", "tool_calls": []}])]
    for kw in bad:
        kw = {"messages": USER, **kw}
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=MODEL, max_tokens=2, **kw)
    # a forced call with a response_format (the Agents SDK sends both): the output is the call
    r = c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, response_format={"type": "json_object"},
                                  tool_choice={"type": "function", "function": {"name": "get_time"}},
                                  max_tokens=300, seed=1)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == \
        "get_time"


# ------------------------------------------------------------------------------------------ the parser itself
CALL = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Pa"ris\n</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">[1, {"a": null}]</｜DSML｜ parameter>\n'
        '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def test_parser_reads_a_well_formed_block():
    content, calls = parse_tool_calls("Let me check." + CALL, {"get_weather"})
    assert content == "Let me check." and len(calls) == 1
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": 'Pa"ris\n', "days": [1, {"a": None}]}


@pytest.mark.parametrize("text", [
    CALL.replace("get_weather", "rm_rf"),  # a tool that is not offered
    CALL.replace("[1, {", "[1, {{"),  # a non-string value that is not JSON
    CALL.replace('string="false"', 'string="maybe"'),
    CALL[:-5],  # cut short
    CALL + " trailing words",
    CALL.replace("</｜DSML｜ invoke>", ""),
    "\n\n<｜DSML｜ calls>\n</｜DSML｜ calls>",  # no call
    CALL.replace('name="days"', 'name="city"'),  # a duplicate parameter
])
def test_malformed_blocks_are_content(text):
    assert parse_tool_calls(text, {"get_weather"}) == (text, [])


def test_parser_never_raises_on_garbage():
    rng = random.Random(0)
    pieces = ["\n\n<｜DSML｜ calls>", "\n", '<｜DSML｜ invoke name="get_weather">', '<｜DSML｜ parameter name="',
              'city" string="', 'true">', 'false">', "x", "1", "{", "</｜DSML｜ parameter>", "</｜DSML｜ invoke>",
              "</｜DSML｜ calls>", '"', ">", "<", "｜"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        content, calls = parse_tool_calls(text, {"get_weather"})
        assert (content, calls) == (text, []) or (calls and text.startswith(content))
        for c in calls:
            assert isinstance(json.loads(c.arguments), dict)


def _stream_locally(choice, text, finish_reason, step=3):
    """Feed a ChatChoice the output growing by `step` characters; (deltas per output, final output)."""
    from mini.engine import RequestOutput
    outs = [RequestOutput("r", [1], [], text[:n], [7], "", n >= len(text), finish_reason if n >= len(text) else None)
            for n in list(range(step, len(text), step)) + [len(text)]]
    return [choice.deltas(o) for o in outs], outs[-1]


def _rebuild(deltas):
    """Rebuild content and calls from deltas as an OpenAI client does (by index; arguments accumulate)."""
    content, calls = "", {}
    for d in (d for ds in deltas for d in ds):
        content += d.get("content", "")
        for t in d.get("tool_calls", []):
            entry = calls.setdefault(t["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = t.get("id") or entry["id"]
            entry["name"] += t.get("function", {}).get("name", "")
            entry["arguments"] += t.get("function", {}).get("arguments", "")
    return content, [calls[k] for k in sorted(calls)]


TWO_CALLS = ("Checking." + CALL.replace("</｜DSML｜ calls>", "")
             + '<｜DSML｜ invoke name="get_time">\n<｜DSML｜ parameter name="tz" string="true">C</ET</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


@pytest.mark.parametrize("step", [1, 2, 7])
def test_enforced_calls_stream_as_they_are_decoded(step):
    """Each call's deltas start once its name is decoded and its arguments grow parameter by
    parameter (a string value as it grows), long before the output ends; rebuilt from the deltas, content and
    calls equal the final message, which equals the strict parse of the whole text."""
    from mini.server.chat_output import ChatChoice
    names = {"get_weather", "get_time"}
    choice = ChatChoice(0, False, names)
    deltas, last = _stream_locally(choice, TWO_CALLS, "stop", step)
    content, calls = _rebuild(deltas)
    msg = ChatChoice(0, False, names).message(last)
    strict_content, strict = parse_tool_calls(TWO_CALLS, names)
    assert content == strict_content == msg["content"] == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in strict] \
        == [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    assert [c["id"] for c in calls] == [c.id for c in choice.calls] and choice.finish_reason(last) == "tool_calls"
    assert json.loads(calls[1]["arguments"]) == {"tz": "C</ET"}
    first_call = next(i for i, ds in enumerate(deltas) if any("tool_calls" in d for d in ds))
    assert first_call < len(deltas) // 2  # the first call shows while the output still grows
    pieces = sum(1 for ds in deltas for d in ds for t in d.get("tool_calls", []) if t["function"]["arguments"])
    assert pieces >= 6


def test_a_streamed_block_cut_short_keeps_its_calls_alike():
    """max_tokens inside a block: stream and final message both keep the calls as far as they got (the arguments
    text cut where the output ends), finish_reason "length"."""
    from mini.server.chat_output import ChatChoice
    names = {"get_weather", "get_time"}
    cut = TWO_CALLS[:TWO_CALLS.index("C</ET") + 3]
    choice = ChatChoice(0, False, names)
    deltas, last = _stream_locally(choice, cut, "length", 2)
    content, calls = _rebuild(deltas)
    msg = ChatChoice(0, False, names).message(last)
    assert choice.finish_reason(last) == "length"
    assert content == msg["content"] == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    assert [c["name"] for c in calls] == ["get_weather", "get_time"] and calls[1]["arguments"] == '{"tz": "C</'


def test_partial_parse_agrees_with_the_full_parse():
    """Seeded fuzz: blocks rendered from random calls (string values holding markup prefixes), some with one edit.
    The partial parse of a whole block is "closed" exactly when the full parse accepts it, with the same calls;
    while a well-formed block grows, each call's arguments only ever extend what was shown."""
    from mini.server.tool_calls import parse_partial_block
    from mini.chat_format import TOOL_CALLS_START, render_tool_calls
    rng, names = random.Random(0), {"f", "get_weather"}
    values = ["", "a\nb", 'q"</', "x</｜DSML｜ par", "é", 3, -1.5, True, None, [1, {"k": "v"}], {"a": []}]
    edits = ["\n", '">', '"', "</｜DSML｜ parameter>", "</｜DSML｜ invoke>", "</｜DSML｜ calls>", "x", "{", ""]
    accepted = 0
    for trial in range(600):
        calls = [{"function": {"name": rng.choice(sorted(names)), "arguments": json.dumps(
            {f"p{j}": rng.choice(values) for j in range(rng.randint(0, 3))})}} for _ in range(rng.randint(1, 3))]
        text = render_tool_calls(calls)
        if trial % 2:
            i = rng.randrange(len(TOOL_CALLS_START), len(text) + 1)
            text = text[:i] + rng.choice(edits) + text[min(len(text), i + rng.randint(0, 4)):]
        block = text[len(TOOL_CALLS_START):]
        _, strict = parse_tool_calls(text, names)
        partial, state = parse_partial_block(block, names, final=True)
        assert (state == "closed") == bool(strict), text
        if strict:
            accepted += 1
            assert [(c.name, c.arguments) for c in partial] == [(c.name, c.arguments) for c in strict]
            shown = {}
            for n in range(len(block)):
                for k, c in enumerate(parse_partial_block(block[:n], names, final=False)[0]):
                    assert c.arguments.startswith(shown.get(k, "")), block[:n]
                    shown[k] = c.arguments
    assert accepted > 300
