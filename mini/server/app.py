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
from dataclasses import replace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import ValidationError

from mini.engine import RequestOutput, SamplingParams
from mini.engine.async_engine import AsyncLLM
from mini.server.chat_output import ChatChoice, split_reasoning  # noqa: F401 (split_reasoning: re-exported)
from mini.server.metrics import ServerMetrics
from mini.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("mini.server")


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


async def parse_body(request: Request, schema):
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"the request body is not valid UTF-8 (bad byte at offset {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(f"invalid JSON in the request body: {e.msg} (line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError("the request contains invalid Unicode (a lone surrogate escape)") from None
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":  # never accepted and ignored
            raise ApiError(f"'{loc}' is not supported by this server", param=loc,
                           code="unsupported_parameter") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(f"invalid value for '{loc}': {msg}" if loc else msg, param=loc or None) from None


def _usage(*outs: RequestOutput) -> dict:
    """Usage of a request's choices: the prompt once, every choice's output."""
    n_prompt, n_out = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


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


class OpenAIServer:
    def __init__(self, llm: AsyncLLM, metrics: ServerMetrics, model_name: str):
        self.llm, self.metrics, self.model_name = llm, metrics, model_name
        self.tokenizer = llm.engine.tokenizer

    # ------------------------------------------------------------------ shared plumbing
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", status=404, code="model_not_found")

    async def _start_n(self, prompt, params: SamplingParams, request_id: str, n: int
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`n` samples of one prompt as (choice index, output) pairs. Choice 0 ends its prefill with a snapshot at
        the prompt's last block boundary (`share_prompt`); the others are submitted once it has its first token and
        take the prompt's full blocks and that snapshot from the prefix cache: each computes only the prompt's
        last partial block. A seed gives choice i the seed + i."""
        if n == 1:
            stream = self._start(prompt, params, request_id)
            return _indexed([stream])
        first = self._start(prompt, replace(params, share_prompt=True), f"{request_id}-0")

        async def later():
            return [self._start(prompt, replace(params, seed=None if params.seed is None else params.seed + i),
                                      f"{request_id}-{i}") for i in range(1, n)]
        return _indexed([first], later)

    def _start(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        try:
            ids = self.llm.validate(prompt, params)
        except ValueError as e:
            raise ApiError(str(e)) from None
        except (UnicodeError, TypeError) as e:
            raise ApiError(f"the prompt cannot be tokenized: {e}") from None
        return self.llm.generate(ids, params, request_id)

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

    def _token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else str(tid)

    # ------------------------------------------------------------------ /v1/completions
    def _completion_logprobs(self, out: RequestOutput, n_new: int, offset: int) -> dict | None:
        lps = out.logprobs[len(out.logprobs) - n_new:] if n_new else []
        if not out.logprobs and not lps:
            return None
        tokens = [self._token_text(lp.token_id) for lp in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token_text(t): v for t, v in lp.top.items()} for lp in lps],
                "text_offset": offsets}

    async def completions(self, request: Request):
        req = await parse_body(request, CompletionRequest)
        self._check_model(req.model)
        try:
            params = req.sampling_params(16, req.logprobs)
        except ValueError as e:
            raise ApiError(str(e)) from None
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await self._start_n(req.prompt, params, rid, req.n)
        want_lp = req.logprobs is not None
        if not req.stream:
            choices = []
            outs = await self._final(stream, request)
            for i, out in enumerate(outs):
                choice = {"index": i, "text": out.text, "finish_reason": out.finish_reason,
                          "logprobs": self._completion_logprobs(out, len(out.token_ids), 0) if want_lp else None}
                if isinstance(out.stop_reason, (str, int)):
                    choice["stop_reason"] = out.stop_reason
                choices.append(choice)
            return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                                 "model": self.model_name, "choices": choices, "usage": _usage(*outs)})

        async def events():
            sent = [0] * req.n
            last = {}
            try:
                async for i, out in stream:
                    last[i] = out
                    if out.new_token_ids or out.finished:  # one chunk per token, even if its text is held back
                        lp = self._completion_logprobs(out, len(out.new_token_ids), sent[i]) if want_lp else None
                        yield _sse({"id": rid, "object": "text_completion", "created": created,
                                    "model": self.model_name, "choices": [
                                        {"index": i, "text": out.new_text, "logprobs": lp,
                                         "finish_reason": out.finish_reason if out.finished else None}]})
                        sent[i] += len(out.new_text)
            except RuntimeError as e:
                yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
                return
            if req.include_usage and last:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                            "choices": [], "usage": _usage(*last.values())})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ /v1/chat/completions
    def _chat_logprobs(self, out: RequestOutput, n_new: int) -> dict:
        lps = out.logprobs[len(out.logprobs) - n_new:] if n_new else []

        def entry(tid, lp):
            text = self._token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in lps]}

    async def chat(self, request: Request):
        req = await parse_body(request, ChatCompletionRequest)
        self._check_model(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise ApiError("top_logprobs must be in [0, 20]", param="top_logprobs")
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        req.max_tokens = max_tokens
        try:
            params = req.sampling_params(None, n_lp)
            prompt = req.prompt()
        except ValueError as e:
            raise ApiError(str(e), param="messages") from None
        try:
            params.grammar = req.grammar()
        except ValueError as e:
            raise ApiError(str(e), param="response_format" if req.response_format else "tools") from None
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await self._start_n(prompt, params, rid, req.n)
        names = req.tool_names if req.parses_tool_calls else None
        choices = [ChatChoice(i, req.thinking_mode, names) for i in range(req.n)]
        if not req.stream:
            outs = await self._final(stream, request)
            body = [{"index": i, "message": c.message(out), "finish_reason": c.finish_reason(out),
                     "logprobs": self._chat_logprobs(out, len(out.token_ids)) if req.logprobs else None}
                    for i, (c, out) in enumerate(zip(choices, outs))]
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                                 "model": self.model_name, "choices": body, "usage": _usage(*outs)})

        def chunk(i: int, delta: dict, finish=None, lp=None):
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                         "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]})

        async def events():
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            last = {}
            try:
                async for i, out in stream:
                    last[i] = out
                    lp = self._chat_logprobs(out, len(out.new_token_ids)) if req.logprobs else None
                    for k, delta in enumerate(choices[i].deltas(out)):
                        # one chunk per token (its text may be held back), as in completions; calls at the end
                        if (k == 0 and out.new_token_ids and (any(delta.values()) or not out.finished)) or k > 0:
                            yield chunk(i, delta, lp=lp)
                            lp = None
                    if out.finished:
                        yield chunk(i, {}, finish=choices[i].finish_reason(out), lp=lp)
            except RuntimeError as e:
                yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
                return
            if req.include_usage and last:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": self.model_name, "choices": [], "usage": _usage(*last.values())})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")


def create_app(llm: AsyncLLM, metrics: ServerMetrics, model_name: str) -> FastAPI:
    server = OpenAIServer(llm, metrics, model_name)
    app = FastAPI(title="mini", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("request failed")
        return ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500).response()

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
        response = error.response()
        response.headers.update(exc.headers or {})
        return response

    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)

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


def build_app(model_or_path, model_name: str | None = None, **engine_opts) -> FastAPI:
    """Engine + background loop + app, for `serve` and tests. `engine_opts` go to mini.engine.build_engine."""
    from mini.engine import build_engine
    engine = build_engine(model_or_path, **engine_opts)
    metrics = ServerMetrics(engine)
    llm = AsyncLLM(engine, on_output=metrics.observe)
    name = model_name or (model_or_path if isinstance(model_or_path, str) else "mini")
    app = create_app(llm, metrics, name)
    app.router.on_shutdown.append(llm.shutdown)
    return app


def serve(args) -> int:
    import uvicorn
    from mini.args import engine_opts
    app = build_app(args.model, args.served_model_name, **engine_opts(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


class BackgroundServer:
    """Serve an app from a thread of this process (tests, in-process benchmarks):
    `with BackgroundServer(app) as url: ...`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import socket
        import threading

        import uvicorn
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
