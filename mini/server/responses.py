"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed), `GET` / `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items`, with stored responses and conversations (`previous_response_id`) in
SQLite (mini.server.store).

A request is translated into a ChatCompletionRequest (input items -> chat messages, their input_image parts ->
mini.server.images' ImageParts, function tools, text.format ->
response_format, reasoning.effort -> V4.1's thinking mode) and run by the chat path (OpenAIServer.start_chat), so
prompts, sampling and constrained decoding of tool calls and JSON schemas are the chat endpoint's. Its output is
read as blocks (mini.server.blocks) and shaped as output items: reasoning, message, function_call; a stream sends
the Responses event sequence for them.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError, field_validator

from mini.server.bodies import ApiError, parse_body, validation_error
from mini.server.blocks import Block, BlockEvent, BlockStream, final_blocks
from mini.server.images import ImageParts, check_detail
from mini.server.protocol import SERVICE_TIERS, ChatCompletionRequest, _Strict, check_effort, check_metadata
from mini.server.store import ChainError, ResponseStore

INCLUDABLE = ("reasoning.encrypted_content",)
ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class TextConfig(_Strict):
    format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: V4.1 has no length control


class ReasoningConfig(_Strict):
    effort: str | int | None = None  # as chat's reasoning_effort; given and not "none": thinking mode
    summary: Literal["auto", "concise", "detailed"] | None = None  # a hint: reasoning comes whole, not summarized
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @field_validator("effort")
    @classmethod
    def _known_effort(cls, v):
        return check_effort(v)


class StreamOptions(_Strict):
    include_obfuscation: bool = False  # a hint (no padding)


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # vLLM's extension: seeded sampling as in chat
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    include: list[Literal[INCLUDABLE]] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop context: a prompt too long is refused
    background: Literal[False] | None = None
    # hints and the caller's records
    metadata: dict[str, str] | None = None  # echoed and stored
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: Literal[SERVICE_TIERS] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v):
        return check_metadata(v)


class ItemError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def normalize_input(value: str | list[dict]) -> list[dict]:
    """The input as items, each with an id (stored; input_items lists them)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    items = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind not in ITEM_PREFIX:
            raise ItemError(f"input item type {kind!r} is not supported (supported: {', '.join(ITEM_PREFIX)})",
                            f"input[{i}].type")
        items.append({"type": kind, **item, "id": item.get("id") or _new_id(ITEM_PREFIX[kind])})
    return items


def _text_of(content, param: str, images: ImageParts | None = None) -> str:
    """A message's content: a string, or text parts (joined by a blank line); with `images` (a user message) also
    input_image parts, each standing in the text as the images' marker (mini.server.images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ItemError("content must be a string or a list of text parts", param)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            texts.append(_image_of(part, f"{param}[{k}]", images))
            continue
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ItemError(f"content part type {kind!r} is not supported (supported: input_text, output_text, "
                            "input_image)", f"{param}[{k}].type")
        texts.append(part["text"])
    return "\n\n".join(texts)


def _image_of(part: dict, param: str, images: ImageParts | None) -> str:
    """An input_image part `{"type": "input_image", "image_url": "data:...", "detail": ...}` taken into `images`."""
    if images is None:
        raise ItemError(f"{param}: only user messages and function_call_output items carry images", param)
    extra = set(part) - {"type", "image_url", "detail", "file_id"}
    if extra:
        raise ItemError(f"{param}: unsupported fields {sorted(extra)} (an input_image part has image_url and "
                        "detail)", param)
    if part.get("file_id") is not None:
        raise ItemError(f"{param}: file_id is not supported (this server has no Files API); send the image as "
                        "image_url, a data:image/...;base64 URL", f"{param}.file_id")
    check_detail(part.get("detail"), param)
    if not isinstance(part.get("image_url"), str):
        raise ItemError(f"{param}: input_image needs an image_url (a data: URL or, if allowed, http(s))", param)
    return images.add(param, part["image_url"])


def _reasoning_of(item: dict) -> str:
    """A reasoning item's text: its reasoning_text content, else encrypted_content (which mini fills with the
    reasoning itself), else its summary."""
    content = [p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict)]
    if content:
        return "".join(content)
    if isinstance(item.get("encrypted_content"), str):
        return item["encrypted_content"]
    return "\n\n".join(p.get("text", "") for p in item.get("summary") or [] if isinstance(p, dict))


def to_messages(items: list[dict], instructions: str | None, images: ImageParts | None = None) -> list[dict]:
    """Chat messages of a conversation's items: instructions as the system message, messages by role,
    function_call items as the assistant's tool_calls (joined to the assistant message just before), outputs as
    tool messages, reasoning as the next assistant turn's reasoning_content. The input_image parts of user
    messages and function_call_output items go into `images` (None: refused)."""
    msgs: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning = None

    def assistant(content) -> dict:
        nonlocal reasoning
        msg = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"], reasoning = reasoning, None
        msgs.append(msg)
        return msg

    for i, item in enumerate(items):
        kind, param = item.get("type", "message"), f"input[{i}]"
        try:
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise ItemError(f"message role {role!r} is not one of user, assistant, system, developer",
                                    f"{param}.role")
                text = _text_of(item.get("content"), f"{param}.content", images if role == "user" else None)
                assistant(text) if role == "assistant" else msgs.append({"role": role, "content": text})
            elif kind == "function_call":
                last = msgs[-1] if msgs and msgs[-1]["role"] == "assistant" and reasoning is None else None
                last = last or assistant(None)
                last.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
            elif kind == "function_call_output":
                output = item["output"]
                msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text_of(output, f"{param}.output",
                                                                                         images)})
            elif kind == "reasoning":
                reasoning = _reasoning_of(item)
        except KeyError as e:
            raise ItemError(f"a {kind} item needs {e.args[0]!r}", f"{param}.{e.args[0]}") from None
    return msgs


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ItemError(f"tool type {tool.get('type')!r} is not supported (supported: function)",
                            f"tools[{i}].type")
        extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise ItemError(f"tools[{i}] has unsupported fields {sorted(extra)}", f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}})
    return out


def _chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ItemError(f"tool_choice {choice!r} is not supported (supported: none, auto, required, "
                    "{'type': 'function', 'name': ...})", "tool_choice")


def _response_format(fmt: dict | None) -> dict | None:
    """text.format (flat) as chat's response_format (the schema under json_schema)."""
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


# chat's field names where the Responses API names the same thing otherwise (for errors)
CHAT_PARAMS = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
               ("messages", "input"), ("max_tokens", "max_output_tokens"), ("reasoning_effort", "reasoning.effort"))


def chat_request(req: ResponsesRequest, items: list[dict]) -> tuple[ChatCompletionRequest, ImageParts]:
    """The chat request that runs a Responses request over the conversation `items`, and its images. Raises
    ItemError or ApiError (a chat field's error, named as the Responses API names it)."""
    effort = req.reasoning.effort if req.reasoning else None
    images = ImageParts()
    body = {"model": req.model, "messages": to_messages(items, req.instructions, images),
            "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
            "seed": req.seed, "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text.format if req.text else None),
            "thinking": effort not in (None, "none"), "reasoning_effort": effort}
    if not body["messages"]:
        raise ItemError("the input has no messages", "input")
    try:
        return ChatCompletionRequest.model_validate(body), images
    except ValidationError as e:
        error = validation_error(e, body)
        for chat_name, name in CHAT_PARAMS:
            if (error.param or "").startswith(chat_name):
                error.message = error.message.replace(f"'{chat_name}", f"'{name}")
                error.param = name + error.param[len(chat_name):]
                break
        raise error from None


class ResponsesAPI:
    """The handlers, over the chat path of `server` (an OpenAIServer) and a ResponseStore."""

    def __init__(self, server, store: ResponseStore):
        self.server, self.store = server, store

    async def create(self, request: Request):
        req = await parse_body(request, ResponsesRequest)
        try:
            items = normalize_input(req.input)
            history = [] if req.previous_response_id is None else \
                await asyncio.to_thread(self.store.conversation, req.previous_response_id)
            chat, images = chat_request(req, history + items)
        except ItemError as e:
            raise ApiError(str(e), param=e.param) from None
        except ChainError as e:
            raise ApiError(str(e), param="previous_response_id", status=404, code="not_found") from None
        rid = _new_id("resp")
        run = await self.server.start_chat(chat, rid, images)
        shape = ResponseShape(req, rid, run.created, self.server.model_name, self.server.tokenizer)
        if not req.stream:
            out = (await self.server._final(run.stream, request))[0]
            choice = run.choices[0]
            response = shape.response(final_blocks(choice.deltas(out)), out, choice.finish_reason(out))
            await self._keep(req, response, items)
            return JSONResponse(response)

        async def events():
            blocks, choice, out = BlockStream(), run.choices[0], None
            yield shape.event("response.created", response=shape.response([], None, None))
            yield shape.event("response.in_progress", response=shape.response([], None, None))
            try:
                async for _, out in run.stream:
                    for e in blocks.feed(choice.deltas(out)):
                        yield shape.block_event(e)
            except RuntimeError as e:
                yield shape.event("error", code="server_error", message=str(e), param=None)
                return
            for e in blocks.close():
                yield shape.block_event(e)
            response = shape.response(blocks.blocks, out, choice.finish_reason(out))
            await self._keep(req, response, items)
            yield shape.event(f"response.{response['status']}", response=response)
        return StreamingResponse(events(), media_type="text/event-stream")

    async def _keep(self, req: ResponsesRequest, response: dict, items: list[dict]) -> None:
        if req.store:
            await asyncio.to_thread(self.store.put, response, items)

    async def _stored(self, response_id: str) -> dict:
        response = await asyncio.to_thread(self.store.get, response_id)
        if response is None:
            raise ApiError(f"no stored response {response_id!r}", param="response_id", status=404, code="not_found")
        return response

    async def retrieve(self, response_id: str):
        return JSONResponse(await self._stored(response_id))

    async def delete(self, response_id: str):
        await self._stored(response_id)
        await asyncio.to_thread(self.store.delete, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, response_id: str, request: Request):
        """This response's own input items (not those of the responses it continued), newest first by default
        (query: limit 1-100, order asc / desc, after an item id)."""
        await self._stored(response_id)
        query = request.query_params
        limit, order, after = query.get("limit", "20"), query.get("order", "desc"), query.get("after")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise ApiError(f"limit must be an integer in [1, 100], got {limit!r}", param="limit")
        if order not in ("asc", "desc"):
            raise ApiError(f"order must be asc or desc, got {order!r}", param="order")
        limit = int(limit)
        items = await asyncio.to_thread(self.store.input_items, response_id)
        items = items[::-1] if order == "desc" else items
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise ApiError(f"no input item {after!r} in response {response_id!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


class ResponseShape:
    """One response's JSON and stream events: its fields as asked, output items of blocks (with ids)."""

    def __init__(self, req: ResponsesRequest, rid: str, created: int, model: str, tokenizer):
        self.req, self.id, self.created, self.model, self.tokenizer = req, rid, created, model, tokenizer
        self.ids: dict[int, str] = {}  # block index -> its item id
        self.sequence = 0

    def item_id(self, block: Block) -> str:
        if block.index not in self.ids:
            self.ids[block.index] = _new_id({"reasoning": "rs", "text": "msg", "call": "fc"}[block.kind])
        return self.ids[block.index]

    def item(self, block: Block, done: bool = True) -> dict:
        status = "completed" if done else "in_progress"
        if block.kind == "reasoning":
            item = {"type": "reasoning", "id": self.item_id(block), "summary": [],
                    "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
            if self.req.include and "reasoning.encrypted_content" in self.req.include:
                item["encrypted_content"] = block.text if done else None
            return item
        if block.kind == "text":
            return {"type": "message", "id": self.item_id(block), "status": status, "role": "assistant",
                    "content": [self._text_part(block.text)] if done else []}
        return {"type": "function_call", "id": self.item_id(block), "call_id": block.call_id, "name": block.name,
                "arguments": block.text if done else "", "status": status}

    @staticmethod
    def _text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, blocks: list[Block], out, finish_reason: str | None) -> dict:
        req = self.req
        status = "in_progress" if out is None else "incomplete" if finish_reason == "length" else "completed"
        fmt = (req.text.format if req.text else None) or {"type": "text"}
        body = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": [self.item(b) for b in blocks], "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "service_tier": "default", "store": req.store, "temperature": req.temperature,
            "text": {"format": fmt, "verbosity": req.text.verbosity if req.text and req.text.verbosity else "medium"},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
            "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {}}
        if out is not None:
            reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
            n_reasoning = len(self.tokenizer.encode(reasoning)) if reasoning and self.tokenizer is not None else 0
            n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
            body["usage"] = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                             "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": n_reasoning},
                             "total_tokens": n_in + n_out}
        return body

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def block_event(self, e: BlockEvent) -> str:
        """The Responses events of one block event (an open or close may be several)."""
        b, index = e.block, e.block.index
        where = {"item_id": self.item_id(b), "output_index": index}
        if e.what == "open":
            events = [self.event("response.output_item.added", output_index=index, item=self.item(b, done=False))]
            if b.kind == "text":
                events.append(self.event("response.content_part.added", **where, content_index=0,
                                         part=self._text_part("")))
            return "".join(events)
        if e.what == "delta":
            if b.kind == "text":
                return self.event("response.output_text.delta", **where, content_index=0, delta=e.delta,
                                  logprobs=[])
            if b.kind == "reasoning":
                return self.event("response.reasoning_text.delta", **where, content_index=0, delta=e.delta)
            return self.event("response.function_call_arguments.delta", **where, delta=e.delta)
        if b.kind == "text":
            events = [self.event("response.output_text.done", **where, content_index=0, text=b.text, logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=self._text_part(b.text))]
        elif b.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=b.text)]
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=b.name,
                                 arguments=b.text)]
        events.append(self.event("response.output_item.done", output_index=index, item=self.item(b)))
        return "".join(events)
