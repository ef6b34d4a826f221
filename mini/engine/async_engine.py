"""The engine behind the server: one background thread steps the engine; asyncio callers add and abort requests.

Requests enter through a thread-safe inbox that the loop drains between steps, so the engine itself is only ever
touched by its own thread. Outputs go back to each request's asyncio queue with `call_soon_threadsafe`. A caller
that stops iterating (client disconnected, task cancelled) aborts its request, which frees its cache.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from mini.engine.llm import LLMEngine, RequestOutput
from mini.engine.sequence import SamplingParams

log = logging.getLogger("mini.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine, on_output: Callable[[RequestOutput], None] | None = None):
        self.engine = engine
        self.on_output = on_output  # called in the engine thread for every output (metrics)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mini-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (any thread / event loop)
    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and check a request; ValueError says what is wrong. Read-only, so safe off the engine thread."""
        ids = self.engine.encode(prompt)
        self.engine.check_prompt(ids, params)
        return ids

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        ids = self.validate(prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._inbox.put(("add", request_id, ids, params))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step leaves the batch's state unknown: fail its requests
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                if self.on_output is not None:
                    self.on_output(out)
                with self._lock:
                    stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, request_id, ids, params = cmd
            try:
                self.engine.add_request(request_id, ids, params)
            except ValueError as e:
                self._send(request_id, e)
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])

    def _send(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._send(request_id, RuntimeError(f"engine step failed: {error}"))
        self.engine.step()  # flush the abort outputs and release the cache
