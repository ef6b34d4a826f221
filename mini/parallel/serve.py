"""Serving with data-parallel attention over EP ranks: rank 0 runs the HTTP server and routes each request to one
rank; every rank runs its own LLMEngine (scheduler, cache pools) over a `DPModel`.

    torchrun --nproc-per-node N -m mini serve --model DIR ...   # one process per rank
    mini serve --ep N --model DIR ...                            # the same, N local processes started here

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

import argparse
import logging
import os
import queue
import signal
import socket
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from mini.parallel.groups import DistContext, init, shutdown
from mini.engine.async_engine import AsyncLLM
from mini.engine.llm import LLMEngine, RequestOutput

log = logging.getLogger("mini.parallel.serve")

IDLE_POLL_S = 1.0  # longest wait of an idle rank 0 before the next (empty) step message


# ---------------------------------------------------------------------------------------------------- messages
@dataclass
class AddRequest:
    rank: int  # the owner
    request_id: str
    prompt_ids: list[int]
    params: object  # SamplingParams


@dataclass
class AbortRequest:
    rank: int
    request_id: str


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
        for cmd in commands:
            if cmd.rank != self.ctx.rank:
                continue
            if isinstance(cmd, AbortRequest):
                self.engine.abort(cmd.request_id)
                continue
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params)
            except ValueError as e:
                self._outbox.append(RequestError(cmd.request_id, str(e)))
        if not commands and not any(m.has_work for m in messages):
            return False
        forwards = self.dp.forwards
        if self.engine.has_work():
            self._outbox += [slim(o) for o in self.engine.step()]
        if self.dp.forwards == forwards:  # no forward of our own: serve the other ranks' tokens
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
class DPAsyncLLM(AsyncLLM):
    """The server's engine on rank 0: the AsyncLLM caller side (validate, generate, abort) unchanged; its engine
    thread routes requests to the ranks and drives the lock step instead of stepping one engine."""

    def __init__(self, worker: DPWorker, on_output=None):
        self.worker, self.router = worker, Router(worker.ctx.world)
        super().__init__(worker.engine, on_output)

    def _loop(self) -> None:
        if self.worker.ctx.device.type == "cuda":  # the CUDA device is per thread
            torch.cuda.set_device(self.worker.ctx.device)
        idle = True
        try:
            while True:
                stop = self._stop.is_set()
                messages = self.worker.sync(self._commands(wait=idle and not stop), stop)
                for m in messages:
                    self._deliver(m.outputs)
                if stop:
                    return
                idle = not self.worker.step(messages)
        except Exception as e:  # the ranks are out of step now: nothing more can run
            log.exception("DP engine loop failed")
            self._refuse(RuntimeError(f"engine step failed: {e}"))

    def _commands(self, wait: bool) -> list:
        """Drain the inbox into commands addressed to ranks; when idle, wait up to IDLE_POLL_S for the first."""
        commands = []
        try:
            cmd = self._inbox.get(timeout=IDLE_POLL_S) if wait else self._inbox.get_nowait()
            while True:
                if cmd[0] == "add":
                    _, request_id, ids, params = cmd
                    commands.append(AddRequest(self.router.place(request_id, ids), request_id, ids, params))
                elif cmd[0] == "abort" and (rank := self.router.owner(cmd[1])) is not None:
                    commands.append(AbortRequest(rank, cmd[1]))
                cmd = self._inbox.get_nowait()
        except queue.Empty:
            return commands

    def _deliver(self, outputs: list) -> None:
        for out in outputs:
            out = self.router.receive(out)
            if isinstance(out, RequestError):
                self._send(out.request_id, ValueError(out.message))
                continue
            if self.on_output is not None:
                self.on_output(out)
            self._send(out.request_id, out)

    def _refuse(self, error: Exception) -> None:
        """After a failure: fail every open request, then every new one, until shutdown."""
        for request_id in list(self.router.tracks):
            self._send(request_id, error)
        while not self._stop.is_set():
            try:
                cmd = self._inbox.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                continue
            if cmd[0] == "add":
                self._send(cmd[1], error)


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


def serve_rank(ctx: DistContext, args) -> None:
    """This process's part of `mini serve` over DP ranks: rank 0 serves HTTP until stopped (Ctrl-C / SIGTERM)
    and then stops the other ranks; they ignore Ctrl-C and follow rank 0."""
    if ctx.rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = _build_worker(ctx, args)
    if ctx.rank != 0:
        worker.follow()
        return
    import uvicorn

    from mini.server.app import create_app
    from mini.server.metrics import ServerMetrics
    metrics = ServerMetrics(worker.engine)  # gauges (cache use, queue) are rank 0's engine only
    llm = DPAsyncLLM(worker, on_output=metrics.observe)
    try:
        app = create_app(llm, metrics, args.served_model_name or args.model)
        app.router.on_shutdown.append(llm.shutdown)  # before uvicorn re-raises the signal that stopped it

        @app.get("/dp")
        async def dp_status() -> dict:  # requests per rank, for operators and tests
            return llm.router.status()
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        llm.shutdown()


def serve_torchrun(args) -> int:
    """`mini serve` in a process of a torchrun (or `--ep`) job."""
    from mini.args import resolve_device
    device, _ = resolve_device(args)
    ctx = init(device)
    if ctx.device.type == "cpu" and ctx.multi and "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world))
    try:
        serve_rank(ctx, args)
    finally:
        shutdown(ctx)
    return 0


def _local_rank(rank: int, world: int, port: int, args) -> None:
    os.setpgrp()  # out of the terminal's process group: Ctrl-C reaches rank 0 once, through serve_local
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    serve_torchrun(args)


def serve_local(args, world: int) -> int:
    """`mini serve --ep N`: start N local ranks as torchrun would and wait for them. SIGINT / SIGTERM / SIGHUP
    to this process become one SIGINT to rank 0, which shuts the server down and stops the other ranks (uvicorn
    re-raises the signals it caught after its shutdown: one SIGINT ends the rank quietly; a second one, or a
    SIGTERM, would not)."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = mp.start_processes(_local_rank, args=(world, port, args), nprocs=world, join=False,
                               start_method="spawn")

    def stop_rank0(signum, frame):
        if procs.processes[0].is_alive():
            os.kill(procs.processes[0].pid, signal.SIGINT)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_rank0)
    while not procs.join():
        pass
    return 0


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def generate_torchrun(args, prompt: str, num_blocks: int | None) -> int:
    """`mini generate` under torchrun: the prompt runs on rank 0 while the other ranks serve its MoE layers;
    rank 0 prints the text. `args`: the generate command's."""
    from mini.args import resolve_device
    from mini.parallel.launch import _generate_rank
    device, _ = resolve_device(args)
    ctx = init(device)
    try:
        texts = _generate_rank(ctx, argparse.Namespace(**{**vars(args), "prompt": [prompt], "num_blocks": num_blocks}))
    finally:
        shutdown(ctx)
    if ctx.rank == 0:
        print(texts[0])
    return 0
