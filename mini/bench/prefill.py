"""`rank4`: one prefill step of one EP4/DP4 rank at real V4.1-Flash shape, on one GPU (shared/perf/README.md).

All 40 layers with random weights drawn on the device (`mini.checkpoint.random_state`, this rank's 96 of 384
experts; Engram tables capped to `--engram-rows` rows, hash ids taken modulo the rows). Attention runs over the
rank's own `--tokens` new tokens (`--seqs` sequences prefilled from position 0). The MoE is emulated as EP would
run it (`EmulatedEP`): the gate routes the rank's own tokens (as in the real exchange, mini.parallel.exchange), the
(ep - 1) x as many synthetic remote tokens are the own rows in fixed random orders with their routing (so the same
distribution), the local experts process every pair of all those rows routed to them, the rank keeps its own rows
and adds the shared expert. Communication is not run here (measured on 2 GPUs).

Routing (`--routing`): "uniform" keeps the gate's choice (random weights spread the pairs evenly); "skewed"
replaces the expert ids after the gate by draws from `RoutingSkew` (hot experts at 2.5x the mean load, this rank
holding more than its even share of them), so the experts see the load shape of a trained router.

Modes (`--mode`, each part overridable by its own option):
* "uniform" (the default, the workload of earlier revisions): Engram tables of 2^20 rows in GPU memory
  (`--engram device`), one batch, index layout and set of row lists reused by every step (`--no-fresh-steps`), the
  gate's routing (`--routing uniform`).
* "realistic": what a real rank runs. Engram tables in page-locked host memory at real row width, layout and hashing,
  only the row count scaled down (`--engram host`, `HOST_ENGRAM_ROWS` = 96 x 2^20 of the real 384M rows per table:
  53.1 GB for the two tables), each step's rows gathered by a thread pool and copied on a side stream
  (`mini.model.engram_host`), started when the step is scheduled; a fresh batch every step (`--fresh-steps`: new
  random prompts of the same lengths, hashed, copied and laid out anew, built on the host while the previous step's
  GPU work runs, `FreshSteps`); skewed routing. The JSON reports the host build ms per step, the Engram gather ms,
  how long the forward's thread waited for the rows and how long the GPU stream stalled for their copy (CUDA
  events): the visible Engram cost.
The definition names every part that differs from the uniform default, so uniform runs of revisions before and after
the modes define the same workload.

Metrics: mean / median step ms over `--steps` steady steps after `--warmup`, tok/s/GPU (own tokens / mean step),
peak memory, pairs per local expert (min / median / mean / max over the MoE layers' local experts, from the first
warm-up step), the raw step times. The backends that ran are recorded by `mini bench` under env.backends; a
library forced by its variable (MINI_MOE_GEMM=humming, MINI_SPARSE_ATTN=flashmla) that is missing here makes the
suite refuse to run (exit 2) before the model is built.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from mini.config import ModelConfig, preset

ROUTINGS = ("uniform", "skewed")  # --routing: the gate's expert ids, or RoutingSkew's
MODES = {  # --mode: the defaults of --engram, --fresh-steps, --routing
    "uniform": {"engram": "device", "fresh_steps": False, "routing": "uniform"},
    "realistic": {"engram": "host", "fresh_steps": True, "routing": "skewed"},
}
DEVICE_ENGRAM_ROWS = 1 << 20  # rows per table of GPU-resident tables (the uniform mode's, as before the modes)
HOST_ENGRAM_ROWS = 96 << 20  # rows per host table: a quarter of the real 384M; 2 x 96M x 264 B = 53.1 GB pinned
HOST_MEMORY_MARGIN = 16 << 30  # bytes of host memory left free beyond the host tables


def add_args(p) -> None:
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--tokens", type=int, default=4096, help="new tokens of this rank per step")
    p.add_argument("--seqs", type=int, default=1, help="sequences the tokens are split into")
    p.add_argument("--ep", type=int, default=4, help="EP ranks emulated (this is rank 0)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--mode", choices=tuple(MODES), default="uniform",
                   help="uniform: GPU Engram tables, one reused batch, the gate's routing (as before the modes); "
                        "realistic: host Engram tables, a fresh batch every step, skewed routing")
    p.add_argument("--engram", choices=("device", "host"), default=None,
                   help="where the Engram tables are (default: the mode's)")
    p.add_argument("--engram-rows", type=int, default=None,
                   help=f"rows per Engram table (default {DEVICE_ENGRAM_ROWS} on the device, {HOST_ENGRAM_ROWS} "
                        "on the host)")
    p.add_argument("--engram-threads", type=int, default=8, help="threads gathering host Engram rows")
    p.add_argument("--fresh-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="a fresh batch, layout and row lists every step (default: the mode's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=ROUTINGS, default=None,
                   help="expert loads: the gate's (uniform) or RoutingSkew's (skewed: hot experts at 2.5x the mean); "
                        "default: the mode's")


def resolve(args):
    """Fill the options left to the mode (idempotent); returns args."""
    for k, v in MODES[args.mode].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.engram_rows is None:
        args.engram_rows = HOST_ENGRAM_ROWS if args.engram == "host" else DEVICE_ENGRAM_ROWS
    if args.engram_rows < 1 or args.engram_threads < 1:
        raise ValueError(f"--engram-rows {args.engram_rows}, --engram-threads {args.engram_threads}: each >= 1")
    return args


@dataclass(frozen=True)
class RoutingSkew:
    """The expert loads of `--routing skewed`, fixed and the same on every run: a two-level mixture. Per MoE layer,
    an eighth of the experts (48 of 384) are hot, each drawing `hot_load` (2.5) x the mean load per expert; the
    others share the rest evenly (0.786 x the mean at 384 experts). This rank holds `local_hot(ep)` of the hot ones
    (16 of 48 at EP4, its even share being 12: a little above the expected busiest of 4 ranks under a random
    placement, 12 +- 2.8 each, max of 4 ~ 15), so it gets (16 x 2.5 + 80 x 0.786) / 96 = 1.071 x the mean rank's
    pairs. Which experts are hot changes per layer (a generator seeded by (seed, layer)). Each row takes k distinct
    experts drawn with these probabilities (Gumbel top-k), so a hot expert's load is a little under 2.5 x the mean
    (2.46-2.51 per layer at V4.1-Flash's k = 6 of 384). At rank4's shape (16,384 rows x 6 pairs, mean 256 pairs
    per expert), seed 0, the realized max / mean per layer is 2.64-2.77 over the 40 layers (the hot experts'
    binomial spread), this rank's pairs per local expert min 154 / median 205 / mean 274 / max 709;
    tests/bench/test_prefill.py checks the shape (max / mean in [2.4, 3.0], hot mean / mean in [2.3, 2.6], this
    rank's share 1.04-1.10 x even)."""
    hot_fraction: float = 1 / 8
    hot_load: float = 2.5  # a hot expert's expected load / the mean load per expert

    def n_hot(self, n_experts: int) -> int:
        return max(1, round(n_experts * self.hot_fraction))

    def local_hot(self, n_experts: int, n_local: int, ep: int) -> int:
        """Hot experts among this rank's: 4/3 of an even share (at least one, at most all of either)."""
        return max(1, min(n_local, self.n_hot(n_experts), round(self.n_hot(n_experts) / ep * 4 / 3)))

    def probabilities(self, n_experts: int, local: range, ep: int, seed: int, layer: int) -> torch.Tensor:
        """fp64 [n_experts]: the probability that a pair goes to each expert, in one layer."""
        n_hot, n_local_hot = self.n_hot(n_experts), self.local_hot(n_experts, len(local), ep)
        g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
        mine = torch.tensor(list(local))
        others = torch.tensor([e for e in range(n_experts) if e not in local], dtype=torch.int64)
        hot = torch.cat([mine[torch.randperm(len(mine), generator=g)[:n_local_hot]],
                         others[torch.randperm(len(others), generator=g)[:n_hot - n_local_hot]]])
        cold_load = (n_experts - self.hot_load * n_hot) / (n_experts - n_hot)
        load = torch.full((n_experts,), cold_load, dtype=torch.float64)
        load[hot] = self.hot_load
        return load / n_experts

    def draw(self, rows: int, k: int, n_experts: int, local: range, ep: int, seed: int, layer: int) -> torch.Tensor:
        """int64 [rows, k]: k distinct experts per row, each row's draw independent (Gumbel top-k)."""
        p = self.probabilities(n_experts, local, ep, seed, layer)
        g = torch.Generator().manual_seed(seed * 1_000_003 + layer + 500_009)
        u = torch.rand(rows, n_experts, generator=g, dtype=torch.float64).clamp_min(1e-300)
        return (p.log() - (-u.log()).log()).topk(k, dim=-1).indices


SKEW = RoutingSkew()


class EmulatedEP:
    """`Model(moe_exchange=...)` for one EP rank on one device: the gate over the rank's own tokens, then the local
    experts over the tokens an all-gather would bring (own + synthetic remote, with their routing), then the own
    rows (what the reduce-scatter would return) plus the shared expert. `routing` "skewed" replaces the gate's
    expert ids by `SKEW`'s draws (fixed per layer and row count; the gate's weights are kept). While `recording`,
    each layer's pairs per local expert are kept in `pairs` (layer -> int64 [E_local], on the device)."""

    def __init__(self, ep: int, seed: int, routing: str = "uniform", experts: range | None = None):
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r}: choose one of {', '.join(ROUTINGS)}")
        self.ep, self.seed, self.routing, self.experts = ep, seed, routing, experts
        self._orders: dict[tuple, torch.Tensor] = {}
        self._skewed: dict[tuple, torch.Tensor] = {}
        self.recording = False
        self.pairs: dict[int, torch.Tensor] = {}

    def record(self, step, suite: str) -> dict[int, list[int]]:
        """Run `step()` with recording on: layer -> pairs per local expert. Refuses (SuiteError) when no MoE layer
        went through the emulation (the step would not be an EP rank's, whatever routing was asked)."""
        from mini.bench import SuiteError
        self.recording, self.pairs = True, {}
        try:
            step()
        finally:
            self.recording = False
        pairs = {k: v.tolist() for k, v in sorted(self.pairs.items())}
        if not pairs:
            raise SuiteError(f"{suite}: no MoE layer ran through the EP emulation; the step is not an EP rank's")
        return pairs

    def remote_rows(self, n: int, device) -> torch.Tensor:
        """Row indices of the synthetic remote tokens: (ep - 1) fixed random orders of the own n rows."""
        key = (n, str(device))
        if key not in self._orders:
            g = torch.Generator().manual_seed(self.seed)
            orders = [torch.randperm(n, generator=g) for _ in range(self.ep - 1)]
            self._orders[key] = (torch.cat(orders) if orders else torch.zeros(0, dtype=torch.int64)).to(device)
        return self._orders[key]

    def skewed_ids(self, rows: int, w, cfg: ModelConfig, layer: int, device) -> torch.Tensor:
        """The skewed routing's ids of `rows` rows in `layer` (drawn once, on the CPU)."""
        key = (rows, layer, str(device))
        if key not in self._skewed:
            local = w.experts if self.experts is None else self.experts
            self._skewed[key] = SKEW.draw(rows, cfg.n_activated_experts, cfg.n_routed_experts, local, self.ep,
                                          self.seed, layer).to(device)
        return self._skewed[key]

    def route(self, x: torch.Tensor, w, cfg: ModelConfig, plan, input_ids: torch.Tensor):
        """(x, weights, ids) of every row the local experts see: own rows first, then the remote ones."""
        from mini.ops.moe import gate
        rows = self.remote_rows(x.shape[0], x.device)
        weights, ids = gate(x, w, cfg, plan, input_ids)
        x_all, weights_all = torch.cat([x, x[rows]]), torch.cat([weights, weights[rows]])
        if self.routing == "skewed":
            ids_all = self.skewed_ids(x_all.shape[0], w, cfg, plan.layer, x.device)
        else:
            ids_all = torch.cat([ids, ids[rows]])
        return x_all, weights_all, ids_all

    def __call__(self, x: torch.Tensor, w, cfg: ModelConfig, plan, input_ids: torch.Tensor) -> torch.Tensor:
        from mini.ops.moe import routed, shared
        x_all, weights, ids = self.route(x, w, cfg, plan, input_ids)
        if self.recording:
            counts = torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts)
            self.pairs[plan.layer] = counts[w.experts.start:w.experts.stop]
        y = routed(x_all, w, cfg, weights, ids)[:x.shape[0]]
        return (y + shared(x, w)).to(x.dtype)


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
            self.batch = dataclasses.replace(self.batch, engram=_pending(self.prefetcher, self.host_ids))
        self.stats.append(st)
        return out


def _pending(prefetcher, host_ids: torch.Tensor):
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
                batch.engram = _pending(self.prefetcher, ids)
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


def host_engram_tables(cfg: ModelConfig, rows: int, seed: int, fill_device,
                       pin_tables: bool = True) -> tuple[list, dict]:
    """Per Engram layer, (fp8 values [rows, head_dim] as float8_e4m3fn, E8M0 scales [rows, head_dim / 32] as
    float8_e8m0fnu) in host memory, page-locked in place where CUDA is (mini.model.engram_host.pin), and what the
    setup took. The rows are drawn as `random_state` draws Engram rows (standard normal values, one power-of-two scale
    per 32 values of a row), on `fill_device` in chunks copied back: far faster than drawing 50 GB on the CPU."""
    from mini.formats import float_to_e8m0, pow2_ceil_scale
    from mini.formats.fp8 import FP8_MAX, to_e4m3
    from mini.model.engram_host import pin
    hd, block = cfg.engram_head_dim, 32
    fill_device = torch.device(fill_device)
    info = {"alloc_s": 0.0, "pin_s": 0.0, "fill_s": 0.0, "pinned": True}
    tables = []
    chunk = 1 << 21
    for j, _ in enumerate(cfg.engram_layer_ids):
        t0 = time.perf_counter()
        vals = torch.empty((rows, hd), dtype=torch.uint8)
        scales = torch.empty((rows, hd // block), dtype=torch.uint8)
        t1 = time.perf_counter()
        # filled while still pageable, page-locked after: on the H200 (36c16dc) the first device-to-host copy into
        # a table registered before the fill failed with 'CUDA error: invalid argument'
        g = torch.Generator(device=fill_device).manual_seed(seed * 7919 + j)
        for a in range(0, rows, chunk):
            x = torch.randn((min(rows, a + chunk) - a, hd // block, block), generator=g, device=fill_device)
            scale = pow2_ceil_scale(x.abs().amax(-1).clamp_min(1e-30) / FP8_MAX)
            vals[a:a + x.shape[0]].copy_(to_e4m3(x / scale.unsqueeze(-1)).flatten(-2).view(torch.uint8))
            scales[a:a + x.shape[0]].copy_(float_to_e8m0(scale).view(torch.uint8))
        if fill_device.type == "cuda":
            torch.cuda.synchronize(fill_device)
        t2 = time.perf_counter()
        info["pinned"] &= pin_tables and pin(vals) & pin(scales)
        t3 = time.perf_counter()
        info["alloc_s"] += t1 - t0
        info["fill_s"] += t2 - t1
        info["pin_s"] += t3 - t2
        tables.append((vals.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)))
    info["gb"] = sum(v.numel() + s.numel() for v, s in tables) / 1e9
    return tables, info


def host_memory_available() -> int | None:
    """Bytes of host memory available (Linux MemAvailable), or None where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def restack_experts(state: dict, cfg: ModelConfig, experts: range) -> dict:
    """Move each layer's routed-expert tensors into one [E_local, ...] buffer per tensor name, leaving views in
    `state` (returned). MoEWeights.from_state then uses the buffers as they are; without this the experts would
    exist twice while the model is built (2 x 72 GB at V4.1-Flash EP4). One tensor is copied at a time."""
    for i in range(cfg.n_layers):
        for proj in ("w1", "w3", "w2"):
            for leaf in ("weight", "scale"):
                names = [f"layers.{i}.ffn.experts.{e}.{proj}.{leaf}" for e in experts]
                first = state[names[0]]
                buf = torch.empty((len(names), *first.shape), dtype=first.dtype, device=first.device)
                for j, n in enumerate(names):
                    buf[j].copy_(state[n])
                    state[n] = buf[j]  # the drawn tensor is freed here
    return state


def hasher_of(cfg: ModelConfig):
    """An Engram hasher with a stand-in token map: any map onto the compressed vocabulary gives the same work (the
    real one needs the real tokenizer)."""
    if not cfg.engram_layer_ids:
        return None
    import numpy as np
    from mini.ops.engram import EngramHasher
    return EngramHasher(cfg, np.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size)


def rank_model(cfg: ModelConfig, device, dtype, seed: int, experts: range, engram_rows: int | None, moe_exchange):
    """A model with random weights drawn on `device`, holding only `experts` (one EP rank), stacked in place."""
    from mini.checkpoint import random_state
    from mini.model import Model
    state = restack_experts(random_state(cfg, device, seed, experts=experts, engram_rows=engram_rows), cfg, experts)
    # consumed: experts rewritten into new buffers (Humming's w1|w3 stack) free the old ones layer by layer, not
    # at the end of the build (40 layers x 1.2 GB)
    return Model(cfg, state, device, dtype, moe_exchange=moe_exchange, experts=experts, consume_state=True)


def prefill_batch(cfg: ModelConfig, tokens: list[list[int]], device, dtype, block_tokens: int,
                  engram_rows: int | None):
    """(Batch, KVCache) of one prefill step from position 0 over the sequences `tokens`, each in its own slot."""
    from mini.model import Batch, KVCache
    from mini.model.batch import SeqChunk
    nb = -(-max(len(t) for t in tokens) // block_tokens)
    chunks = [SeqChunk(t, 0, i, list(range(i * nb, (i + 1) * nb))) for i, t in enumerate(tokens)]
    batch = Batch.build(chunks, cfg, device, hasher_of(cfg))
    if batch.engram is not None and engram_rows:
        batch.engram.data = batch.engram.data % engram_rows  # hash ids -> the capped tables' rows
    return batch, KVCache(cfg, len(tokens), len(tokens) * nb, block_tokens, device, dtype)


def add_emulated_rank_args(p) -> None:
    """The flags of `emulated_rank`'s build beside --preset and --ep, for the suites built on it (rank4-decode,
    long-context)."""
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--engram-rows", type=int, default=1 << 20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=ROUTINGS, default="uniform")


def emulated_rank(args) -> tuple[ModelConfig, "EmulatedEP", object, float]:
    """The model of one emulated EP rank (rank 0 of `args.ep`) at `args.preset`, on the fast backend where CUDA is:
    (config, exchange, model, build seconds). The suites that decode or prefill through it build their own caches."""
    import mini.ops
    from mini.checkpoint import expert_range
    cfg = preset(args.preset)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        mini.ops.set_backend("fast")
    check_backends()
    t0 = time.perf_counter()
    experts = expert_range(cfg, 0, args.ep)
    exchange = EmulatedEP(args.ep, args.seed, args.routing, experts)
    model = rank_model(cfg, device, dtype, args.seed, experts, args.engram_rows, exchange)
    return cfg, exchange, model, time.perf_counter() - t0


def build(args) -> Rank4:
    r = build_rank(args)
    configure(r, args)
    return r


def build_rank(args) -> Rank4:
    """The model, the cache and step 0's prompts; the Engram tables of `args.engram` (host: page-locked, with their
    prefetcher). The step's input is `configure`'s."""
    from mini.bench import SuiteError
    from mini.checkpoint import expert_range
    resolve(args)
    cfg = preset(args.preset)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    experts = expert_range(cfg, 0, args.ep)
    exchange = EmulatedEP(args.ep, args.seed, args.routing, experts)
    host = args.engram == "host" and bool(cfg.engram_layer_ids)
    tables, engram_setup = None, {}
    if host:  # before the model: a refusal costs no build
        need = len(cfg.engram_layer_ids) * args.engram_rows * (cfg.engram_head_dim + cfg.engram_head_dim // 32)
        avail = host_memory_available()
        if avail is not None and need + HOST_MEMORY_MARGIN > avail:
            raise SuiteError(f"rank4: host Engram tables of {args.engram_rows} rows take {need / 1e9:.1f} GB, the "
                             f"host has {avail / 1e9:.1f} GB available (keeping {HOST_MEMORY_MARGIN / 2**30:.0f} GiB "
                             "free): pass a smaller --engram-rows")
        tables, engram_setup = host_engram_tables(cfg, args.engram_rows, args.seed, device)
    model = rank_model(cfg, device, dtype, args.seed, experts, 1 if host else args.engram_rows, exchange)
    weights = [blk.engram for blk in model.blocks if blk.engram is not None]
    per_seq = args.tokens // args.seqs
    g = torch.Generator().manual_seed(args.seed)
    tokens = [torch.randint(3, cfg.vocab_size, (per_seq,), generator=g).tolist() for _ in range(args.seqs)]
    _, cache = prefill_batch(cfg, tokens, device, dtype, args.block_tokens, args.engram_rows)
    r = Rank4(model, cfg, None, cache, exchange, per_seq * args.seqs, engram_setup=engram_setup, tokens=tokens)
    if weights:
        if host:
            from mini.model.engram_host import EngramPrefetcher
            r.tables["host"] = (args.engram_rows, tables)
            # the prefetcher checks that it reads host tables: swap them in first (the model was built on the
            # device with 1-row stand-ins; at 56388c4 this order failed on the H200 and only there)
            for w, (vals, scales) in zip(weights, tables):
                w.embed, w.embed_scale = vals, scales
            r.host_prefetcher = EngramPrefetcher(weights, device, threads=args.engram_threads)
        else:
            r.tables["device"] = (args.engram_rows, [(w.embed, w.embed_scale) for w in weights])
    return r


def configure(r: Rank4, args) -> Rank4:
    """Set `r` up for the workload `args` defines: the Engram tables of its placement (device tables of another
    row count are drawn here; host tables only at build), its routing, and step 0's input (`r.tokens`): a reused
    batch or fresh steps, with its Engram lookup started (host tables). Clears the step records."""
    from mini.bench import SuiteError
    resolve(args)
    cfg, device, dtype = r.config, r.model.device, getattr(torch, args.dtype)
    weights = [blk.engram for blk in r.model.blocks if blk.engram is not None]
    host = args.engram == "host" and bool(weights)
    if weights:
        if args.engram == "device" and r.tables.get("device", (None,))[0] != args.engram_rows:
            drawn, _ = host_engram_tables(cfg, args.engram_rows, args.seed, device, pin_tables=False)
            r.tables["device"] = (args.engram_rows, [(v.to(device), sc.to(device)) for v, sc in drawn])
        rows, tables = r.tables.get(args.engram, (None, None))
        if rows != args.engram_rows:
            raise SuiteError(f"rank4: this build holds no {args.engram} Engram tables of {args.engram_rows} rows")
        for w, (vals, scales) in zip(weights, tables):
            w.embed, w.embed_scale = vals, scales
        r.model.engram_on_device = not host
    if args.routing not in ROUTINGS:
        raise ValueError(f"routing {args.routing!r}: choose one of {', '.join(ROUTINGS)}")
    r.exchange.routing = args.routing
    prefetcher = r.host_prefetcher if host else None
    batch, _ = prefill_batch(cfg, r.tokens, device, dtype, args.block_tokens, args.engram_rows)
    r.prefetcher, r.fresh, r.host_ids = prefetcher, None, None
    if args.fresh_steps:
        r.fresh = FreshSteps(cfg, [len(t) for t in r.tokens], device, args.block_tokens, args.engram_rows, prefetcher,
                             args.seed)
        batch = r.fresh.next(r.tokens)  # step 0: the reused batch's prompts, built the fresh way
    elif host:
        r.host_ids = batch.engram.data.cpu()
        batch.engram = _pending(prefetcher, r.host_ids)
    r.batch, r.stats, r.wall_ms = batch, [], []
    return r


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(r: Rank4, steps: int) -> list[float]:
    """ms of each of `steps` forwards (CUDA events on the GPU, wall clock on the CPU). A step includes the host work
    of preparing the next one (`Rank4.step`): where that outlasts the GPU work, the difference shows. The wall
    clock from one step's end to the next's goes to `r.wall_ms`."""
    dev = r.batch.input_ids.device
    out = []
    _sync(dev)
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


def definition(args) -> dict:
    """The workload. What differs from the uniform mode's defaults (mode, routing, Engram placement, fresh steps)
    appears only then, so that a revision from before the options and one after them define the same uniform
    workload (tools/bench_rev.py compares definitions)."""
    resolve(args)
    d = {"preset": args.preset, "tokens": args.tokens, "seqs": args.seqs, "ep": args.ep, "dtype": args.dtype,
         "block_tokens": args.block_tokens, "engram_rows": args.engram_rows, "seed": args.seed,
         "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    if args.mode != "uniform":
        d["mode"] = args.mode
    for k, v in MODES["uniform"].items():
        if getattr(args, k) != v:
            d[k] = getattr(args, k)
    if args.engram == "host":
        d["engram_threads"] = args.engram_threads
        d["engram_rows_real"] = list(preset(args.preset).engram_num_embeddings)  # only the row count is scaled
    return d


def check_backends() -> None:
    """Resolve the library switches now, before the model is built: a library its variable forces
    (MINI_MOE_GEMM=humming, MINI_SPARSE_ATTN=flashmla) that cannot run here is a SuiteError naming what is missing
    (`mini bench` exits 2), not a run on other kernels under the same name."""
    from mini.bench import SuiteError
    from mini.ops import backends
    try:
        backends.resolve()
    except (RuntimeError, ValueError) as e:
        raise SuiteError(f"rank4: {e} ({_missing()})") from None


def _missing() -> str:
    """What the forced libraries lack here: the GPU generation, or the import's own error."""
    import importlib
    import os
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"the GPU is SM{''.join(map(str, torch.cuda.get_device_capability()))}, the libraries need SM90"
    out = []
    for env, module, wheel in (("MINI_MOE_GEMM", "humming", "humming_kernels"),
                               ("MINI_SPARSE_ATTN", "flash_mla", "sgl_flash_mla")):
        if os.environ.get(env, "auto").strip().lower() in ("humming", "flashmla"):
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - the reason is the message
                out.append(f"import {module}: {type(e).__name__}: {e}; carry the {wheel} wheel (.whl/gpu)")
    return "; ".join(out) or "see the message"


def setup(args) -> tuple[Rank4, float]:
    """The backend for the device, the built step, and the seconds the build took."""
    import mini.ops
    resolve(args)
    if args.device.startswith("cuda"):
        mini.ops.set_backend("fast")
    check_backends()
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    r = build(args)
    if args.device.startswith("cuda"):
        r.build_peak_gb = torch.cuda.max_memory_allocated() / 2**30
        r.built_gb = torch.cuda.memory_allocated() / 2**30
    return r, time.perf_counter() - t0


def run(args) -> dict:
    return measure(*setup(args), args)


def measure(r: Rank4, setup_s: float, args) -> dict:
    """The suite result: `args.warmup` steps, then `args.steps` timed ones."""
    dev = r.batch.input_ids.device
    pairs = record_pairs(r)  # the first warm-up step (an extra one without warm-up)
    for _ in range(args.warmup - 1):
        r.step()
    _sync(dev)
    r.wall_ms.clear()
    steps = time_steps(r, args.steps)
    mean = statistics.mean(steps)
    flat = sorted(n for layer in pairs.values() for n in layer)
    metrics = {"mean_step_ms": mean, "median_step_ms": statistics.median(steps), "min_step_ms": min(steps),
               "max_step_ms": max(steps), "tok_per_s_per_gpu": r.n_tokens / (mean / 1e3), "setup_s": setup_s,
               "pairs_per_local_expert_min": flat[0], "pairs_per_local_expert_median": statistics.median(flat),
               "pairs_per_local_expert_mean": statistics.mean(flat), "pairs_per_local_expert_max": flat[-1]}
    if dev.type == "cuda":
        metrics["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30  # build and steps
        if r.built_gb is not None:
            metrics["built_mem_gb"], metrics["build_peak_mem_gb"] = r.built_gb, r.build_peak_gb
    timed = r.stats[-len(steps):]
    raw = {"step_ms": steps, "wall_step_ms": list(r.wall_ms)}
    metrics["wall_step_ms_median"] = statistics.median(r.wall_ms)
    metrics.update(step_host_metrics(timed, raw))
    if args.engram == "host":
        metrics.update({f"engram_{k}": float(v) for k, v in r.engram_setup.items()})
    raw["pairs_per_local_expert"] = {str(k): v for k, v in pairs.items()}
    return {"suite": "rank4", "mode": args.mode, "definition": definition(args), "metrics": metrics, "raw": raw}


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


def record_pairs(r: Rank4) -> dict[int, list[int]]:
    """One step with the emulation recording: layer -> pairs per local expert. Refuses (SuiteError) when no MoE
    layer went through the emulation (the step would not be an EP rank's, whatever routing was asked). Every
    backend honours skewed routing: its ids replace the gate's before the experts, whatever kernels run them."""
    return r.exchange.record(r.step, "rank4")


SAME_BUILD_MODES = {  # main()'s workloads: name -> the rank4 options that define it
    "uniform": ["--mode", "uniform"],
    "realistic": ["--mode", "realistic"],
    "uniform_host": ["--mode", "uniform", "--engram", "host"],
}


def main(argv: list[str] | None = None) -> int:
    """`python3 -m mini.bench.prefill --modes uniform,realistic,uniform_host --out DIR [rank4 options]`: several
    rank4 workloads measured one after the other on ONE build (the model is drawn once: on the H200 the build is
    ~35 s of each process, the steps ~5 s), one rank4 result each in DIR/rank4_<name>.json, with `raw.same_build`
    naming the workloads built together. `--host-engram-rows` sets the host tables' rows (host workloads only)."""
    import json
    import sys
    from pathlib import Path
    from mini.bench import SuiteError, check_result, environment
    p = argparse.ArgumentParser(prog="python3 -m mini.bench.prefill", description=main.__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(SAME_BUILD_MODES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--host-engram-rows", type=int, default=None)
    own, common = p.parse_known_args(argv)
    names = own.modes.split(",")
    if not names or any(n not in SAME_BUILD_MODES for n in names):
        p.error(f"--modes {own.modes!r}: a comma-separated list of {', '.join(SAME_BUILD_MODES)}")
    rank4 = argparse.ArgumentParser(prog="rank4")
    add_args(rank4)

    def parse(name: str):
        extra = SAME_BUILD_MODES[name]
        args = resolve(rank4.parse_args(common + extra))
        if args.engram == "host" and own.host_engram_rows is not None:
            args.engram_rows = own.host_engram_rows
        return args

    modes = {n: parse(n) for n in names}
    base = next((a for a in modes.values() if a.engram == "host"), modes[names[0]])  # host tables only at build
    try:
        r, setup_s = setup(base)
        own.out.mkdir(parents=True, exist_ok=True)
        for name, args in modes.items():
            res = check_result("rank4", measure(configure(r, args), setup_s, args))
            res["raw"]["same_build"] = names
            (own.out / f"rank4_{name}.json").write_text(json.dumps({**res, "env": environment()}, indent=1) + "\n")
            m = res["metrics"]
            print(f"rank4 {name}: median {m['median_step_ms']:.2f} ms/step, engram_wait "
                  f"{m.get('engram_wait_ms_median', float('nan')):.3f} ms, host_build "
                  f"{m.get('host_build_ms_median', float('nan')):.2f} ms", flush=True)
    except SuiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
