"""Serving with data-parallel attention over EP ranks: rank 0 runs the HTTP server and routes each request to one
rank; every rank runs its own LLMEngine (scheduler, cache pools) over a `DPModel`.

    torchrun --nproc-per-node N -m mini serve --model DIR ...   # one process per rank
    mini serve --ep N --model DIR ...                            # the same, N local processes (parallel.launch)

Rank 0's HTTP server is the caller's (`serve_http`, mini.server.app.serve_engine for `mini serve`): it runs an
AsyncLLM whose engine thread runs `DPDriver` instead of stepping one engine. Nothing here imports the server.

The ranks move in lock step. Each step starts with one all-gather of a small `StepMessage` per rank: rank 0's
carries the new requests and aborts (each addressed to one rank) and a stop flag; every rank's carries whether its
engine has work and the outputs of its previous step (which only rank 0 reads). All ranks thus see the same
messages and take the same decision: if any rank has work (or got a command), every rank runs the step, a rank
without a forward of its own joining the MoE layers with an empty batch (`DPModel.join_idle`); otherwise rank 0
waits for the next request (at most `IDLE_POLL_S`, so the idle ranks' collective never times out).

Rank 0 places a request on the rank with the fewest unfinished requests and remembers the owner, so an abort (a
client that went away) reaches the engine holding the request. Outputs travel without their prompt ids and
without earlier tokens' ids and logprobs (rank 0 keeps those), so a step's messages stay small for long contexts.
A failed step on any rank breaks the lock step: that rank raises, and rank 0 fails every request from then on.
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from mini.engine.async_engine import Abort, Add, Failed, apply
from mini.engine.llm import LLMEngine, RequestOutput
from mini.parallel.groups import DistContext, init, shutdown
from mini.parallel.launch import run_local

log = logging.getLogger("mini.parallel.serve")

IDLE_POLL_S = 1.0  # longest wait of an idle rank 0 before the next (empty) step message


# ---------------------------------------------------------------------------------------------------- messages
@dataclass
class AddRequest(Add):
    rank: int = 0  # the owner


@dataclass
class AbortRequest(Abort):
    rank: int = 0  # the owner


@dataclass
class RequestError:
    """A request its rank refused (add_request raised ValueError)."""
    request_id: str
    message: str
    finished: bool = True


@dataclass
class StepMessage:
    has_work: bool
    outputs: list = field(default_factory=list)  # RequestOutput (slimmed) | RequestError, of the previous step
    commands: list = field(default_factory=list)  # rank 0 only: AddRequest | AbortRequest
    stop: bool = False  # rank 0 only: leave the loop after this message


def slim(out: RequestOutput) -> RequestOutput:
    """Drop what rank 0 already has: the prompt ids, earlier tokens' ids and logprobs."""
    n = len(out.new_token_ids)
    return replace(out, prompt_token_ids=[], token_ids=[], logprobs=out.logprobs[len(out.logprobs) - n:] if n else [])


@dataclass
class _Track:
    """Rank 0's record of one request: its owner and what `slim` left out."""
    rank: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def restore(self, out: RequestOutput) -> RequestOutput:
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        return replace(out, prompt_token_ids=self.prompt_ids, token_ids=list(self.token_ids),
                       logprobs=list(self.logprobs))


class Router:
    """Rank 0: which rank holds which request; new requests go to the rank with the fewest unfinished ones
    (ties: the lowest rank)."""

    def __init__(self, world: int):
        self.load = [0] * world  # unfinished requests per rank
        self.placed = [0] * world  # requests placed per rank so far
        self.tracks: dict[str, _Track] = {}

    def place(self, request_id: str, prompt_ids: list[int]) -> int:
        rank = min(range(len(self.load)), key=lambda r: (self.load[r], r))
        self.load[rank] += 1
        self.placed[rank] += 1
        self.tracks[request_id] = _Track(rank, prompt_ids)
        return rank

    def status(self) -> dict:
        return {"world": len(self.load), "unfinished": list(self.load), "placed": list(self.placed)}

    def owner(self, request_id: str) -> int | None:
        track = self.tracks.get(request_id)
        return None if track is None else track.rank

    def receive(self, out: RequestOutput | RequestError) -> RequestOutput | RequestError:
        """An output from its rank, made whole again; a finished request leaves its rank's load."""
        track = self.tracks.get(out.request_id)
        if track is None:
            return out
        if out.finished:
            del self.tracks[out.request_id]
            self.load[track.rank] -= 1
        return out if isinstance(out, RequestError) else track.restore(out)


# ---------------------------------------------------------------------------------------------------- every rank
class DPWorker:
    """One rank's side of the lock step: its engine (over a DPModel) and the per-step message exchange."""

    def __init__(self, engine: LLMEngine, ctx: DistContext):
        self.engine, self.ctx = engine, ctx
        self.dp = engine.runner.model
        self._outbox: list = []

    def sync(self, commands: list = (), stop: bool = False) -> list[StepMessage]:
        """The step's one all-gather: every rank's message, in rank order."""
        mine = StepMessage(self.engine.has_work(), self._outbox, list(commands), stop)
        self._outbox = []
        if not self.ctx.multi:
            return [mine]
        every = [None] * self.ctx.world
        dist.all_gather_object(every, mine)
        return every

    @torch.inference_mode()
    def step(self, messages: list[StepMessage]) -> bool:
        """Apply rank 0's commands for this rank and run the step on every rank if any has work; returns whether
        the step ran."""
        commands = messages[0].commands
        refused = apply(self.engine, [c for c in commands if c.rank == self.ctx.rank])
        self._outbox += [RequestError(f.request_id, str(f.error)) for f in refused]
        if not commands and not any(m.has_work for m in messages):
            return False
        ran_forward = False
        if self.engine.has_work():
            outputs = self.engine.step()
            self._outbox += [slim(o) for o in outputs]
            ran_forward = outputs.forward
        if not ran_forward:  # no forward of our own: serve the other ranks' tokens
            self.dp.join_idle()
        return True

    def follow(self) -> None:
        """Ranks other than 0: run steps until rank 0 says stop."""
        while True:
            messages = self.sync()
            if messages[0].stop:
                return
            self.step(messages)


# ---------------------------------------------------------------------------------------------------- rank 0
class DPDriver:
    """Rank 0's engine thread (an AsyncLLM driver, mini.engine.async_engine.Driver): routes each request to a
    rank and drives the lock step; the outputs of every rank come back through the step messages. After a failed
    step the ranks are out of step: every open request fails, and every new one, until shutdown."""
    poll_s = IDLE_POLL_S

    def __init__(self, worker: DPWorker):
        self.worker, self.router = worker, Router(worker.ctx.world)
        self._idle = True
        self._failed: Exception | None = None

    def status(self) -> dict:
        """Requests per rank (GET /dp), for operators and tests."""
        return self.router.status()

    def start(self) -> None:
        if self.worker.ctx.device.type == "cuda":  # the CUDA device is per thread
            torch.cuda.set_device(self.worker.ctx.device)

    def idle(self) -> bool:
        return self._idle

    def step(self, commands: list[Add | Abort], stop: bool) -> list[RequestOutput | Failed]:
        if self._failed is not None:
            return [Failed(c.request_id, self._failed) for c in commands if isinstance(c, Add)]
        try:
            messages = self.worker.sync(self._route(commands), stop)
            outputs = [out for m in messages for out in self._receive(m.outputs)]
            if not stop:
                self._idle = not self.worker.step(messages)
            return outputs
        except Exception as e:  # the ranks are out of step now: nothing more can run
            log.exception("DP engine loop failed")
            self._failed, self._idle = RuntimeError(f"engine step failed: {e}"), True
            return [Failed(request_id, self._failed) for request_id in list(self.router.tracks)]

    def _route(self, commands: list[Add | Abort]) -> list:
        """The commands addressed to the ranks: a new request to the least loaded, an abort to the owner."""
        routed = []
        for cmd in commands:
            if isinstance(cmd, Add):
                rank = self.router.place(cmd.request_id, cmd.prompt_ids)
                routed.append(AddRequest(cmd.request_id, cmd.prompt_ids, cmd.params, rank=rank))
            elif (rank := self.router.owner(cmd.request_id)) is not None:
                routed.append(AbortRequest(cmd.request_id, rank=rank))
        return routed

    def _receive(self, outputs: list) -> list[RequestOutput | Failed]:
        received = []
        for out in outputs:
            out = self.router.receive(out)
            received.append(Failed(out.request_id, ValueError(out.message)) if isinstance(out, RequestError)
                            else out)
        return received


# ---------------------------------------------------------------------------------------------------- entry points
def _build_worker(ctx: DistContext, args) -> DPWorker:
    from mini.parallel.dp import load_ep_model
    from mini.engine import build_engine
    from mini.args import engine_opts
    opts = {**engine_opts(args), "device": str(ctx.device)}
    model, cfg, tok = load_ep_model(args.model, ctx, opts["dtype"])
    engine = build_engine(model, config=cfg, tokenizer=tok, **opts)
    if ctx.multi:  # pools sized from free memory may differ: rank 0 admits prompts that fit on every rank
        context = torch.tensor([engine.max_model_len], device=ctx.device)
        dist.all_reduce(context, op=dist.ReduceOp.MIN)
        engine.max_model_len = int(context.item())
    return DPWorker(engine, ctx)


# serve_http(args, engine, driver, routes): rank 0's HTTP server over `engine`, stepped by `driver`, with extra GET
# `routes` (path -> fn() -> dict); it serves until stopped (mini.server.app.serve_engine)
ServeHTTP = Callable[..., object]


def serve_rank(ctx: DistContext, args, serve_http: ServeHTTP) -> None:
    """This process's part of `mini serve` over DP ranks: rank 0 serves HTTP until stopped (Ctrl-C / SIGTERM)
    and then stops the other ranks; they ignore Ctrl-C and follow rank 0."""
    if ctx.rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = _build_worker(ctx, args)
    if ctx.rank != 0:
        worker.follow()
        return
    driver = DPDriver(worker)
    serve_http(args, worker.engine, driver, {"/dp": driver.status})  # gauges (cache use, queue): rank 0's engine


def serve_torchrun(args, serve_http: ServeHTTP) -> int:
    """`mini serve` in a process of a torchrun (or `--ep`) job."""
    from mini.args import resolve_device
    device, _ = resolve_device(args)
    ctx = init(device)
    if ctx.device.type == "cpu" and ctx.multi and "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world))
    try:
        serve_rank(ctx, args, serve_http)
    finally:
        shutdown(ctx)
    return 0


def serve_local(args, world: int, serve_http: ServeHTTP) -> int:
    """`mini serve --ep N`: N local ranks started as torchrun would (mini.parallel.launch.run_local: signals to
    this process become one SIGINT to rank 0, which shuts the server down and stops the other ranks)."""
    run_local(world, serve_torchrun, args, serve_http)
    return 0
