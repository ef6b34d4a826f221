"""How EP/DP ranks agree on a step's shape before its forward, so that their MoE exchanges match.

Every MoE layer of a step is a collective over all ranks, so all ranks must run the same kind of step:
* a static decode step (mini.engine.cuda_graphs): every rank replays the CUDA graph of the SAME batch bucket, its
  own decode rows padded up to it; the exchange inside the graph was captured with every rank sending that many
  rows (`DPModel.forward` while capturing), so its collectives need no token counts at replay;
* otherwise an eager step: every rank runs its forward with the step's real token counts.
A rank without tokens of its own joins either kind with an all-padding batch (static) or an empty one (eager).

Each rank reports (its token count, what its step can be: a bucket, `EAGER`, or `IDLE` = no tokens, any bucket
will do); `decide` turns the reports into the one `StepShape` that every rank computes alike.

The reports travel over a gloo group on the hosts (`host_group`), also when the MoE collectives run over NCCL: the
agreement then never waits for a GPU, so a rank can agree on step N+1 and launch it while step N still runs on its
device (the engine's overlapped decode steps; a count exchanged over NCCL would be read back only after step N).
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mini.parallel.groups import DistContext

IDLE = 0  # a rank without tokens in the step: it replays whichever bucket the others agree on
EAGER = -1  # a rank whose step is not a static decode step (prefill, mixed, no graphs): every rank runs eagerly


@dataclass(frozen=True)
class StepShape:
    counts: tuple[int, ...]  # every rank's own token count, in rank order
    bucket: int | None  # the decode bucket every rank replays (its rows padded up to it); None: eager forwards

    @property
    def total(self) -> int:
        return sum(self.counts)

    def exchange_counts(self) -> list[int]:
        """The token counts each rank sends into the MoE exchange: the bucket's rows on every rank of a static
        step (padding rows included), the real counts of an eager one."""
        return [self.bucket] * len(self.counts) if self.bucket is not None else list(self.counts)


def decide(reports: list[tuple[int, int]]) -> StepShape:
    """The step every rank runs, from every rank's (token count, bucket | EAGER | IDLE). Static only when no rank
    needs an eager forward; then the largest bucket, which holds every rank's rows (a rank's bucket is at least
    its row count, and every rank captured the same buckets)."""
    counts = tuple(n for n, _ in reports)
    codes = [c for _, c in reports]
    for n, c in reports:
        if n < 0 or c < EAGER or (c == IDLE and n) or (c > 0 and not 0 < n <= c):
            raise ValueError(f"step report ({n} tokens, bucket {c}): a bucket holds the rank's rows, IDLE has none")
    if sum(counts) == 0 or EAGER in codes:
        return StepShape(counts, None)
    return StepShape(counts, max(codes))


_HOST_GROUP: tuple[object, object] | None = None  # (the default group it was made for, the gloo group)


def host_group(ctx: DistContext):
    """A gloo group over the same ranks for small host-side messages (step shapes, step messages): None (the
    default group) when that is gloo already; made once per default group (every rank calls this in the same
    order: `DPModel` makes it at construction)."""
    global _HOST_GROUP
    if ctx.backend in (None, "gloo"):
        return None
    world = dist.group.WORLD
    if _HOST_GROUP is None or _HOST_GROUP[0] is not world:
        _HOST_GROUP = (world, dist.new_group(backend="gloo"))
    return _HOST_GROUP[1]


class StepAgreement:
    """One rank's side of the per-step agreement: one all-gather of two integers per rank, over the hosts."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.group = host_group(ctx) if ctx.multi else None
        self.calls, self.seconds = 0, 0.0  # agreements made and the host time they took (waits for slower ranks too)

    def agree(self, n_tokens: int, code: int) -> StepShape:
        if not self.ctx.multi:
            return decide([(n_tokens, code)])
        t0 = time.perf_counter()
        mine = torch.tensor([n_tokens, code], dtype=torch.int64)
        every = [torch.empty(2, dtype=torch.int64) for _ in range(self.ctx.world)]
        dist.all_gather(every, mine, group=self.group)
        shape = decide([(int(t[0]), int(t[1])) for t in every])
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return shape


class HostMessages:
    """One picklable object per rank gathered on every rank over the host group, like `dist.all_gather_object` but
    in ONE collective while the objects fit: each rank sends a fixed-size byte buffer (its payload's length, then
    the payload). The buffer's size is the largest payload of the previous gather (every rank saw the same
    lengths, so all pick the same size without asking); a larger payload takes a second collective, of the
    largest length (the lengths came with the first). The serving lock step's per-step messages."""
    header = 8  # the payload's length, int64

    def __init__(self, ctx: DistContext, capacity: int = 1024):
        self.ctx, self.capacity = ctx, capacity
        self.group = host_group(ctx) if ctx.multi else None
        self.rounds = 0  # collectives run (one per gather, two when a payload outgrew the buffer)

    def gather(self, obj) -> list:
        if not self.ctx.multi:
            return [obj]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        buf = torch.zeros(self.header + self.capacity, dtype=torch.uint8)
        buf[:self.header] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        fits = len(data) <= self.capacity
        if fits:
            buf[self.header:self.header + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = self._all_gather(buf)
        sizes = [int(b[:self.header].view(torch.int64)) for b in every]
        payloads = [b[self.header:self.header + n] for b, n in zip(every, sizes)]
        longest = max(sizes)
        if longest > self.capacity:  # someone's payload did not fit: everyone sends theirs again, whole
            whole = torch.zeros(longest, dtype=torch.uint8)
            whole[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            payloads = [b[:n] for b, n in zip(self._all_gather(whole), sizes)]
        self.capacity = -(-longest // 1024) * 1024  # the next gather's buffer: this one's largest, in KiB
        return [pickle.loads(p.numpy().tobytes()) for p in payloads]

    def _all_gather(self, buf: torch.Tensor) -> list[torch.Tensor]:
        every = [torch.empty_like(buf) for _ in range(self.ctx.world)]
        dist.all_gather(every, buf, group=self.group)
        self.rounds += 1
        return every
