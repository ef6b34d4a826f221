"""The V4.1 chat format (spec §5): OpenAI-style messages rendered into the prompt text, tools and tool calls as
DSML markup. `mini.server.tool_calls` parses the model's DSML back with the markup defined here.
"""
from __future__ import annotations

import json

from mini.tokenizer import BOS, EOS

# chat markers of the V4.1 vocabulary
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK = "<think>"
END_THINK = "</think>"

EFFORT_PRESETS = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"


def _effort_line(effort) -> str:
    effort = DEFAULT_EFFORT if effort is None else effort
    if isinstance(effort, str):
        if effort not in EFFORT_PRESETS:
            raise ValueError(f"reasoning_effort must be 1..100 or one of {list(EFFORT_PRESETS)}, got {effort!r}")
        effort = EFFORT_PRESETS[effort]
    if not (isinstance(effort, int) and 1 <= effort <= 100):
        raise ValueError(f"reasoning_effort must be 1..100 or one of {list(EFFORT_PRESETS)}, got {effort!r}")
    return (f"Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the reasoning)"
            "\n\n")


# DSML, V4.1's tool-call markup (spec §5): a block of invokes after the content, each with its parameters.
DSML = "｜DSML｜"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_CLOSE = f"</{DSML} parameter>"
TOOL_CALLS_START = "\n\n" + CALLS_OPEN  # where an assistant turn's calls begin (after its content)


def invoke_open(name: str) -> str:
    return f'<{DSML} invoke name="{name}">'


def param_open(name: str, is_string: bool) -> str:
    return f'<{DSML} parameter name="{name}" string="{"true" if is_string else "false"}">'


_TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
{invoke_open("$TOOL_NAME")}
<{DSML} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
{invoke_open("$TOOL_NAME2")}
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside \
{THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(value) -> str:
    """JSON as the V4.1 encoder writes it: default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def tool_name(name) -> str:
    """A tool's name as the prompt writes it: `name` or `namespace::name` (at most one `::`)."""
    if not isinstance(name, str) or not name or name.count("::") > 1 or name.startswith("::") \
            or name.endswith("::"):
        raise ValueError(f"invalid tool name {name!r}")
    return name


def render_tools(tools: list[dict]) -> str:
    """The `## Tools` section: each OpenAI tool's `function` object as JSON, one per line, keys in the order
    given."""
    functions = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict):
            raise ValueError("each tool must be {'type': 'function', 'function': {...}}")
        tool_name(fn.get("name"))
        functions.append(_json(fn))
    return _TOOLS_TEMPLATE.replace("{schemas}", "\n".join(functions))


def call_arguments(arguments) -> dict:
    """A call's arguments as a dict: an object, or a JSON string of one (decoded at most twice: clients send
    double-encoded strings); anything else is wrapped as {"arguments": value}."""
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def render_tool_calls(calls: list[dict]) -> str:
    """An assistant turn's calls (OpenAI `tool_calls`) as DSML, starting with the blank line after the content.
    String values are written as is (string="true"), all others as JSON (string="false")."""
    invokes = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ValueError("each tool call must be {'id': ..., 'type': 'function', 'function': {...}}")
        params = [param_open(k, isinstance(v, str)) + (v if isinstance(v, str) else _json(v)) + PARAM_CLOSE
                  for k, v in call_arguments(fn.get("arguments", "")).items()]
        invokes.append(invoke_open(tool_name(fn.get("name"))) + "\n" + "\n".join(params) + "\n" + INVOKE_CLOSE)
    return TOOL_CALLS_START + "\n" + "\n".join(invokes) + "\n" + CALLS_CLOSE


def _text(content) -> str:
    """Message content: a string, None, or text parts (joined by a blank line, as the V4.1 encoder does)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only text content parts are supported")
        parts.append(part["text"])
    return "\n\n".join(parts)


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """V4.1 has no tool role: a tool result joins the user turn as `<tool_result>...</tool_result>`, and
    consecutive user turns (text or results) merge, their parts joined by a blank line. Within a turn, results
    are put in the order of the calls (by id) of the latest assistant turn that made calls."""
    merged: list[dict] = []
    call_order: dict[str, int] = {}
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            call_order = {c["id"]: i for i, c in enumerate(msg["tool_calls"]) if isinstance(c, dict) and c.get("id")}
        if role not in ("user", "tool"):
            merged.append(dict(msg))
            continue
        part = (("result", msg.get("tool_call_id") or "", f"<tool_result>{_text(msg.get('content'))}</tool_result>")
                if role == "tool" else ("text", "", _text(msg.get("content"))))
        if merged and merged[-1].get("role") == "user" and "_parts" in merged[-1]:
            merged[-1]["_parts"].append(part)
        else:
            merged.append({"role": "user", "_parts": [part], "_order": call_order})
    for m in merged:
        parts = m.get("_parts")
        if parts is None:
            continue
        results = [p for p in parts if p[0] == "result"]
        if len(results) > 1 and m["_order"]:
            results.sort(key=lambda p: m["_order"].get(p[1], 0))  # stable: unknown ids keep their place first
            it = iter(results)
            parts[:] = [next(it) if p[0] == "result" else p for p in parts]
    return merged


def _is_turn_start(msg: dict, index: int) -> bool:
    """User turns and mid-conversation system messages are answered by the assistant."""
    return msg["role"] == "user" or (msg["role"] == "system" and index > 0)


def render_chat(messages: list[dict], thinking: bool = False, reasoning_effort=None, tools: list[dict] | None = None,
                drop_thinking: bool = True) -> str:
    """The V4.1 prompt text for OpenAI-style messages (system / developer / user / assistant / tool), ending with
    the assistant header: `<｜Assistant｜><think>` (thinking) or `<｜Assistant｜></think>` (chat).

    BOS, then in thinking mode `<｜System｜>Reasoning Effort: N (...)\\n\\n`, then the turns. `developer` is a
    system message. `tools` (OpenAI tool objects) are described after the first system message's text (an empty
    one is put first if there is none). Assistant turns are `[reasoning</think>]content[DSML calls]` then
    `<｜end▁of▁sentence｜>`. Earlier reasoning (before the last user turn) is dropped, unless tools are given or
    `drop_thinking` is False: then every assistant turn keeps its reasoning and every header opens `<think>`."""
    msgs = []
    for m in messages:
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"unsupported chat role {m.get('role')!r}")
        if m.get("tools"):
            raise ValueError("tools are given to render_chat's `tools`, not inside a message")
        msgs.append({**m, "role": role})
    if tools:
        first_system = next((m for m in msgs if m["role"] == "system"), None)
        if first_system is None:
            first_system = {"role": "system", "content": ""}
            msgs.insert(0, first_system)
        first_system["_tools"] = tools
    keep_all = bool(tools) or not drop_thinking  # the encoder keeps every turn's reasoning when tools exist
    msgs = _merge_tool_results(msgs)
    last_user = max((i for i, m in enumerate(msgs) if _is_turn_start(m, i)), default=-1)
    out = [BOS]
    if thinking:
        out += [SYSTEM, _effort_line(reasoning_effort)]
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            if i > 0 or not thinking:
                out.append(SYSTEM)
            out.append(_text(m.get("content")))
            if m.get("_tools"):
                out += ["\n\n", render_tools(m["_tools"])]
        elif role == "user":
            out += [USER, "\n\n".join(p[2] for p in m["_parts"])]
        else:  # assistant
            if thinking and (keep_all or i > last_user):
                out += [m.get("reasoning_content") or "", END_THINK]
            out.append(_text(m.get("content")))
            if m.get("tool_calls"):
                out.append(render_tool_calls(m["tool_calls"]))
            out.append(EOS)
        following = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if _is_turn_start(m, i) and following in (None, "assistant"):
            out += [ASSISTANT, THINK if thinking and (keep_all or i >= last_user) else END_THINK]
    return "".join(out)
