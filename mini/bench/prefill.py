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

Metrics: mean / median step ms over `--steps` steady steps after `--warmup`, tok/s/GPU (own tokens / mean step),
peak memory, pairs per local expert (min / median / mean / max over the MoE layers' local experts, from the first
warm-up step), the raw step times. The backends that ran are recorded by `mini bench` under env.backends; a
library forced by its variable (MINI_MOE_GEMM=humming, MINI_SPARSE_ATTN=flashmla) that is missing here makes the
suite refuse to run (exit 2) before the model is built.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from mini.config import ModelConfig, preset

ROUTINGS = ("uniform", "skewed")  # --routing: the gate's expert ids, or RoutingSkew's


def add_args(p) -> None:
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--tokens", type=int, default=4096, help="new tokens of this rank per step")
    p.add_argument("--seqs", type=int, default=1, help="sequences the tokens are split into")
    p.add_argument("--ep", type=int, default=4, help="EP ranks emulated (this is rank 0)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--engram-rows", type=int, default=1 << 20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=ROUTINGS, default="uniform",
                   help="expert loads: the gate's (uniform) or RoutingSkew's (skewed: hot experts at 2.5x the mean)")


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
class Rank4:
    """Everything one step needs; `step()` runs one forward."""
    model: object
    config: ModelConfig
    batch: object
    cache: object
    exchange: EmulatedEP
    n_tokens: int
    built_gb: float | None = None  # GPU memory the built step holds (weights, caches, inputs)
    build_peak_gb: float | None = None  # the build's own peak (weights drawn, stacked, converted)

    def step(self) -> torch.Tensor:
        return self.model.forward(self.batch, self.cache)


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


def build(args) -> Rank4:
    from mini.checkpoint import expert_range
    cfg = preset(args.preset)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    experts = expert_range(cfg, 0, args.ep)
    exchange = EmulatedEP(args.ep, args.seed, args.routing, experts)
    model = rank_model(cfg, device, dtype, args.seed, experts, args.engram_rows, exchange)
    per_seq = args.tokens // args.seqs
    g = torch.Generator().manual_seed(args.seed)
    tokens = [torch.randint(3, cfg.vocab_size, (per_seq,), generator=g).tolist() for _ in range(args.seqs)]
    batch, cache = prefill_batch(cfg, tokens, device, dtype, args.block_tokens, args.engram_rows)
    return Rank4(model, cfg, batch, cache, exchange, per_seq * args.seqs)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(r: Rank4, steps: int) -> list[float]:
    """ms of each of `steps` forwards (CUDA events on the GPU, wall clock on the CPU)."""
    dev = r.batch.input_ids.device
    out = []
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
    return out


def definition(args) -> dict:
    """The workload. `routing` appears only when it is not the uniform default, so that a revision from before the
    option and one after it define the same uniform workload (tools/bench_rev.py compares definitions)."""
    d = {"preset": args.preset, "tokens": args.tokens, "seqs": args.seqs, "ep": args.ep, "dtype": args.dtype,
         "block_tokens": args.block_tokens, "engram_rows": args.engram_rows, "seed": args.seed,
         "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    return d if args.routing == "uniform" else {**d, "routing": args.routing}


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
    return {"suite": "rank4", "definition": definition(args), "metrics": metrics,
            "raw": {"step_ms": steps, "pairs_per_local_expert": {str(k): v for k, v in pairs.items()}}}


def record_pairs(r: Rank4) -> dict[int, list[int]]:
    """One step with the emulation recording: layer -> pairs per local expert. Refuses (SuiteError) when no MoE
    layer went through the emulation (the step would not be an EP rank's, whatever routing was asked). Every
    backend honours skewed routing: its ids replace the gate's before the experts, whatever kernels run them."""
    from mini.bench import SuiteError
    ex = r.exchange
    ex.recording, ex.pairs = True, {}
    try:
        r.step()
    finally:
        ex.recording = False
    pairs = {k: v.tolist() for k, v in sorted(ex.pairs.items())}
    if not pairs:
        raise SuiteError("rank4: no MoE layer ran through the EP emulation; the step is not an EP rank's")
    return pairs
