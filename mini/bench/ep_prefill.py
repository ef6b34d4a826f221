"""`ep-prefill`: lock-step prefill steps of real EP ranks (DP attention, `mini.parallel.exchange.MoEExchange`).

Every rank draws the model with its own 1/N of the routed experts (`random_state(..., experts=expert_range(...))`,
same seed everywhere, so the shared weights agree), runs `--tokens` new tokens of its own per step, and meets the
other ranks in every MoE layer (all-gather of FP8 rows -> local experts -> fp32 reduce-scatter). `--layers L`
keeps all the preset's widths but uses L layers with every V4.1 layer kind: the 8-layer schedule of tiny-v4.1
(window, Engram, ratio-2 KV + index source, its consumer, ratio-1 KV + candidate source, reindex source, ...)
followed by L - 8 consumers of the last source. Memory per rank at EP2, measured on an H200 at 4,096 tokens:
37.5 GiB peak at 8 layers and 128.5 GiB at 32 (+3.8 GiB per further layer, 3.5 of them weights): 40 layers
would need ~159 GiB, and ~33 are the most that fit one H200 (139.8 GiB). Run large ones with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: without it the build (draw every expert, then restack them one
tensor at a time) left 15-29 GiB of cached but unusable blocks and ran out of memory at 30 and at 34 layers. At
EP4 `--layers 0` is the real model (~half the experts per layer).

Metrics (from rank 0): the step time is the slowest rank's of each step (a barrier starts every step), mean /
median over `--steps` after `--warmup`; tok/s/GPU = tokens per rank / mean step; peak memory (max over ranks;
GPU: allocated, and what the caching allocator reserved; CPU: peak RSS); then `--profile-steps` more steps with
every stage timed (its named range, `mini.testing.stage_times`), rank 0's ms/step per stage. `communication`
is the EXPOSED communication: the time inside the collectives' calls and their `wait()`s (the step's token-count
all-gather, each MoE layer's all-gathers and reduce-scatters, all issued asynchronously). On the GPU these are CUDA
events on the compute stream around each call and wait, so a collective that finished under the experts or the
shared expert costs ~0 there and one that did not costs the time the compute stream stalled for it; on the CPU
(gloo) the wall time blocked in them. `stage.exposed_fraction` = (communication + exchange_glue) / step, the share
issue 18 targets at <= 5%. Communication hidden under compute still slows that compute (NCCL's kernels take
SMs), which shows in the compute stages and the step, not here. `exchange_glue` is the rest of the MoE exchange:
with the eager glue (MINI_EP_GLUE=eager) the FP8 pack / unpack, padding and the final add; with the fused glue
(the default) the act-quant kernel's pack into the send buffer and the final rounding, its decode and
shared-expert add being parts of the routed experts' gather and combine (stages routed.act_quant and
routed.combine). `raw.exchange_glue` is the choice (the fused glue serves the fast path on bf16 activations;
elsewhere the eager one runs). A collective's time includes waiting for the slowest rank to arrive, so uneven
ranks show up as communication.

`tools/ep_prefill_overlap.py` runs this suite as an A/B of the exchange's micro-batch counts (MINI_EP_OVERLAP).

    # 2 H200s (one command; the JSON is written by rank 0)
    torchrun --nproc-per-node 2 -m mini bench ep-prefill --layers 8 --json ep-prefill.json
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nproc-per-node 2 -m mini bench ep-prefill --layers 32
    torchrun --nproc-per-node 4 -m mini bench ep-prefill --layers 0 --json ep-prefill-ep4.json   # all 40 layers
    # the same with local processes, or on the CPU at tiny size (gloo)
    python -m mini bench ep-prefill --nproc 2 --layers 8
    python -m mini bench ep-prefill --nproc 2 --preset tiny-v4.1 --tokens 64 --device cpu --dtype float32
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mini.config import ModelConfig
from mini.parallel import exchange as exchange_mod
from mini.parallel.groups import DistContext
from mini.testing.rank_model import layer_config
from mini.testing.stage_times import exchange_report, staged_with_exchange
from mini.testing.suites import SuiteError, run_on_ranks


def add_args(p) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to start (default 2); under torchrun each process is one rank")
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--layers", type=int, default=8, help="layers (>= 8, every layer kind kept); 0: the preset's")
    p.add_argument("--tokens", type=int, default=4096, help="new tokens of each rank per step")
    p.add_argument("--seqs", type=int, default=1, help="sequences each rank's tokens are split into")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=2, help="steps timed by stage (after the plain ones)")
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--engram-rows", type=int, default=1 << 20)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)


# ---------------------------------------------------------------------------------------------------- model
@dataclass
class EPRank:
    """One rank's model, exchange, batch and cache; `step()` runs one forward (counts exchange included)."""
    model: object
    exchange: exchange_mod.MoEExchange
    batch: object
    cache: object

    def step(self) -> torch.Tensor:
        self.exchange.begin_step(self.batch.n_tokens)
        return self.model.forward(self.batch, self.cache)


def build(ctx: DistContext, cfg: ModelConfig, args, tokens: list[list[int]]) -> EPRank:
    """The rank's model (its experts only) over a prefill batch of `tokens` (one list per sequence)."""
    from mini.testing.rank_model import prefill_batch, rank_model
    from mini.checkpoint import expert_range
    dtype = getattr(torch, args.dtype)
    ex = exchange_mod.MoEExchange(ctx)
    model = rank_model(cfg, ctx.device, dtype, args.seed, expert_range(cfg, ctx.rank, ctx.world), args.engram_rows, ex)
    batch, cache = prefill_batch(cfg, tokens, ctx.device, dtype, args.block_tokens, args.engram_rows)
    return EPRank(model, ex, batch, cache)


def rank_tokens(cfg: ModelConfig, args, rank: int) -> list[list[int]]:
    """Rank `rank`'s prompts: `args.seqs` sequences of `args.tokens / args.seqs` random ids (its own seed)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    per_seq = args.tokens // args.seqs
    return [torch.randint(3, cfg.vocab_size, (per_seq,), generator=g).tolist() for _ in range(args.seqs)]


# ---------------------------------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lockstep(r: EPRank, device: torch.device, steps: int) -> list[float]:
    """ms of each of `steps` steps on this rank, each started by a barrier (all ranks together)."""
    out = []
    for _ in range(steps):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        r.step()
        _sync(device)
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def slowest(ctx: DistContext, values: list[float]) -> list[float]:
    """Element-wise max over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_reserved_gb(device: torch.device) -> float:
    """What the caching allocator held at most (allocated + its free blocks): the memory the run really needed."""
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0


def device_mem_gb(device: torch.device) -> float:
    return torch.cuda.get_device_properties(device).total_memory / 2**30


def setup(ctx: DistContext, args) -> tuple[EPRank, ModelConfig, float]:
    """The rank built (its model, exchange, batch, cache), its config and the build's seconds."""
    if not ctx.multi:
        raise SuiteError("ep-prefill needs at least 2 ranks (torchrun --nproc-per-node N, or --nproc N)")
    import mini.ops
    if ctx.device.type == "cuda":
        mini.ops.set_backend("fast")
        torch.cuda.reset_peak_memory_stats(ctx.device)
    cfg = layer_config(args.preset, args.layers)
    t0 = time.perf_counter()
    r = build(ctx, cfg, args, rank_tokens(cfg, args, ctx.rank))
    return r, cfg, time.perf_counter() - t0


def profiled(r: EPRank, ctx: DistContext, args) -> dict[str, float]:
    """`--profile-steps` steps timed by stage: rank 0's ms/step per stage (exchange_report)."""
    with staged_with_exchange(ctx.device.type == "cuda") as timer:
        timed = lockstep(r, ctx.device, args.profile_steps)
        totals = timer.totals()
    return exchange_report(totals, statistics.mean(timed), len(timed))


def setting_metrics(args, steps: list[float], stages: dict[str, float]) -> dict[str, float]:
    """One setting's step times (slowest rank per step), tok/s/GPU and stages."""
    mean = statistics.mean(steps)
    tokens = args.tokens // args.seqs * args.seqs
    return {"mean_step_ms": mean, "median_step_ms": statistics.median(steps), "min_step_ms": min(steps),
            "max_step_ms": max(steps), "tok_per_s_per_gpu": tokens / (mean / 1e3),
            **{f"stage.{k}" + ("" if k.endswith("_fraction") else "_ms"): v for k, v in stages.items()}}


def result(ctx: DistContext, args, cfg: ModelConfig, r: EPRank, setup_s: float, settings: list[int],
           steps: list[float], stages: dict[str, float]) -> dict:
    """The suite's JSON: the metrics of `steps` / `stages` (the first of `settings`, the micro-batch counts run),
    memory and setup (max over ranks: a collective, every rank calls it)."""
    cuda = ctx.device.type == "cuda"
    mem, reserved, setup_s = slowest(ctx, [peak_mem_gb(ctx.device), peak_reserved_gb(ctx.device), setup_s])
    metrics = {**setting_metrics(args, steps, stages), "peak_mem_gb": mem,
               **({"peak_reserved_gb": reserved, "device_mem_gb": device_mem_gb(ctx.device)} if cuda else {}),
               "setup_s": setup_s}
    definition = {"preset": args.preset, "layers": cfg.n_layers, "ranks": ctx.world, "tokens_per_rank": args.tokens,
                  "seqs": args.seqs, "dtype": args.dtype, "block_tokens": args.block_tokens,
                  "engram_rows": args.engram_rows, "seed": args.seed, "backend": ctx.backend,
                  "device": torch.cuda.get_device_name(ctx.device) if cuda else "cpu",
                  "steps": args.steps, "warmup": args.warmup, "profile_steps": args.profile_steps,
                  "micro_batches": settings}
    return {"suite": "ep-prefill", "definition": definition, "metrics": metrics,
            "raw": {"step_ms": steps, "exchange_glue": r.exchange.glue}}


def _rank(ctx: DistContext, args) -> dict:
    r, cfg, setup_s = setup(ctx, args)
    lockstep(r, ctx.device, args.warmup)
    steps = slowest(ctx, lockstep(r, ctx.device, args.steps))
    return result(ctx, args, cfg, r, setup_s, [r.exchange.micro_batches], steps, profiled(r, ctx, args))


def run(args) -> dict:
    return run_on_ranks("ep-prefill", _rank, args, min_ranks=2)
