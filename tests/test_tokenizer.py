import json
import random
import re
import unicodedata

import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from mini.chat_format import ASSISTANT, END_THINK, SYSTEM, THINK, USER, render_chat
from mini.checkpoint.tiny_tokenizer import TINY_SPECIALS, build_tiny_tokenizer, write_tiny_tokenizer
from mini.config import TINY_V41
from mini.tokenizer import BOS, EOS, Tokenizer, compressed_token_map, load_token_map

EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Tokenizer.from_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), 512))


# ------------------------------------------------------------------------------------------ tiny tokenizer
def test_tiny_tokenizer_ids_and_size(tiny):
    assert len(tiny) == 512 == TINY_V41.vocab_size
    assert [tiny.token_to_id(t) for t in TINY_SPECIALS] == list(range(len(TINY_SPECIALS)))
    assert (tiny.bos_id, tiny.eos_id, tiny.token_to_id("<｜▁pad▁｜>")) == (0, 1, 2)


def test_tiny_tokenizer_is_deterministic(tmp_path):
    a = write_tiny_tokenizer(tmp_path / "a", 512)
    b = write_tiny_tokenizer(tmp_path / "b", 512)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    for size in (264, 300, 1000):  # 1000 is beyond what the built-in corpus alone supports
        tok = build_tiny_tokenizer(size)
        assert tok.get_vocab_size() == size
        assert tok.decode(tok.encode("any text: ü 🎉").ids) == "any text: ü 🎉"
    for bad in (100, 5000):
        with pytest.raises(ValueError):
            build_tiny_tokenizer(bad)


def _random_text(rng, n):
    pools = ["abcdefghijklmnopqrstuvwxyz ABC", " \t\n\r", "0123456789.,;:!?'\"()[]{}<>|/\\", "éàüßçñ€£¥",
             "你好世界日本語한국어", "🎉👍🏽🚀\u200d", "\u0301\u0308\x00\x07\x7f"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(n))


def test_tiny_tokenizer_round_trips_any_utf8(tiny):
    rng = random.Random(7)
    for _ in range(200):
        text = _random_text(rng, rng.randint(0, 60))
        ids = tiny.encode(text)
        assert all(0 <= i < 512 for i in ids)
        assert tiny.decode(ids) == text


def test_special_tokens_in_text_encode_as_single_ids(tiny):
    ids = tiny.encode(f"{BOS}{SYSTEM}sys{USER}hi{ASSISTANT}{THINK}r{END_THINK}ok{EOS}")
    specials = [i for i in ids if i < len(TINY_SPECIALS)]
    assert specials == [0, 5, 3, 4, 6, 7, 1]
    assert tiny.encode("hi", add_bos=True)[0] == 0 and tiny.encode("hi")[0] != 0
    assert tiny.decode(ids, skip_special_tokens=True).startswith(SYSTEM)  # role markers are not skipped
    assert BOS not in tiny.decode(ids, skip_special_tokens=True)


def test_from_dir_reads_dict_form_special_tokens(tmp_path):
    d = write_tiny_tokenizer(tmp_path, 300)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = {"content": EOS}  # deliberately swapped: proves the config is read
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).bos_id == 1


# ------------------------------------------------------------------------------------------ streaming
def test_stream_decoder_matches_full_decode(tiny):
    rng = random.Random(3)
    for trial in range(100):
        if trial % 2:
            ids = tiny.encode(_random_text(rng, rng.randint(1, 40)))
        else:  # arbitrary ids, including lone continuation bytes that never complete
            ids = [rng.randrange(len(TINY_SPECIALS), 512) for _ in range(rng.randint(1, 30))]
        stream = tiny.stream()
        pieces = [stream.push(i) for i in ids]
        tail = stream.flush()
        assert "".join(pieces) + tail == tiny.decode(ids)
        if trial % 2:
            assert not any("\ufffd" in p for p in pieces)  # incomplete UTF-8 is held back, never emitted


def test_stream_decoder_holds_partial_characters(tiny):
    ids = tiny.encode("a🎉b")
    stream = tiny.stream()
    out = [stream.push(i) for i in ids]
    assert "".join(out) == "a🎉b" and "" in out  # some byte tokens of the emoji emitted nothing yet


# ------------------------------------------------------------------------------------------ Engram map
def _python_key(text, raw):
    """Spec §2.3 step 1 with Python's unicodedata (an independent implementation of the normaliser)."""
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if unicodedata.category(c) != "Mn").lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    s = " " if s == " " else s.strip()
    return s or text


def test_tiny_compressed_vocab_matches_config_and_python_rederivation(tiny):
    tmap = compressed_token_map(tiny)
    assert tmap.dtype == np.int64 and tmap.shape == (512,)
    assert int(tmap.max()) + 1 == TINY_V41.engram_compressed_vocab_size
    keys = {}
    want = [keys.setdefault(_python_key(tiny.backend.decode([i], skip_special_tokens=False), tiny.id_to_token(i)),
                            len(keys)) for i in range(len(tiny))]
    assert tmap.tolist() == want


def test_load_token_map_from_a_model_dir(tmp_path, tiny):
    d = write_tiny_tokenizer(tmp_path, 512)
    assert np.array_equal(load_token_map(d), compressed_token_map(tiny))


def test_compressed_map_rules_on_a_word_level_vocab():
    vocab = ["The", " the", "THE", "thé", " ", "  ", "\t\n", "x\ufffd", "X\ufffd", "", "ﬁ", "fi", " x ", "x"]
    backend = Backend(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="x"))
    got = compressed_token_map(backend).tolist()
    # case, accents and surrounding space fold together; whitespace-only tokens become one " " id;
    # U+FFFD decodes are kept apart by their raw token; NFKC folds the ligature; first-seen order
    assert got == [0, 0, 0, 0, 1, 1, 1, 2, 3, 4, 5, 5, 6, 6]


# ------------------------------------------------------------------------------------------ chat format
def test_chat_single_turn():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render_chat(msgs) == f"{BOS}{USER}Hi{ASSISTANT}{END_THINK}"
    assert render_chat(msgs, thinking=True) == f"{BOS}{SYSTEM}{EFFORT.format(75)}{USER}Hi{ASSISTANT}{THINK}"


@pytest.mark.parametrize("effort,value", [("low", 50), ("high", 75), ("max", 100), (33, 33), (None, 75)])
def test_chat_reasoning_effort(effort, value):
    got = render_chat([{"role": "user", "content": "Q"}], thinking=True, reasoning_effort=effort)
    assert got == f"{BOS}{SYSTEM}{EFFORT.format(value)}{USER}Q{ASSISTANT}{THINK}"
    # chat mode has no effort line at all
    assert render_chat([{"role": "user", "content": "Q"}], reasoning_effort=effort) == \
        f"{BOS}{USER}Q{ASSISTANT}{END_THINK}"


@pytest.mark.parametrize("effort", ["medium", 0, 101, 2.5])
def test_chat_invalid_effort(effort):
    with pytest.raises(ValueError):
        render_chat([{"role": "user", "content": "Q"}], thinking=True, reasoning_effort=effort)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "u1"},
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "user", "content": "u2"},
]


def test_chat_multi_turn_chat_mode():
    assert render_chat(CONVERSATION) == (f"{BOS}{SYSTEM}Be brief.{USER}u1{ASSISTANT}{END_THINK}a1{EOS}"
                                         f"{USER}u2{ASSISTANT}{END_THINK}")


def test_chat_multi_turn_thinking_drops_earlier_reasoning():
    got = render_chat(CONVERSATION, thinking=True)
    assert got == (f"{BOS}{SYSTEM}{EFFORT.format(75)}Be brief.{USER}u1{ASSISTANT}{END_THINK}a1{EOS}"
                   f"{USER}u2{ASSISTANT}{THINK}")
    assert "r1" not in got


def test_chat_reasoning_kept_after_the_last_user_turn():
    msgs = CONVERSATION + [{"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    assert render_chat(msgs, thinking=True).endswith(f"{USER}u2{ASSISTANT}{THINK}r2{END_THINK}a2{EOS}")
    assert render_chat(msgs).endswith(f"{USER}u2{ASSISTANT}{END_THINK}a2{EOS}")


def test_chat_mid_conversation_system_and_tool_results():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "system", "content": "new rule"}]
    assert render_chat(msgs) == f"{BOS}{USER}q{ASSISTANT}{END_THINK}a{EOS}{SYSTEM}new rule{ASSISTANT}{END_THINK}"
    msgs = [{"role": "user", "content": "q"}, {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
    assert render_chat(msgs) == (f"{BOS}{USER}q\n\n<tool_result>r1</tool_result>\n\n<tool_result>r2</tool_result>"
                                 f"{ASSISTANT}{END_THINK}")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert render_chat(msgs, thinking=True) == f"{BOS}{SYSTEM}{EFFORT.format(75)}s{USER}q{ASSISTANT}{THINK}"


def test_chat_rejects_unsupported_features():
    with pytest.raises(ValueError):
        render_chat([{"role": "user", "content": "q", "tools": [{"type": "function"}]}])
    with pytest.raises(ValueError):
        render_chat([{"role": "narrator", "content": "q"}])


def test_chat_prompt_encodes_with_special_ids(tiny):
    ids = tiny.encode(render_chat(CONVERSATION, thinking=True))
    assert ids[:2] == [0, 5] and ids[-2:] == [4, 6]
    assert ids.count(1) == 1 and ids.count(3) == 2


# ------------------------------------------------------------------------------------------ tools (DSML)
# Written out by hand from the V4.1 encoder's rules (spec §5): the tools section follows the first system message's
# text after a blank line; calls follow an assistant turn's content after a blank line; results join the user turn.
TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Météo", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
{"description": "Local time", "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Météo", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"description": "Local time", "name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},  # key order is kept as given
]
CALLS_TEXT = ('\n\n<｜DSML｜ calls>\n'
              '<｜DSML｜ invoke name="get_weather">\n'
              '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
              '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
              '</｜DSML｜ invoke>\n'
              '<｜DSML｜ invoke name="get_time">\n'
              '<｜DSML｜ parameter name="tz" string="true">CET</｜DSML｜ parameter>\n'
              '</｜DSML｜ invoke>\n'
              '</｜DSML｜ calls>')
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather and time?"},
    {"role": "assistant", "content": "", "reasoning_content": "r1", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 3}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    # results arrive out of order: the prompt puts them in the order of the calls
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny, noon.", "reasoning_content": "r2"},
    {"role": "user", "content": "thanks"},
]


def test_chat_tools_single_turn():
    msgs = [{"role": "user", "content": "Weather?"}]
    assert render_chat(msgs, tools=TOOLS) == f"{BOS}{SYSTEM}\n\n{TOOLS_SECTION}{USER}Weather?{ASSISTANT}{END_THINK}"
    assert render_chat(msgs, thinking=True, tools=TOOLS) == (
        f"{BOS}{SYSTEM}{EFFORT.format(75)}\n\n{TOOLS_SECTION}{USER}Weather?{ASSISTANT}{THINK}")
    sys_msgs = [{"role": "developer", "content": "Be brief."}, *msgs]  # developer is a system message
    assert render_chat(sys_msgs, tools=TOOLS) == (
        f"{BOS}{SYSTEM}Be brief.\n\n{TOOLS_SECTION}{USER}Weather?{ASSISTANT}{END_THINK}")


def test_chat_multi_turn_tool_use_chat_mode():
    assert render_chat(TOOL_CONVERSATION, tools=TOOLS) == (
        f"{BOS}{SYSTEM}You are helpful.\n\n{TOOLS_SECTION}"
        f"{USER}Weather and time?{ASSISTANT}{END_THINK}{CALLS_TEXT}{EOS}"
        f"{USER}<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>{ASSISTANT}{END_THINK}"
        f"Sunny, noon.{EOS}{USER}thanks{ASSISTANT}{END_THINK}")


def test_chat_multi_turn_tool_use_thinking_keeps_all_reasoning():
    # with tools the encoder does not drop earlier reasoning, and every header opens <think>
    assert render_chat(TOOL_CONVERSATION, thinking=True, tools=TOOLS, reasoning_effort="max") == (
        f"{BOS}{SYSTEM}{EFFORT.format(100)}You are helpful.\n\n{TOOLS_SECTION}"
        f"{USER}Weather and time?{ASSISTANT}{THINK}r1{END_THINK}{CALLS_TEXT}{EOS}"
        f"{USER}<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>{ASSISTANT}{THINK}"
        f"r2{END_THINK}Sunny, noon.{EOS}{USER}thanks{ASSISTANT}{THINK}")


def test_chat_tool_history_without_tools_drops_earlier_reasoning():
    got = render_chat(TOOL_CONVERSATION, thinking=True)
    assert got == (
        f"{BOS}{SYSTEM}{EFFORT.format(75)}You are helpful."
        f"{USER}Weather and time?{ASSISTANT}{END_THINK}{CALLS_TEXT}{EOS}"
        f"{USER}<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>{ASSISTANT}{END_THINK}"
        f"Sunny, noon.{EOS}{USER}thanks{ASSISTANT}{THINK}")
    # tool results make a user turn: the reasoning before them is dropped too
    tail = TOOL_CONVERSATION[:5]
    assert render_chat(tail, thinking=True).endswith(
        f"{USER}Weather and time?{ASSISTANT}{END_THINK}{CALLS_TEXT}{EOS}"
        f"{USER}<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>{ASSISTANT}{THINK}")


def test_chat_tool_call_argument_forms():
    def call(args):
        return [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}]
    head = f"{BOS}{USER}q{ASSISTANT}{END_THINK}ok\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n"
    tail = "\n</｜DSML｜ invoke>\n</｜DSML｜ calls>" + EOS
    nested = '<｜DSML｜ parameter name="a" string="false">[1, "é", {"b": null}]</｜DSML｜ parameter>'
    assert render_chat(call({"a": [1, "é", {"b": None}]})) == head + nested + tail  # an object as is
    assert render_chat(call(json.dumps(json.dumps({"a": [1, "é", {"b": None}]})))) == head + nested + tail
    assert render_chat(call("not json")) == (
        head + '<｜DSML｜ parameter name="arguments" string="true">not json</｜DSML｜ parameter>' + tail)
    assert render_chat(call("{}")) == head + tail  # no parameters: an empty line
    with pytest.raises(ValueError):
        render_chat(call("{}")[:1], tools=[{"type": "function", "function": {"name": "a::b::c"}}])


def test_chat_text_parts_join_with_a_blank_line():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "x"},
            {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r"},
                                                              {"type": "text", "text": "s"}]}]
    assert render_chat(msgs) == (f"{BOS}{USER}a\n\nb{ASSISTANT}{END_THINK}x{EOS}"
                                 f"{USER}<tool_result>r\n\ns</tool_result>{ASSISTANT}{END_THINK}")
