"""One emulated EP rank's prefill steps as a server would run them, for rank4 (mini/bench/rank4.py), `mini profile`
and the tools that time its stages: `Rank4` holds the built step and runs one forward, then prepares the next step's
input while the GPU works (`FreshSteps`: new prompts of the same lengths, built and laid out on a side stream; or
the same batch with its Engram rows looked up again from host tables); `time_steps` times steps; the host-side
figures of each step (`StepStats`) summed up by `step_host_metrics`.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from mini.config import ModelConfig
from mini.testing.emulated_ep import EmulatedEP
from mini.testing.rank_model import hasher_of


@dataclass
class StepStats:
    """Host-side figures of one step: the build of the next step's batch (fresh steps) and the Engram lookup of this
    one (host tables)."""
    build_ms: float | None = None  # host time building the next step's batch, inside this step
    forward_host_ms: float | None = None  # host time until the forward returned (~ the step when it syncs inside)
    engram: object = None  # the step's PendingEngramRows (host tables)


@dataclass
class Rank4:
    """Everything one step needs; `step()` runs one forward, then prepares the next step's input while the GPU works:
    a fresh batch (`fresh`), or the same batch with a new Engram lookup started (host tables)."""
    model: object
    config: ModelConfig
    batch: object
    cache: object
    exchange: EmulatedEP
    n_tokens: int
    built_gb: float | None = None  # GPU memory the built step holds (weights, caches, inputs)
    build_peak_gb: float | None = None  # the build's own peak (weights drawn, stacked, converted)
    fresh: "FreshSteps | None" = None
    prefetcher: object = None  # mini.model.engram_host.EngramPrefetcher (host tables)
    host_ids: torch.Tensor | None = None  # the reused batch's hash ids on the host (host tables, reused batch)
    engram_setup: dict = field(default_factory=dict)  # the host tables' size and setup seconds
    tokens: list[list[int]] = field(default_factory=list)  # step 0's prompts (a reused batch's)
    tables: dict = field(default_factory=dict)  # Engram placement -> (rows, [(values, scales) per layer])
    host_prefetcher: object = None  # the host tables' prefetcher, whether this workload uses it or not
    stats: list[StepStats] = field(default_factory=list)  # one per step run
    wall_ms: list[float] = field(default_factory=list)  # time_steps: wall clock from each step's end to the next's
    _in_flight: object = None  # the batch of the step just launched (its side-stream tensors stay alive)

    def step(self) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.fresh is not None:
            self.fresh.begin(self.batch)
        out = self.model.forward(self.batch, self.cache)
        eng = self.batch.engram
        st = StepStats(engram=eng.data if eng is not None and eng.form == "pending" else None,
                       forward_host_ms=1e3 * (time.perf_counter() - t0))
        self._in_flight = self.batch
        t0 = time.perf_counter()
        if self.fresh is not None:
            self.batch = self.fresh.next()
            st.build_ms = 1e3 * (time.perf_counter() - t0)
        elif self.prefetcher is not None:  # the same rows again, but looked up again, as a new step's would be
            self.batch = dataclasses.replace(self.batch, engram=pending_engram(self.prefetcher, self.host_ids))
        self.stats.append(st)
        return out


def pending_engram(prefetcher, host_ids: torch.Tensor):
    from mini.model import EngramInput
    return EngramInput("pending", prefetcher.start(host_ids))


class FreshSteps:
    """Each step's input built anew, as a server builds it: new random prompts of the same lengths, their Batch
    (hash ids on the host), copied to the device without blocking, its index layout built on a side stream (its
    nonzero syncs wait for the copies, not for the previous step's kernels), the Engram lookup started (host tables)
    or the hash ids copied (device tables). `next()` runs right after the previous step is launched, so this host work
    overlaps that step's GPU work; `begin(batch)` makes the compute stream wait for the side stream's work."""

    def __init__(self, cfg: ModelConfig, lengths: list[int], device, block_tokens: int, engram_rows: int | None,
                 prefetcher, seed: int):
        self.cfg, self.lengths, self.device = cfg, lengths, torch.device(device)
        self.block_tokens, self.engram_rows, self.prefetcher = block_tokens, engram_rows, prefetcher
        self.hasher = hasher_of(cfg)
        self.gen = torch.Generator().manual_seed(seed + 1)  # step 0 is build()'s prompts (seed), then these
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def prompts(self) -> list[list[int]]:
        return [torch.randint(3, self.cfg.vocab_size, (n,), generator=self.gen).tolist() for n in self.lengths]

    def next(self, tokens: list[list[int]] | None = None):
        """The Batch of the next step (of `tokens`, or fresh prompts), its layout built."""
        from mini.model.batch import SeqChunk, Batch
        tokens = self.prompts() if tokens is None else tokens
        nb = -(-max(len(t) for t in tokens) // self.block_tokens)
        chunks = [SeqChunk(t, 0, i, list(range(i * nb, (i + 1) * nb))) for i, t in enumerate(tokens)]
        host = Batch.build(chunks, self.cfg, "cpu", self.hasher)
        if not self.cuda:
            batch = dataclasses.replace(host, _layouts={})
        else:
            with torch.cuda.stream(self.stream):
                moved = {f.name: _to_device(getattr(host, f.name), self.device) for f in dataclasses.fields(host)
                         if isinstance(getattr(host, f.name), torch.Tensor)}
                batch = dataclasses.replace(host, _layouts={}, **moved)
        if host.engram is not None:
            ids = host.engram.data % self.engram_rows if self.engram_rows else host.engram.data
            if self.prefetcher is not None:
                batch.engram = pending_engram(self.prefetcher, ids)
            else:
                from mini.model import EngramInput
                with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
                    batch.engram = EngramInput("ids", _to_device(ids, self.device))
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            batch.layout(self.block_tokens, self.cfg.window_size)
        return batch

    def begin(self, batch) -> None:
        """Before `batch`'s forward: the compute stream waits for the side stream, and the side stream's tensors
        of the batch and its layout are marked as used by the compute stream (freed only after its work)."""
        if not self.cuda:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(self.stream)
        for obj in (batch, *batch._layouts.values()):
            for v in vars(obj).values():
                if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                    v.record_stream(main)
        if batch.engram is not None and isinstance(batch.engram.data, torch.Tensor):
            batch.engram.data.record_stream(main)


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor copied to `device` without blocking the host (through pinned memory)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(r: Rank4, steps: int) -> list[float]:
    """ms of each of `steps` forwards (CUDA events on the GPU, wall clock on the CPU). A step includes the host work
    of preparing the next one (`Rank4.step`): where that outlasts the GPU work, the difference shows. The wall
    clock from one step's end to the next's goes to `r.wall_ms`."""
    dev = r.batch.input_ids.device
    out = []
    sync(dev)
    last = time.perf_counter()
    for _ in range(steps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            r.step()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            r.step()
            out.append(1e3 * (time.perf_counter() - t0))
        now = time.perf_counter()
        r.wall_ms.append(1e3 * (now - last))
        last = now
    return out


def step_host_metrics(stats: list[StepStats], raw: dict) -> dict:
    """Median / max over the timed steps of the host time until the forward returned (`forward_host_ms`: close to
    the step when the forward waits on the GPU inside, and then the next step's build cannot hide behind it), of the
    host build of the next step (fresh steps) and of the Engram lookup (host tables): `engram_gather_ms` (the
    thread pool's gather), `engram_host_wait_ms` (the forward's thread waiting for its rows to be queued),
    `engram_gpu_wait_ms` (the compute stream stalled for their copy, CUDA events), `engram_wait_ms` = the two waits:
    an upper bound of the visible Engram cost. Per step lists go to `raw`."""
    series = {"host_build_ms": [s.build_ms for s in stats if s.build_ms is not None],
              "forward_host_ms": [s.forward_host_ms for s in stats if s.forward_host_ms is not None]}
    pending = [s.engram for s in stats if s.engram is not None]
    if pending:
        series["engram_gather_ms"] = [p.gather_ms for p in pending]
        series["engram_host_wait_ms"] = [p.host_wait_ms for p in pending]
        gpu = [p.gpu_wait_ms() for p in pending]
        if all(g is not None for g in gpu):
            series["engram_gpu_wait_ms"] = gpu
        series["engram_wait_ms"] = [h + (g or 0.0) for h, g in zip(series["engram_host_wait_ms"], gpu)]
    out = {}
    for k, v in series.items():
        if v:
            raw[k] = v
            out[f"{k}_median"], out[f"{k}_max"] = statistics.median(v), max(v)
    return out
