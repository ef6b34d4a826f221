"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and `POST /v1/messages/count_tokens`, so that
tools built on the Anthropic SDK can use the served model (as DeepSeek's own API offers).

A request is translated into a ChatCompletionRequest (system, messages with text / image / tool_use / tool_result /
thinking blocks, tools with input_schema, tool_choice auto / any / tool / none, thinking's budget -> V4.1's
reasoning effort, stop_sequences) and run by the chat path (OpenAIServer.start_chat): the same prompt, sampling
and constrained decoding of tool calls as chat completions. Its output is read as blocks (mini.server.blocks) and
shaped as content blocks: thinking, text, tool_use; a stream sends Anthropic's events. Errors are Anthropic's
shape (mini.server.errors); the API key may come as `x-api-key` (mini.server.guard).
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError, field_validator

from mini.server.bodies import ApiError, parse_body, validation_error
from mini.server.blocks import Block, BlockEvent, BlockStream, final_blocks
from mini.server.images import MEDIA_TYPES, ImageParts
from mini.server.protocol import ChatCompletionRequest, _Strict

# thinking.budget_tokens -> V4.1's reasoning effort (mini.chat_format.EFFORT_PRESETS): the effort is V4.1's knob for
# how long it reasons, the budget Anthropic's; below 4,096 tokens "low", below 16,384 "high", else "max"
EFFORT_OF_BUDGET = ((4096, "low"), (16384, "high"))
SIGNATURE = "mini"  # thinking blocks carry a signature in Anthropic's API; mini checks none, so any comes back


def effort_of_budget(budget: int) -> str:
    return next((effort for limit, effort in EFFORT_OF_BUDGET if budget < limit), "max")


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024)  # Anthropic's minimum; "adaptive": V4.1's default effort
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks come empty (signed)


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # thinking: V4.1's effort (EFFORTS)
    format: OutputFormat | None = None  # structured output: the JSON schema enforced by constrained decoding


# output_config.effort -> V4.1's reasoning effort (mini.chat_format.EFFORT_PRESETS: low, high = default, max)
EFFORTS = {"low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(_Strict):
    user_id: str | None = None  # the caller's record of its user: nothing to act on


class MessagesRequest(_Strict):
    model: str
    messages: list[dict] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=2)  # older clients' sampling fields (today's SDK: extra_body)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # hints and the caller's records: accepted, nothing here acts on them
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    cache_control: dict | None = None  # prefix caching is automatic
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict | None = None


class BlockError(ValueError):
    pass


def _text(content, where: str, images: ImageParts | None = None) -> str:
    """Text of a string or of text blocks (cache_control and citations are hints: dropped); with `images` (a
    tool_result's content) also image blocks, each standing in the text as the images' marker."""
    if isinstance(content, str):
        return content
    texts = []
    for k, block in enumerate(content or []):
        if images is not None and isinstance(block, dict) and block.get("type") == "image":
            texts.append(_image(block, f"{where}[{k}]", images))
            continue
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise BlockError(f"{where}[{k}]: content block type {kind!r} is not supported here (supported: text)")
        texts.append(block["text"])
    return "\n\n".join(texts)


def _image(block: dict, at: str, images: ImageParts) -> str:
    """An image block `{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url",
    "url"}}` taken into `images` (its media_type is checked against the decoded format); the text holding its
    place."""
    extra = set(block) - {"type", "source", "cache_control"}  # cache_control: a hint (prefix caching is automatic)
    if extra:
        raise BlockError(f"{at}: unsupported fields {sorted(extra)} (an image block has source and cache_control)")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and set(source) <= {"type", "media_type", "data"}:
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in MEDIA_TYPES:
            raise BlockError(f"{at}.source.media_type: {media_type!r} is not one of {', '.join(MEDIA_TYPES)}")
        if not isinstance(data, str):
            raise BlockError(f"{at}.source.data must be the image's bytes in base64")
        return images.add(at, f"data:{media_type};base64,{data}", media_type)
    if kind == "url" and set(source) == {"type", "url"} and isinstance(source["url"], str):
        return images.add(at, source["url"])  # http(s), fetched only under --allow-image-urls (mini.server.images)
    why = ": this server has no Files API" if kind == "file" else ""
    raise BlockError(f"{at}.source: an image source is {{'type': 'base64', 'media_type', 'data'}} or "
                     f"{{'type': 'url', 'url'}} (got {kind!r}{why})")


def to_messages(system, messages: list[dict], images: ImageParts | None = None) -> list[dict]:
    """Chat messages of Anthropic's: the system prompt, user turns (tool_result blocks become tool messages, before
    the user's text and images), assistant turns (thinking -> reasoning_content, text -> content, tool_use ->
    tool_calls). The image blocks of a user turn and of its tool results go into `images`, each standing in its
    text as the images' marker (mini.server.images), in the place of the block."""
    images = images if images is not None else ImageParts()
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, msg in enumerate(messages):
        role, content, where = msg.get("role"), msg.get("content"), f"messages[{i}]"
        if role not in ("user", "assistant") or set(msg) - {"role", "content"}:
            raise BlockError(f"{where}: a message is {{'role': 'user' | 'assistant', 'content': ...}}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise BlockError(f"{where}.content must be a string or a list of content blocks")
        texts, reasoning, calls = [], [], []
        for k, block in enumerate(blocks):
            kind, at = block.get("type") if isinstance(block, dict) else None, f"{where}.content[{k}]"
            if kind == "text":
                texts.append(block.get("text", ""))
            elif kind == "image" and role == "user":
                texts.append(_image(block, at, images))
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(result, f"{at}.content", images)})
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
            elif kind == "thinking" and role == "assistant":
                reasoning.append(block.get("thinking", ""))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # another provider's encrypted reasoning: nothing mini can read
            else:
                raise BlockError(f"{at}: content block type {kind!r} is not supported in a {role} message")
        text = "\n\n".join(texts)
        if role == "user":
            if text or not any(m["role"] == "tool" for m in out[-1:]):
                out.append({"role": "user", "content": text})
        else:
            turn = {"role": "assistant", "content": text or None}
            if reasoning:
                turn["reasoning_content"] = "".join(reasoning)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            raise BlockError(f"tools[{i}]: only custom tools with an input_schema are supported "
                             f"(got type {tool.get('type', 'custom')!r})")
        extra = set(tool) - {"type", "name", "description", "input_schema", "cache_control", "strict"}
        if extra:  # cache_control: a hint (prefix caching is automatic); strict: schemas are always enforced
            raise BlockError(f"tools[{i}] has unsupported fields {sorted(extra)}")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_body(req: MessagesRequest | CountTokensRequest, images: ImageParts | None = None) -> dict:
    """The ChatCompletionRequest fields of an Anthropic request, its image blocks into `images` (BlockError names
    what cannot be translated)."""
    choice, config = req.tool_choice, req.output_config or OutputConfig()
    thinking = req.thinking is not None and req.thinking.type != "disabled"
    budget = req.thinking.budget_tokens if thinking else None
    effort = EFFORTS[config.effort] if config.effort else effort_of_budget(budget) if budget else None
    body = {"model": req.model, "messages": to_messages(req.system, req.messages, images),
            "tools": _chat_tools(req.tools),
            "tool_choice": None if choice is None else {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}}),
            "parallel_tool_calls": not (choice and choice.disable_parallel_tool_use),
            "thinking": thinking, "reasoning_effort": effort if thinking else None,
            "response_format": None if config.format is None else {"type": "json_schema", "json_schema": {
                "name": "output", "schema": config.format.schema_}}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k)
    return body


def chat_request(req) -> tuple[ChatCompletionRequest, ImageParts]:
    """The chat request that runs an Anthropic request, and its images."""
    images = ImageParts()
    try:
        body = chat_body(req, images)
    except BlockError as e:
        raise ApiError(str(e)) from None
    try:
        return ChatCompletionRequest.model_validate(body), images
    except ValidationError as e:
        raise validation_error(e, body) from None


def stop_reason(finish: str | None, out) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice (finish: ChatChoice.finish_reason)."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _input(arguments: str) -> dict:
    """A tool_use block's input: the call's arguments (a call cut short by max_tokens: what parses, else {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_block(block: Block, done: bool = True, hide_thinking: bool = False) -> dict:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if done and not hide_thinking else "",
                "signature": SIGNATURE if done else ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if done else ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": _input(block.text) if done else {}}


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def block_events(e: BlockEvent, hide_thinking: bool = False) -> str:
    """`hide_thinking` (thinking.display "omitted"): thinking blocks open and close (signed) without their text."""
    b = e.block
    if e.what == "open":
        return _sse("content_block_start", {"index": b.index, "content_block": content_block(b, done=False)})
    if e.what == "delta":
        if b.kind == "reasoning" and hide_thinking:
            return ""
        delta = {"reasoning": {"type": "thinking_delta", "thinking": e.delta},
                 "text": {"type": "text_delta", "text": e.delta},
                 "call": {"type": "input_json_delta", "partial_json": e.delta}}[b.kind]
        return _sse("content_block_delta", {"index": b.index, "delta": delta})
    signature = _sse("content_block_delta", {"index": b.index, "delta": {
        "type": "signature_delta", "signature": SIGNATURE}}) if b.kind == "reasoning" else ""
    return signature + _sse("content_block_stop", {"index": b.index})


def _usage(out, n_out: int | None = None) -> dict:
    cached = out.num_cached_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached, "output_tokens":
            len(out.token_ids) if n_out is None else n_out, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


class MessagesAPI:
    """The handlers, over the chat path of `server` (an OpenAIServer)."""

    def __init__(self, server):
        self.server = server

    async def create(self, request: Request):
        req = await parse_body(request, MessagesRequest)
        chat, images = chat_request(req)
        run = await self.server.start_chat(chat, f"msg_{uuid.uuid4().hex}", images)
        choice, hide = run.choices[0], bool(req.thinking and req.thinking.display == "omitted")
        message = {"id": run.id, "type": "message", "role": "assistant", "model": self.server.model_name}
        if not req.stream:
            out = (await self.server._final(run.stream, request))[0]
            content = [content_block(b, hide_thinking=hide) for b in final_blocks(choice.deltas(out))]
            reason, sequence = stop_reason(choice.finish_reason(out), out)  # after the deltas: they find the calls
            return JSONResponse({**message, "content": content, "stop_reason": reason, "stop_sequence": sequence,
                                 "usage": _usage(out)})

        async def events():
            blocks, out, started = BlockStream(), None, False
            try:
                async for _, out in run.stream:
                    if not started:  # the first output: the prompt's usage is known now
                        started = True
                        yield _sse("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                                                 "stop_sequence": None, "usage": _usage(out, 0)}})
                    for e in blocks.feed(choice.deltas(out)):
                        yield block_events(e, hide)
            except RuntimeError as e:
                yield _sse("error", {"error": {"type": "api_error", "message": str(e)}})
                return
            for e in blocks.close():
                yield block_events(e, hide)
            reason, sequence = stop_reason(choice.finish_reason(out), out)
            yield _sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": {"output_tokens": len(out.token_ids)}})
            yield _sse("message_stop", {})
        return StreamingResponse(events(), media_type="text/event-stream")

    async def count_tokens(self, request: Request):
        req = await parse_body(request, CountTokensRequest)
        self.server._check_model(req.model)
        chat, images = chat_request(req)
        images.check_count(self.server.images)
        try:
            prompt = chat.prompt()
        except ValueError as e:
            raise ApiError(str(e), param="messages") from None
        if images.parts:  # each image counts its span, as in the request that runs it
            ids, _ = await self.server.with_images(prompt, images)
            return JSONResponse({"input_tokens": len(ids)})
        n = len(await asyncio.to_thread(self.server.tokenizer.encode, prompt))
        return JSONResponse({"input_tokens": n})
