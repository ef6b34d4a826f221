"""The engine behind the server: one background thread runs a driver; asyncio callers add and abort requests.

Requests enter through a thread-safe inbox that the loop drains between steps, so the engine itself is only ever
touched by its own thread. Outputs go back to each request's asyncio queue with `call_soon_threadsafe`. A caller
that stops iterating (client disconnected, task cancelled) aborts its request, which frees its cache.

What a step does is the driver's (`Driver`): `LocalDriver` steps one engine; mini.parallel.serve.DPDriver routes
requests to data-parallel ranks and drives their lock step. The loop is the same for both.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from mini.engine.llm import LLMEngine, RequestOutput
from mini.engine.sequence import SamplingParams
from mini.step import ImageSpan

log = logging.getLogger("mini.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class Add:
    """A new request, checked by the caller side (AsyncLLM.validate)."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    images: list[ImageSpan] = field(default_factory=list)  # the prompt's image spans (LLMEngine.add_request)


@dataclass
class Abort:
    request_id: str


@dataclass
class Failed:
    """A request that cannot go on: the caller's iterator raises `error`."""
    request_id: str
    error: BaseException


def apply(engine: LLMEngine, commands: list[Add | Abort]) -> list[Failed]:
    """Add and abort requests on `engine`, in order; a request it refuses (ValueError) comes back as Failed."""
    failed = []
    for cmd in commands:
        if isinstance(cmd, Abort):
            engine.abort(cmd.request_id)
            continue
        try:
            engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.images)
        except ValueError as e:
            failed.append(Failed(cmd.request_id, e))
    return failed


class Driver(Protocol):
    """What AsyncLLM's engine thread runs. `step` takes the commands that arrived since the last call (in order),
    applies them and runs at most one engine step; it returns the outputs (RequestOutput, or Failed for a request
    that cannot go on) and must not raise for a failed step: it fails that step's requests instead. With `stop`
    it applies nothing new and only winds down (e.g. tells other ranks to stop). `idle()`: nothing to step until
    a command arrives, so the loop may wait up to `poll_s` for one."""
    poll_s: float

    def start(self) -> None: ...

    def idle(self) -> bool: ...

    def step(self, commands: list[Add | Abort], stop: bool) -> list[RequestOutput | Failed]: ...


class LocalDriver:
    """One engine in this process: commands go straight to it; a failed step aborts its requests."""
    poll_s = 0.5

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def start(self) -> None:
        pass

    def idle(self) -> bool:
        return not self.engine.has_work()

    def step(self, commands: list[Add | Abort], stop: bool) -> list[RequestOutput | Failed]:
        if stop:
            return []
        failed = apply(self.engine, commands)
        if not self.engine.has_work():
            return failed
        try:
            return failed + self.engine.step()
        except Exception as e:  # a failed step leaves the batch's state unknown: fail its requests
            log.exception("engine step failed")
            return failed + self._fail_all(e)

    def _fail_all(self, error: Exception) -> list[Failed]:
        out = []
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            out.append(Failed(request_id, RuntimeError(f"engine step failed: {error}")))
        self.engine.step()  # flush the abort outputs and release the cache
        return out


class AsyncLLM:
    def __init__(self, engine: LLMEngine, on_output: Callable[[RequestOutput], None] | None = None,
                 driver: Driver | None = None):
        """`engine` checks requests on the caller side (and is what a LocalDriver steps); `driver` (default
        LocalDriver(engine)) runs the steps in the engine thread."""
        self.engine = engine
        self.driver = driver if driver is not None else LocalDriver(engine)
        self.on_output = on_output  # called in the engine thread for every output (metrics)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mini-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (any thread / event loop)
    def validate(self, prompt: str | list[int], params: SamplingParams, images: list[ImageSpan] | None = None
                 ) -> list[int]:
        """Tokenize and check a request; ValueError says what is wrong. Read-only, so safe off the engine thread."""
        ids = self.engine.encode(prompt)
        self.engine.check_prompt(ids, params)
        self.engine.check_images(ids, images or [])
        return ids

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       images: list[ImageSpan] | None = None) -> AsyncIterator[RequestOutput]:
        ids = self.validate(prompt, params, images)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._inbox.put(Add(request_id, ids, params, list(images or [])))
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
                self._inbox.put(Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)  # wakes a waiting loop
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        self.driver.start()
        while True:
            stop = self._stop.is_set()
            commands = self._take(wait=self.driver.idle() and not stop)
            outputs = self.driver.step(commands, stop)
            for out in outputs:
                if isinstance(out, Failed):
                    self._send(out.request_id, out.error)
                    continue
                if self.on_output is not None:
                    self.on_output(out)
                self._send(out.request_id, out)
            if stop:
                return

    def _take(self, wait: bool) -> list[Add | Abort]:
        """The commands in the inbox, in order; when `wait`, up to the driver's poll_s for the first."""
        commands = []
        try:
            cmd = self._inbox.get(timeout=self.driver.poll_s) if wait else self._inbox.get_nowait()
            while True:
                if cmd is not None:
                    commands.append(cmd)
                cmd = self._inbox.get_nowait()
        except queue.Empty:
            return commands

    def _send(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)
