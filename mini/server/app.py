"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Request bodies are parsed by hand (UTF-8, then JSON, then the schema) so every bad input gets a 400 with an
OpenAI-style error body that names the problem. A client that disconnects aborts its request: streaming
responses are cancelled by Starlette, non-streaming ones are watched.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mini.engine import RequestOutput, SamplingParams
from mini.engine.async_engine import AsyncLLM
from mini.server.bodies import ApiError, json_depth, parse_body, validation_error  # noqa: F401 (re-exported)
from mini.server.chat_output import ChatChoice, split_reasoning  # noqa: F401 (split_reasoning: re-exported)
from mini.server.guard import LOOPBACK_HOSTS, Guard, Policy, h11_with_header_timeout
from mini.server import images
from mini.server.images import ImageLimits
from mini.server.metrics import ServerMetrics
from mini.server.protocol import ChatCompletionRequest, CompletionRequest
from mini.server.store import DEFAULT_MAX_RESPONSES, ResponseStore

log = logging.getLogger("mini.server")


PROMPT_CHARS_PER_TOKEN = 8  # a text prompt longer than this many characters per token of context cannot fit


def _usage(*outs: RequestOutput) -> dict:
    """Usage of a request's choices: the prompt once, every choice's output."""
    n_prompt, n_out = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


async def _only(stream) -> AsyncIterator[tuple[int, RequestOutput]]:
    """One choice as (0, output) pairs, without _indexed's task and queue per output."""
    async for out in stream:
        yield 0, out


async def _indexed(streams: list, later=None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Merge choice streams into (index, output) pairs as they come. `later()`: an awaitable giving the streams of
    the choices after the first ones, started once the first stream has produced an output. Closing the merged
    stream closes (and so aborts) every choice's stream."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    def start(streams_, first_index):
        for k, st in enumerate(streams_):
            tasks.append(asyncio.ensure_future(pump(first_index + k, st)))
    start(streams, 0)
    running = len(streams)
    try:
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if later is not None:
                more, later = await later(), None
                start(more, len(streams))
                running += len(more)
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream_frame(stream, on_output, chunk, include_usage: bool):
    """The events of an OpenAI stream around its choices' chunks, the same for completions and chat: each output's
    chunks (`on_output(i, out, last)`: `last` the newest output of every choice so far), an engine error as an
    error event that ends the stream, then the usage chunk where asked and `[DONE]`."""
    last = {}
    try:
        async for i, out in stream:
            last[i] = out
            for event in on_output(i, out, last):
                yield event
    except RuntimeError as e:
        yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        return
    if include_usage and last:
        yield chunk([], _usage(*last.values()))
    yield "data: [DONE]\n\n"


class OpenAIServer:
    def __init__(self, llm: AsyncLLM, metrics: ServerMetrics, model_name: str, images: ImageLimits | None = None):
        self.llm, self.metrics, self.model_name = llm, metrics, model_name
        self.tokenizer = llm.engine.tokenizer
        self.images = images or ImageLimits()

    # ------------------------------------------------------------------ shared plumbing
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", status=404, code="model_not_found")

    async def _start_n(self, prompt, params: SamplingParams, request_id: str, n: int, images: list | None = None
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`n` samples of one prompt as (choice index, output) pairs. Choice 0 ends its prefill with a snapshot at
        the prompt's last block boundary (`share_prompt`); the others are submitted once it has its first token and
        take the prompt's full blocks and that snapshot from the prefix cache: each computes only the prompt's
        last partial block. A seed gives choice i the seed + i. `images`: the prompt's image spans (ids expanded)."""
        if n == 1:
            stream = await self._start(prompt, params, request_id, images)
            return _only(stream)
        first = await self._start(prompt, replace(params, share_prompt=True), f"{request_id}-0", images)

        async def later():
            return [await self._start(prompt, replace(params, seed=None if params.seed is None else params.seed + i),
                                      f"{request_id}-{i}", images) for i in range(1, n)]
        return _indexed([first], later)

    async def _start(self, prompt, params: SamplingParams, request_id: str, images: list | None = None
                     ) -> AsyncIterator[RequestOutput]:
        """Tokenize and check in a worker thread (a long prompt never holds the event loop), then submit. A text
        prompt that cannot fit the context even at PROMPT_CHARS_PER_TOKEN is refused before tokenizing."""
        limit = PROMPT_CHARS_PER_TOKEN * self.llm.engine.max_model_len
        if isinstance(prompt, str) and len(prompt) > limit:
            raise ApiError(f"the prompt has {len(prompt):,} characters; this server's context of "
                           f"{self.llm.engine.max_model_len:,} tokens takes at most {limit:,}", param="prompt",
                           code="context_length_exceeded")
        engine = self.llm.engine

        def checked() -> list[int]:
            ids = self.llm.validate(prompt, params, images)
            if not images and engine.model.reads_images and engine.config.image_token_id in ids:
                # the image placeholder typed as text (the official encoder refuses it): an image with no pixels
                raise ApiError(f"the prompt holds the image placeholder token (id {engine.config.image_token_id}) "
                               "and no image; send images as image parts")
            return ids
        try:
            ids = await asyncio.to_thread(checked)
        except ValueError as e:
            raise ApiError(str(e)) from None
        except (UnicodeError, TypeError) as e:
            raise ApiError(f"the prompt cannot be tokenized: {e}") from None
        return self.llm.generate(ids, params, request_id, images)

    @staticmethod
    async def _final(stream: AsyncIterator[tuple[int, RequestOutput]], request: Request) -> list[RequestOutput]:
        """Run a request's choices to the end (their last outputs, by index), aborting them if the client goes
        away."""
        async def consume():
            last = {}
            async for i, out in stream:
                last[i] = out
            return [last[i] for i in sorted(last)]
        task = asyncio.ensure_future(consume())
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ApiError("client disconnected", status=499)

    def _token_text(self, tid: int, as_id: bool = False) -> str:
        """A token's text in logprobs; `as_id` (return_tokens_as_token_ids): "token_id:N", as vLLM writes it."""
        if as_id:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else str(tid)

    # ------------------------------------------------------------------ /v1/completions
    def _completion_logprobs(self, out: RequestOutput, n_new: int, offset: int, as_ids: bool) -> dict | None:
        lps = out.logprobs[len(out.logprobs) - n_new:] if n_new else []
        if not out.logprobs and not lps:
            return None
        tokens = [self._token_text(lp.token_id, as_ids) for lp in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token_text(t, as_ids): v for t, v in lp.top.items()} for lp in lps],
                "text_offset": offsets}

    async def completions(self, request: Request):
        req = await parse_body(request, CompletionRequest)
        self._check_model(req.model)
        try:
            params = req.sampling_params(16, req.logprobs)
        except ValueError as e:
            raise ApiError(str(e)) from None
        params.grammar = req.grammar()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await self._start_n(req.prompt, params, rid, req.n)
        want_lp, as_ids = req.logprobs is not None, req.return_tokens_as_token_ids
        echo = "" if not req.echo else req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(req.prompt)
        if not req.stream:
            choices = []
            outs = await self._final(stream, request)
            for i, out in enumerate(outs):
                choice = {"index": i, "text": echo + out.text, "finish_reason": out.finish_reason,
                          "logprobs": self._completion_logprobs(out, len(out.token_ids), 0, as_ids)
                          if want_lp else None}
                if isinstance(out.stop_reason, (str, int)):
                    choice["stop_reason"] = out.stop_reason
                choices.append(choice)
            return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                                 "model": self.model_name, "choices": choices, "usage": _usage(*outs)})

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices}
            return _sse({**body, "usage": usage} if usage is not None else body)

        async def events():
            sent = [0] * req.n
            if echo:
                for i in range(req.n):
                    yield chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])

            def on_output(i, out, last):
                if out.new_token_ids or out.finished:  # one chunk per token, even if its text is held back
                    lp = self._completion_logprobs(out, len(out.new_token_ids), sent[i], as_ids) if want_lp else None
                    yield chunk([{"index": i, "text": out.new_text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None}],
                                _usage(*last.values()) if req.continuous_usage else None)
                    sent[i] += len(out.new_text)
            async for event in _stream_frame(stream, on_output, chunk, req.include_usage):
                yield event
        return StreamingResponse(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ /v1/chat/completions
    def _chat_logprobs(self, out: RequestOutput, n_new: int, as_ids: bool = False) -> dict:
        lps = out.logprobs[len(out.logprobs) - n_new:] if n_new else []

        def entry(tid, lp):
            text = self._token_text(tid, as_ids)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in lps]}

    async def start_chat(self, req: ChatCompletionRequest, rid: str, image_parts: images.ImageParts | None = None
                         ) -> ChatRun:
        """A chat request checked, rendered to V4.1's prompt, constrained as its tools / format ask, and submitted:
        the one path from a request to the engine for chat completions, the Responses API and Anthropic's
        Messages (which translate their requests into a ChatCompletionRequest, their image parts into
        `image_parts`: markers in the messages' text, the parts named as their API names them)."""
        self._check_model(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise ApiError("top_logprobs must be in [0, 20]", param="top_logprobs")
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        try:
            params = req.sampling_params(None, n_lp)
        except ValueError as e:
            raise ApiError(str(e), param="max_tokens" if "max_tokens" in str(e) else None) from None
        if image_parts is None:  # chat completions: its image_url parts become markers before rendering
            image_parts = images.take_image_parts(req.messages)
        image_parts.check_count(self.images)
        try:
            prompt = req.prompt()
        except ValueError as e:
            raise ApiError(str(e), param="messages") from None
        spans = None
        if image_parts.parts:
            prompt, spans = await self.with_images(prompt, image_parts)
        try:
            params.grammar = req.grammar()
        except ValueError as e:
            raise ApiError(str(e), param="structured_outputs" if req.structured_outputs else
                           "response_format" if req.response_format else "tools") from None
        stream = await self._start_n(prompt, params, rid, req.n, spans)
        names = req.tool_names if req.parses_tool_calls else None
        return ChatRun(req, rid, int(time.time()), stream,
                       [ChatChoice(i, req.thinking_mode, names) for i in range(req.n)])

    async def with_images(self, prompt: str, image_parts: images.ImageParts) -> tuple[list[int], list]:
        """The rendered chat's ids with every image's span, and the spans (mini.step.ImageSpan): decoded, planned
        and tokenized in a worker thread, before the engine sees the request."""
        engine, parts = self.llm.engine, image_parts.parts
        if not engine.model.reads_images:
            raise ApiError(f"{parts[0].param}: this model has no vision tower: it cannot read images",
                           param=parts[0].param)
        cfg = engine.config

        def work():
            from mini.model.image_input import expand_prompt
            loaded = images.load_images(parts, cfg, self.images)
            ids = images.prompt_ids(prompt, image_parts.marker, len(parts), self.tokenizer, cfg.image_token_id)
            expanded = expand_prompt(ids, loaded, cfg)
            return expanded.ids, expanded.spans()
        return await asyncio.to_thread(work)

    async def chat(self, request: Request):
        req = await parse_body(request, ChatCompletionRequest)
        run = await self.start_chat(req, f"chatcmpl-{uuid.uuid4().hex}")
        rid, created, stream, choices, as_ids = run.id, run.created, run.stream, run.choices, \
            req.return_tokens_as_token_ids
        tier = {"service_tier": "default"} if req.service_tier is not None else {}
        if not req.stream:
            outs = await self._final(stream, request)
            body = [{"index": i, "message": c.message(out), "finish_reason": c.finish_reason(out),
                     "logprobs": self._chat_logprobs(out, len(out.token_ids), as_ids) if req.logprobs else None}
                    for i, (c, out) in enumerate(zip(choices, outs))]
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                                 "model": self.model_name, "choices": body, "usage": _usage(*outs), **tier})

        def chunk(choices_: list[dict], usage: dict | None = None):
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    **tier, "choices": choices_}
            return _sse({**body, "usage": usage} if usage is not None else body)

        def choice(i: int, delta: dict, finish=None, lp=None):
            return [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]

        async def events():
            for i in range(req.n):
                yield chunk(choice(i, {"role": "assistant", "content": ""}))

            def on_output(i, out, last):
                usage = _usage(*last.values()) if req.continuous_usage else None
                lp = self._chat_logprobs(out, len(out.new_token_ids), as_ids) if req.logprobs else None
                for k, delta in enumerate(choices[i].deltas(out)):
                    # one chunk per token (its text may be held back), as in completions; calls as they grow
                    if (k == 0 and out.new_token_ids and (any(delta.values()) or not out.finished)) or k > 0:
                        yield chunk(choice(i, delta, lp=lp), usage)
                        lp = None
                if out.finished:
                    yield chunk(choice(i, {}, finish=choices[i].finish_reason(out), lp=lp), usage)
            async for event in _stream_frame(stream, on_output, chunk, req.include_usage):
                yield event
        return StreamingResponse(events(), media_type="text/event-stream")


@dataclass
class ChatRun:
    """A chat request submitted to the engine (OpenAIServer.start_chat): its choices' outputs as (index, output)
    pairs, and per choice how its text reads (reasoning, content, tool calls)."""
    request: ChatCompletionRequest
    id: str
    created: int
    stream: AsyncIterator[tuple[int, RequestOutput]]
    choices: list[ChatChoice]


def create_app(llm: AsyncLLM, metrics: ServerMetrics, model_name: str, policy: Policy | None = None,
               store: ResponseStore | None = None, images: ImageLimits | None = None) -> FastAPI:
    """The app over a running AsyncLLM. `policy` (default: Policy(), loopback hosts, no key): what every request
    must pass first (mini.server.guard); listed origins also get CORS headers and preflight answers. `store`: where
    the Responses API keeps responses (default: in memory, gone with the process). `images`: the limits on images in
    chat requests (mini.server.images; default ImageLimits(): inline data URLs only)."""
    from mini.server.anthropic import MessagesAPI
    from mini.server.responses import ResponsesAPI
    server = OpenAIServer(llm, metrics, model_name, images)
    messages = MessagesAPI(server)
    responses = ResponsesAPI(server, store if store is not None else ResponseStore())
    app = FastAPI(title="mini", docs_url=None, redoc_url=None)
    app.state.server = server
    app.state.policy = policy = policy or Policy()
    if policy.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(policy.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(Guard, policy=policy, routes=app.router.routes)  # added last: the outermost

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response(request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("request failed")
        return ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Routing errors in OpenAI's shape: an unknown path (404), a method the path does not take (405)."""
        if exc.status_code == 404:
            error = ApiError(f"no such endpoint: {request.url.path}", status=404, code="not_found")
        elif exc.status_code == 405:
            error = ApiError(f"{request.method} is not allowed on {request.url.path}", status=405,
                             code="method_not_allowed")
        else:
            error = ApiError(str(exc.detail), status=exc.status_code)
        response = error.response(request.url.path)
        response.headers.update(exc.headers or {})
        return response

    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.post("/v1/responses")(responses.create)
    app.get("/v1/responses/{response_id}")(responses.retrieve)
    app.delete("/v1/responses/{response_id}")(responses.delete)
    app.get("/v1/responses/{response_id}/input_items")(responses.input_items)
    app.router.on_shutdown.append(responses.store.close)
    app.post("/v1/messages")(messages.create)
    app.post("/v1/messages/count_tokens")(messages.count_tokens)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "mini",
                                            "max_model_len": llm.engine.max_model_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def build_app(model_or_path, model_name: str | None = None, policy: Policy | None = None, warmup: bool = False,
              responses_db: str | None = None, responses_max: int = DEFAULT_MAX_RESPONSES,
              images: ImageLimits | None = None, **engine_opts) -> FastAPI:
    """Engine + background loop + app, for `serve` and tests. `engine_opts` go to mini.engine.build_engine;
    `warmup` runs mini.engine.warmup before the engine thread starts (and so before the app can answer).
    `responses_db`: the SQLite file of stored responses (None: in memory), keeping the newest `responses_max`."""
    from mini.engine import build_engine
    engine = build_engine(model_or_path, **engine_opts)
    if warmup:
        from mini.engine.warmup import warm_up
        warm_up(engine)  # records engine.warmup_s
    metrics = ServerMetrics(engine)
    llm = AsyncLLM(engine, on_output=metrics.observe)
    name = model_name or (model_or_path if isinstance(model_or_path, str) else "mini")
    app = create_app(llm, metrics, name, policy, ResponseStore(responses_db or ":memory:", responses_max), images)
    app.router.on_shutdown.append(llm.shutdown)
    return app


def policy_from_args(args) -> Policy:
    """The Policy of `mini serve`'s flags. Hosts default to the loopback names plus --host; a wildcard bind
    (0.0.0.0, ::) without --allowed-hosts accepts any Host, since the names clients use are unknown here."""
    from mini.args import split_list
    if args.allowed_hosts is not None:
        hosts = split_list(args.allowed_hosts)
    elif args.host in ("0.0.0.0", "::", ""):
        hosts = None
    else:
        hosts = (*LOOPBACK_HOSTS, args.host.lower())
    return Policy(api_key=args.api_key, allowed_origins=split_list(args.allowed_origins), allowed_hosts=hosts,
                  max_body_bytes=args.max_body_mb * 1000 * 1000, read_timeout_s=args.request_timeout,
                  metrics_need_key=getattr(args, "metrics_need_key", False))


def exposure_warning(host: str, policy: Policy) -> str | None:
    if is_loopback(host) or policy.api_key is not None:
        return None
    return (f"mini serve: warning: listening on {host}, beyond this machine, without an API key: anyone who can "
            "reach it can use it (set --api-key or MINI_API_KEY)")


def is_loopback(host: str) -> bool:
    import ipaddress
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def startup_line(app: FastAPI, url: str) -> str:
    """One line: model, dtype and device, the backends chosen, the cache, memory, warm-up and address."""
    import torch

    from mini import switches
    from mini.ops.backends import current
    engine = app.state.server.llm.engine
    o, runner = engine.options, engine.runner
    if runner.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(runner.device)
        memory = f"GPU memory {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use"
    else:
        memory = f"RSS {_rss_bytes() / 2**30:.2f} GiB"
    warm = engine.warmup_s
    return (f"mini serve: {app.state.server.model_name} · {str(o.dtype).removeprefix('torch.')} on {runner.device}"
            f" · {current()} (switches: {switches.current()}), decode"
            f" {'CUDA graphs' if engine.decode_graphs else 'eager'}"
            f"{', overlapped' if engine.overlap else ''} · cache {engine.blocks.n_blocks} blocks x "
            f"{engine.blocks.block_tokens} positions, context {engine.max_model_len:,} · {memory}"
            f"{f' · warmed up in {warm:.1f} s' if warm is not None else ''} · {url}"
            f"{'' if app.state.policy.api_key is None else ' (API key required)'}")


def _rss_bytes() -> int:
    import os
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def serve(args) -> int:
    """`mini serve` on one engine: build, warm up (default on CUDA), say so in one line, serve until stopped."""
    from mini.args import engine_opts
    policy = policy_from_args(args)
    opts = engine_opts(args)
    warmup = args.warmup if args.warmup is not None else str(opts["device"]).startswith("cuda")
    try:
        app = build_app(args.model, args.served_model_name, policy, warmup, responses_db=args.responses_db,
                        responses_max=args.responses_max, images=ImageLimits(allow_urls=args.allow_image_urls),
                        **opts)
    except ValueError as e:  # an option the model cannot take (--speculative dspark without mtp.*)
        import sys
        print(f"error: {e}", file=sys.stderr)
        return 2
    from mini.engine.warmup import freeze_heap
    freeze_heap()  # start-up's objects out of the collector's walks: no full-collection pause while serving
    run_http(app, args)
    return 0


def run_http(app: FastAPI, args) -> None:
    """Serve `app` (made with policy_from_args(args)) on --host/--port until stopped, after the start-up line (and a
    warning when it listens beyond this machine without an API key)."""
    import sys

    import uvicorn
    warning = exposure_warning(args.host, app.state.policy)
    if warning:
        print(warning, file=sys.stderr)
    print(startup_line(app, f"http://{args.host}:{args.port}"), file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                http=h11_with_header_timeout(app.state.policy.read_timeout_s))

