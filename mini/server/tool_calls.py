"""The model's side of V4.1 tool calling: its DSML calls block parsed back into OpenAI `tool_calls`.

An assistant turn that calls tools is `content` + `\\n\\n<｜DSML｜ calls>` + invokes + `</｜DSML｜ calls>`
(mini.chat_format.render_tool_calls writes the same markup into prompts). The parser is strict about the markup and
total: text that is not a well-formed block naming offered tools (a random-weight model writes such text) is
returned as content, never an error.

The server reads calls only where a grammar makes any block well-formed (tools offered and tool_choice auto,
required or named; mini.server.grammars), so a stream shows each call as it is decoded (`parse_partial_block`,
the same rules read over growing text): the call once its name is complete, then its arguments text growing with
each parameter (a string's value as it grows), always a prefix of the final arguments; a block cut short by
max_tokens or a stop string keeps the calls as far as they got, in a stream and in a full response alike.
`parse_tool_calls`, the strict parse of a finished text, is the rule the partial parse is tested against.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from mini.chat_format import CALLS_CLOSE, DSML, INVOKE_CLOSE, PARAM_CLOSE, TOOL_CALLS_START

_INVOKE_HEAD = f'<{DSML} invoke name="'
_PARAM_HEAD = f'<{DSML} parameter name="'


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _Malformed(Exception):
    pass


class _Cursor:
    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def skip_newlines(self) -> None:
        while self.text.startswith("\n", self.pos):
            self.pos += 1

    def take(self, literal: str) -> bool:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str) -> None:
        if not self.take(literal):
            raise _Malformed(f"expected {literal!r} at {self.pos}")

    def until(self, literal: str) -> str:
        end = self.text.find(literal, self.pos)
        if end < 0:
            raise _Malformed(f"no {literal!r}")
        value, self.pos = self.text[self.pos:end], end + len(literal)
        return value


def _parse_block(block: str, names: set[str] | None) -> list[ToolCall]:
    """The invokes of a calls block (the text after `<｜DSML｜ calls>`); raises _Malformed."""
    cur, calls = _Cursor(block), []
    cur.skip_newlines()
    while not cur.take(CALLS_CLOSE):
        cur.expect(_INVOKE_HEAD)
        name = cur.until('">')
        if not name or "\n" in name or (names is not None and name not in names):
            raise _Malformed(f"unknown tool {name!r}")
        args: dict = {}
        cur.skip_newlines()
        while not cur.take(INVOKE_CLOSE):
            cur.expect(_PARAM_HEAD)
            key = cur.until('" string="')
            flag = cur.until('">')
            raw = cur.until(PARAM_CLOSE)
            if key in args or flag not in ("true", "false") or "\n" in key:
                raise _Malformed(f"bad parameter {key!r}")
            if flag == "true":
                args[key] = raw
            else:
                try:
                    args[key] = json.loads(raw)
                except ValueError:
                    raise _Malformed(f"parameter {key!r} is not JSON") from None
            cur.skip_newlines()
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        cur.skip_newlines()
    if cur.text[cur.pos:].strip() or not calls:
        raise _Malformed("text after the calls block" if calls else "no calls")
    return calls


@dataclass
class PartialCall:
    """A call of a block that may still grow: its arguments text is a prefix of the final one."""
    name: str
    arguments: str
    complete: bool = False


class _Growing(_Cursor):
    """A cursor over text that may still grow: None where the text ends before the answer is known."""

    def take(self, literal: str) -> bool | None:
        rest = self.text[self.pos:self.pos + len(literal)]
        if rest == literal:
            self.pos += len(literal)
            return True
        return None if literal.startswith(rest) and self.pos + len(rest) == len(self.text) else False

    def until(self, literal: str) -> str | None:
        end = self.text.find(literal, self.pos)
        if end < 0:
            return None
        value, self.pos = self.text[self.pos:end], end + len(literal)
        return value

    def next_of(self, close: str, head: str) -> str:
        """Which marker comes next, taken: "close" or "head"; else "open" (the text ends first) or "malformed"."""
        closed = self.take(close)
        if closed:
            return "close"
        opened = self.take(head)
        if opened:
            return "head"
        return "open" if closed is None or opened is None else "malformed"


def _shown(raw: str, final: bool) -> str:
    """A growing string value less a tail that could begin its end marker (all of it once the output ended)."""
    if not final:
        for k in range(min(len(PARAM_CLOSE) - 1, len(raw)), 0, -1):
            if raw.endswith(PARAM_CLOSE[:k]):
                return raw[:-k]
    return raw


def parse_partial_block(block: str, names: set[str] | None, final: bool) -> tuple[list[PartialCall], str]:
    """(calls so far, state) of a calls block that may still grow (the text after `<｜DSML｜ calls>`); `final`:
    the output has ended. The same rules as the full parse, read as far as the text goes: a call appears once its
    name is complete; its arguments are `{`, then `"key": value` per parameter (`, ` between: json.dumps's
    layout, so a well-formed block's final arguments equal `parse_tool_calls`'), a string value shown as it grows,
    another value once complete, and `}` at the invoke's end. `state`: "closed" (a well-formed block: what
    `parse_tool_calls` accepts), "open" (the text ends inside the block) or "malformed" (the text breaks the rules
    there; the calls before stay)."""
    cur, calls = _Growing(block), []
    cur.skip_newlines()
    while True:
        step = cur.next_of(CALLS_CLOSE, _INVOKE_HEAD)
        if step == "close":
            return calls, "malformed" if cur.text[cur.pos:].strip() or not calls else "closed"
        if step != "head":
            return calls, step
        name = cur.until('">')
        if name is None:
            return calls, "open"
        if not name or "\n" in name or (names is not None and name not in names):
            return calls, "malformed"
        call, keys = PartialCall(name, "{"), set()
        calls.append(call)
        cur.skip_newlines()
        while True:
            step = cur.next_of(INVOKE_CLOSE, _PARAM_HEAD)
            if step == "close":
                call.arguments += "}"
                call.complete = True
                break
            if step != "head":
                return calls, step
            key = cur.until('" string="')
            flag = None if key is None else cur.until('">')
            if flag is None:
                return calls, "open"
            if key in keys or flag not in ("true", "false") or "\n" in key:
                return calls, "malformed"
            keys.add(key)
            call.arguments += (", " if len(keys) > 1 else "") + json.dumps(key, ensure_ascii=False) + ": "
            raw = cur.until(PARAM_CLOSE)
            if raw is None:  # the value is still growing
                if flag == "true":
                    call.arguments += json.dumps(_shown(cur.text[cur.pos:], final), ensure_ascii=False)[:-1]
                return calls, "open"
            if flag == "true":
                call.arguments += json.dumps(raw, ensure_ascii=False)
            else:
                try:
                    call.arguments += json.dumps(json.loads(raw), ensure_ascii=False)
                except ValueError:
                    return calls, "malformed"
            cur.skip_newlines()
        cur.skip_newlines()


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished assistant turn (reasoning already split off). `names`: the offered tools;
    a call of any other name makes the block malformed. A malformed block leaves the whole text as content."""
    i = text.find(TOOL_CALLS_START)
    if i < 0:
        return text, []
    try:
        return text[:i], _parse_block(text[i + len(TOOL_CALLS_START):], names)
    except _Malformed:
        return text, []


def held_back(text: str) -> int:
    """Where streamed content must stop: at the calls block's start, or at a tail that could begin it."""
    i = text.find(TOOL_CALLS_START)
    if i >= 0:
        return i
    for k in range(len(TOOL_CALLS_START) - 1, 0, -1):
        if text.endswith(TOOL_CALLS_START[:k]):
            return len(text) - k
    return len(text)
