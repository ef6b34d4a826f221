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

Every rank's message also carries its load (`balance.RankLoad`: prompt tokens still to prefill, decoding context,
free cache). Rank 0 places a request by load (`balance.Placement`) and remembers the owner, so an abort (a client
that went away) reaches the engine holding the request. From the same loads every rank derives the same cap on the
prompt tokens it prefills in the step (`balance.prefill_cap`), so that a rank that only decodes does not wait on
another rank's long prefill chunk every step (not in deterministic mode: its chunks are fixed by the prompt).
Outputs travel without their prompt ids and without earlier tokens' ids and logprobs (rank 0 keeps those), so a
step's messages stay small for long contexts. A request's images (its spans' patches) travel with it, to every rank.
A failed step on any rank breaks the lock step: that rank raises, and rank 0 fails every request from then on.

On CUDA the ranks' decode steps replay CUDA graphs (mini.parallel.dp: the ranks agree on one bucket per step) and,
as on one GPU, are overlapped: a rank plans and launches step N+1 while step N runs on its device. Nothing in the
lock step waits for a device: the step messages and the step-shape agreement travel over a gloo group between the
hosts (`step_shape.host_group`; the messages in one collective while they fit, `step_shape.HostMessages`); only
the MoE collectives run over NCCL, inside the graphs or the eager forwards.
A steady decode step needs no agreement at all: when the step messages show that no rank can prefill and no
request is added, every rank knows the step's bucket from them (`foreseen_bucket`, `DPModel.foresee`), so such a
step costs one host round trip (its messages), other steps two (every step of a speculating server: any step may
verify drafts, docs/engine.md). GET /dp reports the step kinds (`foreseen`: steps without an agreement) and the
mean host time of both exchanges (`agree_us_mean`, `sync_us_mean`).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from mini.engine.async_engine import Abort, Add, Failed, apply
from mini.engine.llm import LLMEngine, RequestOutput
from mini.parallel.balance import Placement, RankLoad, prefill_cap
from mini.parallel.groups import DistContext, init, shutdown
from mini.parallel.launch import run_local
from mini.parallel.step_shape import HostMessages

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
    load: RankLoad = field(default_factory=RankLoad)  # the sender's load before this step's commands
    decode_graphs: bool = False  # the sender's engine replays decode graphs


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
    """Rank 0: which rank holds which request; new requests go where `balance.Placement` says (by the ranks'
    reported loads)."""

    def __init__(self, world: int):
        self.load = [0] * world  # unfinished requests per rank
        self.placed = [0] * world  # requests placed per rank so far
        self.tracks: dict[str, _Track] = {}
        self.placement = Placement(world)

    def place(self, request_id: str, prompt_ids: list[int]) -> int:
        rank = self.placement.place(len(prompt_ids))
        self.load[rank] += 1
        self.placed[rank] += 1
        self.tracks[request_id] = _Track(rank, prompt_ids)
        return rank

    def report(self, loads: list[RankLoad], sent: list) -> None:
        """The ranks' loads from a step's messages; `sent`: the commands of the same step (applied after)."""
        self.placement.report(loads, added_tokens(sent, len(self.load)))

    def status(self) -> dict:
        loads = [self.placement.load(r) for r in range(len(self.load))]
        return {"world": len(self.load), "unfinished": list(self.load), "placed": list(self.placed),
                "tokens_in_flight": [ld.tokens_in_flight for ld in loads],
                "cache_free_tokens": [ld.cache_free_tokens for ld in loads]}

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


def added_tokens(commands: list, world: int) -> list[int]:
    """Prompt tokens that `commands` add to each rank."""
    added = [0] * world
    for cmd in commands:
        if isinstance(cmd, AddRequest):
            added[cmd.rank] += len(cmd.prompt_ids)
    return added


def foreseen_bucket(messages: list[StepMessage], decode_bucket: Callable[[int], int] | None) -> int | None:
    """The decode bucket of this step on every rank, known from its messages alone (None: the ranks agree on it
    before the forward, mini.parallel.step_shape). When no rank has prompt tokens to prefill (nothing waits,
    nothing runs in prefill) and rank 0 adds no request, every rank's step is a pure decode step of at most its
    decoding sequences (fewer when some finish or are preempted now; a preempted one waits, since nothing is
    admitted in a step that preempts), or no step: the bucket of the largest such count serves every rank. The
    same on every rank; `decode_bucket`: this rank's engine's (LLMEngine.decode_bucket; None without decode graphs,
    which every rank's engine must have)."""
    if decode_bucket is None or not all(m.decode_graphs for m in messages):
        return None
    if any(isinstance(c, AddRequest) for c in messages[0].commands) or any(m.load.prefill_tokens for m in messages):
        return None
    most = max(m.load.decode_seqs for m in messages)
    return decode_bucket(most) if most else None


def step_loads(messages: list[StepMessage]) -> list[RankLoad]:
    """Every rank's load as the step will find it: its report plus the requests rank 0 adds to it now (applied
    after the report was taken). The same on every rank."""
    return [m.load.plus(n) for m, n in zip(messages, added_tokens(messages[0].commands, len(messages)))]


# ---------------------------------------------------------------------------------------------------- every rank
class DPWorker:
    """One rank's side of the lock step: its engine (over a DPModel) and the per-step message exchange."""
    min_prefill_chunk = 256  # the least prompt tokens per step a rank may prefill under `balance.prefill_cap`

    def __init__(self, engine: LLMEngine, ctx: DistContext):
        self.engine, self.ctx = engine, ctx
        self.dp = engine.model  # a DPModel
        self.messages = HostMessages(ctx)
        self._outbox: list = []
        self.syncs, self.sync_s = 0, 0.0  # step messages exchanged and the host time they took

    def sync(self, commands: list = (), stop: bool = False) -> list[StepMessage]:
        """The step's one all-gather: every rank's message, in rank order."""
        mine = StepMessage(self.engine.has_work(), self._outbox, list(commands), stop, RankLoad.of(self.engine),
                           self.engine.decode_graphs)
        self._outbox = []
        if not self.ctx.multi:
            return [mine]
        t0 = time.perf_counter()
        every = self.messages.gather(mine)  # over the hosts: no wait for the devices
        self.syncs += 1
        self.sync_s += time.perf_counter() - t0
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
        engine = self.engine
        # a step that may verify drafts (speculation; forced drafts are off, `_build_worker`) is no pure decode step:
        # no rank foresees it
        foresight = engine.decode_graphs and engine.spec is None
        bucket = foreseen_bucket(messages, engine.decode_bucket if foresight else None)
        if bucket is not None:
            self.dp.foresee(bucket)
        ran_forward = False
        if engine.has_work():
            outputs = engine.step(prefill_cap=prefill_cap(step_loads(messages), self.min_prefill_chunk))
            self._outbox += [slim(o) for o in outputs]
            ran_forward = outputs.forward
        if not ran_forward:  # no forward of our own: serve the other ranks' tokens
            self.dp.join_idle(engine.replay_padding if engine.decode_graphs else None)
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
        """Requests and loads per rank (GET /dp), for operators and tests."""
        dp, worker = self.worker.dp, self.worker
        agreement = dp.agreement
        return {**self.router.status(), "capped_steps": worker.engine.stats.capped_steps,
                "step_kinds": asdict(dp.kinds),
                "agree_us_mean": round(1e6 * agreement.seconds / max(agreement.calls, 1), 1),
                "sync_us_mean": round(1e6 * worker.sync_s / max(worker.syncs, 1), 1)}

    def start(self) -> None:
        if self.worker.ctx.device.type == "cuda":  # the CUDA device is per thread
            torch.cuda.set_device(self.worker.ctx.device)

    def idle(self) -> bool:
        return self._idle

    def step(self, commands: list[Add | Abort], stop: bool) -> list[RequestOutput | Failed]:
        if self._failed is not None:
            return [Failed(c.request_id, self._failed) for c in commands if isinstance(c, Add)]
        try:
            routed = self._route(commands)
            messages = self.worker.sync(routed, stop)
            self.router.report([m.load for m in messages], routed)
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
                routed.append(AddRequest(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.images, rank=rank))
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
    # forced drafts off: a server that may verify foresees no step (DPWorker.step), and speculation is opt-in
    opts = {**engine_opts(args), "device": str(ctx.device), "forced_drafts": False}
    model, cfg, tok = load_ep_model(args.model, ctx, opts["dtype"])
    engine = build_engine(model, config=cfg, tokenizer=tok, **opts)
    if ctx.multi:  # pools sized from free memory may differ: rank 0 admits prompts that fit on every rank
        context = torch.tensor([engine.max_model_len], device=ctx.device)
        dist.all_reduce(context, op=dist.ReduceOp.MIN)
        engine.limit_context(int(context.item()))
    warmup = getattr(args, "warmup", None)  # --warmup / --no-warmup; default: on CUDA, as `mini serve`
    if warmup if warmup is not None else ctx.device.type == "cuda":
        warm_up_ranks(engine, ctx)
    return DPWorker(engine, ctx)


def warm_up_ranks(engine: LLMEngine, ctx: DistContext, parts=None) -> float:
    """`mini serve`'s warm-up (mini.engine.warmup: the prefill and mixed step shapes the first requests use, every
    decode bucket) on every rank at once, in lock step (`dp.LockStepEngine`); returns seconds. `parts`: only these
    parts of the warm-up's plan (tests). Then start-up's objects leave the collector's walks (`freeze_heap`)."""
    from mini.engine.warmup import freeze_heap, warm_up
    from mini.parallel.dp import LockStepEngine
    seconds = warm_up(engine, parts=parts, stepper=LockStepEngine(engine, ctx))
    print(f"rank {ctx.rank} warmed up in {seconds:.1f} s", file=sys.stderr, flush=True)  # a start-up line
    freeze_heap()
    return seconds


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
