"""`rank4`: one prefill step of one EP4/DP4 rank at real V4.1-Flash shape, on one GPU (shared/perf/README.md).

All 40 layers with random weights drawn on the device (`mini.checkpoint.random_state`, this rank's 96 of 384
experts; Engram tables capped to `--engram-rows` rows, hash ids taken modulo the rows). Attention runs over the
rank's own `--tokens` new tokens (`--seqs` sequences prefilled from position 0). The MoE is emulated as EP would
run it (`EmulatedEP`): the gate routes the rank's tokens plus (ep - 1) x as many synthetic remote tokens (its own
rows in fixed random orders, so the same distribution), the local experts process every pair routed to them, the
rank keeps its own rows and adds the shared expert. Communication is not run here (measured on 2 GPUs).

Metrics: mean / median step ms over `--steps` steady steps after `--warmup`, tok/s/GPU (own tokens / mean step),
peak memory, the raw step times.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from mini.config import ModelConfig, preset


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


class EmulatedEP:
    """`Model(moe_exchange=...)` for one EP rank on one device: the compute of gate + local experts over the
    tokens an all-gather would bring (own + synthetic remote), then the own rows (what the reduce-scatter would
    return) plus the shared expert."""

    def __init__(self, ep: int, seed: int):
        self.ep, self.seed = ep, seed
        self._orders: dict[tuple, torch.Tensor] = {}

    def remote_rows(self, n: int, device) -> torch.Tensor:
        """Row indices of the synthetic remote tokens: (ep - 1) fixed random orders of the own n rows."""
        key = (n, str(device))
        if key not in self._orders:
            g = torch.Generator().manual_seed(self.seed)
            orders = [torch.randperm(n, generator=g) for _ in range(self.ep - 1)]
            self._orders[key] = (torch.cat(orders) if orders else torch.zeros(0, dtype=torch.int64)).to(device)
        return self._orders[key]

    def __call__(self, x: torch.Tensor, w, cfg: ModelConfig, plan, input_ids: torch.Tensor) -> torch.Tensor:
        from mini.ops.moe import gate, routed, shared
        T = x.shape[0]
        rows = self.remote_rows(T, x.device)
        x_all, ids_all = torch.cat([x, x[rows]]), torch.cat([input_ids, input_ids[rows]])
        weights, ids = gate(x_all, w, cfg, plan, ids_all)
        y = routed(x_all, w, cfg, weights, ids)[:T]
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
    exchange = EmulatedEP(args.ep, args.seed)
    model = rank_model(cfg, device, dtype, args.seed, expert_range(cfg, 0, args.ep), args.engram_rows, exchange)
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
    return {"preset": args.preset, "tokens": args.tokens, "seqs": args.seqs, "ep": args.ep, "dtype": args.dtype,
            "block_tokens": args.block_tokens, "engram_rows": args.engram_rows, "seed": args.seed,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}


def setup(args) -> tuple[Rank4, float]:
    """The backend for the device, the built step, and the seconds the build took."""
    import mini.ops
    if args.device.startswith("cuda"):
        mini.ops.set_backend("fast")
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
    for _ in range(args.warmup):
        r.step()
    _sync(dev)
    steps = time_steps(r, args.steps)
    mean = statistics.mean(steps)
    metrics = {"mean_step_ms": mean, "median_step_ms": statistics.median(steps), "min_step_ms": min(steps),
               "max_step_ms": max(steps), "tok_per_s_per_gpu": r.n_tokens / (mean / 1e3), "setup_s": setup_s}
    if dev.type == "cuda":
        metrics["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30  # build and steps
        if r.built_gb is not None:
            metrics["built_mem_gb"], metrics["build_peak_mem_gb"] = r.built_gb, r.build_peak_gb
    return {"suite": "rank4", "definition": definition(args), "metrics": metrics, "raw": {"step_ms": steps}}
