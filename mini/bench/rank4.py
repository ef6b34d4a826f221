"""`rank4`: one prefill step of one EP4/DP4 rank at real V4.1-Flash shape, on one GPU (shared/perf/README.md).

All 40 layers with random weights drawn on the device (`mini.checkpoint.random_state`, this rank's 96 of 384
experts; Engram tables capped to `--engram-rows` rows, hash ids taken modulo the rows). Attention runs over the
rank's own `--tokens` new tokens (`--seqs` sequences prefilled from position 0). The MoE is emulated as EP would
run it, communication left out (`EmulatedEP`, mini/testing/emulated_ep.py); `--routing` keeps the gate's expert ids
(uniform) or draws them with a trained router's load shape (skewed, `RoutingSkew`).

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
the modes define the same workload. tools/rank4_modes.py measures several modes on one build.

Metrics: mean / median step ms over `--steps` steady steps after `--warmup`, tok/s/GPU (own tokens / mean step),
peak memory, pairs per local expert (min / median / mean / max over the MoE layers' local experts, from the first
warm-up step), the raw step times. The backends that ran are recorded by `mini bench` under env.backends; a
library forced by its variable (MINI_MOE_GEMM=humming, MINI_SPARSE_ATTN=flashmla) that is missing here makes the
suite refuse to run (exit 2) before the model is built.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mini.config import preset
from mini.testing.emulated_ep import ROUTINGS, EmulatedEP
from mini.testing.rank_model import (check_backends, host_engram_tables, host_memory_available, prefill_batch,
                                     rank_model)
from mini.testing.rank_step import FreshSteps, Rank4, pending_engram, step_host_metrics, sync, time_steps
from mini.testing.suites import SuiteError

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


def build(args) -> Rank4:
    r = build_rank(args)
    configure(r, args)
    return r


def build_rank(args) -> Rank4:
    """The model, the cache and step 0's prompts; the Engram tables of `args.engram` (host: page-locked, with their
    prefetcher). The step's input is `configure`'s."""
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
        batch.engram = pending_engram(prefetcher, r.host_ids)
    r.batch, r.stats, r.wall_ms = batch, [], []
    return r


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
    sync(dev)
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


def record_pairs(r: Rank4) -> dict[int, list[int]]:
    """One step with the emulation recording: layer -> pairs per local expert. Refuses (SuiteError) when no MoE
    layer went through the emulation (the step would not be an EP rank's, whatever routing was asked). Every
    backend honours skewed routing: its ids replace the gate's before the experts, whatever kernels run them."""
    return r.exchange.record(r.step, "rank4")
