"""llguidance grammars (Lark syntax) for what the OpenAI API asks to enforce: `response_format` (a JSON object, a
JSON schema) and tool calls (`tool_choice` "auto", "required" or a named function), the latter in V4.1's DSML
markup with each argument checked against its schema. Under "auto" the model writes free content and may start a
calls block; the block it starts is then well-formed by construction (names among the tools, arguments per
schema), as SGLang's structural tags and vLLM's guided tool decoding make them.

JSON is written with `, ` and `: ` and no other whitespace (a model cannot pad it forever). In thinking mode the
output starts with free reasoning up to `</think>`; the constraint applies after it.

Free text that ends at a delimiter (the reasoning, a raw string argument, content before a calls block) is a lazy
rule, `name[suffix="DELIMITER"]: /regex/`: it ends at the delimiter's first occurrence. llguidance's lexemes are
greedy otherwise, so "any text without X, then X" written as a regex intersection could never end at X.
"""
from __future__ import annotations

import json
import re

from mini.chat_format import CALLS_CLOSE, END_THINK, INVOKE_CLOSE, PARAM_CLOSE, TOOL_CALLS_START, invoke_open, \
    param_open

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY = r"(.|\n)"


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _until(name: str, delimiter: str, length: str = "*") -> str:
    """Rule `name`: text of `length` (a regex repeat) up to the first `delimiter`, which it includes."""
    return f"{name}[suffix={_lit(delimiter)}]: /{_ANY}{length}/"


def _without(text: str) -> str:
    """A Lark regex (for a terminal that ends the output): any text that does not contain `text`."""
    escaped = "".join("\\n" if c == "\n" else "\\" + c if c in r"\/.^$*+?()[]{}|-" else c for c in text)
    return f"/{_ANY}*/ & ~/{_ANY}*{escaped}{_ANY}*/"


def _json(schema: dict, lenient: bool = False) -> str:
    """`lenient`: keywords llguidance does not implement (if/then, dependentRequired, ...) are not enforced,
    instead of the grammar being refused."""
    style = {**JSON_STYLE, "lenient": True} if lenient else JSON_STYLE
    return "%json " + json.dumps({**schema, "x-guidance": style}, ensure_ascii=False)


def _with_reasoning(body: list[str], thinking: bool) -> str:
    """`body`: rules, the first named `answer`."""
    head = ["start: reasoning answer", _until("reasoning", END_THINK)] if thinking else ["start: answer"]
    return "\n".join(head + body) + "\n"


def json_grammar(schema: dict | None, thinking: bool = False) -> str:
    """`schema` None: any JSON object (response_format json_object)."""
    return _with_reasoning([f"answer: {_json(schema if schema is not None else {'type': 'object'})}"], thinking)


def _is_plain_string(schema: dict) -> bool:
    """Written raw (string="true"): a string schema with nothing a raw value could not be checked against."""
    return schema.get("type") == "string" and not set(schema) & {"pattern", "format", "const", "anyOf", "oneOf",
                                                                   "allOf", "$ref", "not", "if", "then", "else"}


def _raw_value(name: str, schema: dict) -> str:
    """Rule `name`: a string argument written raw, with the parameter's closing tag."""
    if "enum" in schema:
        values = [v for v in schema["enum"] if isinstance(v, str)]
        if not values:
            raise ValueError(f"enum {schema['enum']!r} of a string parameter has no string")
        return f"{name}: ({' | '.join(_lit(v) for v in values)}) {_lit(PARAM_CLOSE)}"
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    return _until(name, PARAM_CLOSE, f"{{{lo},{int(hi)}}}" if hi is not None else (f"{{{lo},}}" if lo else "*"))


def _invoke_rules(i: int, name: str, parameters: dict, lenient: bool) -> list[str]:
    """`invoke{i}`: one call of the tool, its declared parameters in schema order (required ones always)."""
    props = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    rules, items = [], []
    for j, (key, sub) in enumerate(props.items()):
        if not isinstance(sub, dict) or any(c in key for c in '"\\\n'):
            raise ValueError(f"tool {name!r}: parameter {key!r} cannot be enforced")
        value = f"v{i}_{j}"  # the value and the closing tag
        if _is_plain_string(sub):
            rules.append(_raw_value(value, sub))
            head = param_open(key, True)
        else:
            rules += [f"{value}: {value}_json {_lit(PARAM_CLOSE)}",
                      f"{value}_json: {_json({**sub, **defs}, lenient)}"]
            head = param_open(key, False)
        rules.append(f"p{i}_{j}: {_lit(head)} {value} {_lit(chr(10))}")
        items.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
    rules.insert(0, f"invoke{i}: {_lit(invoke_open(name) + chr(10))} {' '.join(items)} {_lit(INVOKE_CLOSE)}")
    return rules


def tool_call_grammar(tools: list[dict], only: str | None = None, parallel: bool = True,
                      thinking: bool = False, optional: bool = False, content_schema: dict | None = None) -> str:
    """A calls block (and nothing else) calling the offered tools (`only`: just that one); `parallel` False: one
    call. Arguments follow each tool's `parameters` schema. `optional` (tool_choice "auto"): free content, which
    may end in one block: whatever the model writes, a block it starts is well-formed; schema keywords llguidance
    does not implement are then left unenforced (a tool that cannot be enforced must not stop a request that may
    not call it; a forced call refuses them). `content_schema` (with `optional`, a response_format): the content
    is instead that JSON, or the block alone."""
    rules, invokes = [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        rules += _invoke_rules(i, fn["name"], fn.get("parameters") or {}, lenient=optional)
        invokes.append(f"invoke{i}")
    if not invokes:
        raise ValueError(f"no tool named {only!r} is offered")
    # each call ends with its own "\n": a "\n" between calls beside a "\n</...calls>" would be two lexemes that
    # share "\n<", and llguidance's greedy lexer, once past "\n<", would only ever close the block
    calls = f"(call {_lit(chr(10))}){'+' if parallel else ''} {_lit(CALLS_CLOSE)}"
    block = f"{_lit(TOOL_CALLS_START + chr(10))} {calls}"
    if optional and content_schema is not None:  # the JSON answer, or the calls (JSON cannot start with "\n")
        answer = [f"answer: json_answer | {block}", f"json_answer: {_json(content_schema)}"]
    elif optional:  # all text, or text up to the block's start and then the block
        # `content` ends at the block's start itself: ended at the start plus "\n", it could go on past a start
        # followed by anything else, and a block could then never begin well-formed
        answer = [f"answer: TEXT | content {_lit(chr(10))} {calls}", f"TEXT: {_without(TOOL_CALLS_START)}",
                  _until("content", TOOL_CALLS_START)]
    else:
        answer = [f"answer: {block}"]
    body = [*answer, f"call: {' | '.join(invokes)}", *rules]
    return _with_reasoning(body, thinking)


def regex_grammar(pattern: str, thinking: bool = False) -> str:
    """The output matches `pattern` (Rust regex syntax, as llguidance reads it; vLLM's guided_regex). A `/`
    not already escaped is escaped: Lark's regex literals end at one."""
    escaped = re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", pattern).replace("\n", "\\n")
    return _with_reasoning([f"answer: /{escaped}/"], thinking)


def choice_grammar(choices: list[str], thinking: bool = False) -> str:
    """The output is one of `choices`, exactly (vLLM's guided_choice)."""
    return _with_reasoning([f"answer: {' | '.join(_lit(c) for c in choices)}"], thinking)
