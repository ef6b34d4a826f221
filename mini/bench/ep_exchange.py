"""`ep-exchange`: the communication of one EP MoE layer (`mini.parallel.exchange.MoEExchange.exchange`) on N local
ranks: NCCL on N GPUs, gloo on the CPU.

Each rank brings `--tokens` tokens; the experts and the shared expert are stand-ins that return ready fp32
buffers, so the time is packing (FP8 encode), the all-gather, unpacking (decode), the fp32 reduce-scatter and the
final add. The bare all-gather and reduce-scatter of the same byte counts are timed too, to separate the
collectives from the glue around them. Every timing is the slowest rank's, median over `--iters` after
`--warmup`. `exchange_ms` is the eager glue's exchange (`MoEExchange.exchange`), `exchange_fused_ms` the fused
one's (`exchange_wire`: its pack is the act-quant kernel; its decode and final add live in the experts' passes,
which the stand-ins leave out, so `glue_fused_ms` is the pack and the last rounding only).

The exchange's local work on one GPU (the glue, the cost of micro-batches): tools/ep_exchange_local.py.

    mini bench ep-exchange --ranks 2                      # V4.1-Flash: 4,096 tokens/rank, D 5120, top-6
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from mini.testing.suites import SuiteError
from mini.parallel.exchange import MoEExchange, all_gather, reduce_scatter
from mini.parallel.groups import DistContext
from mini.parallel.launch import spawn


def add_args(p) -> None:
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--dim", type=int, default=5120)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--experts", type=int, default=384, help="routed experts in all")
    p.add_argument("--block", type=int, default=32, help="FP8 activation block")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")


def _timed(ctx: DistContext, fn, iters: int, warmup: int) -> list[float]:
    """Seconds of each timed call of fn, measured from a common start (barrier) to this rank's finish."""
    out = []
    for i in range(warmup + iters):
        dist.barrier()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _rank(ctx: DistContext, args) -> dict[str, list[float]]:
    dev, n, d, k = ctx.device, args.tokens, args.dim, args.topk
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(ctx.rank)
    x = torch.randn(n, d, generator=g, device=dev).to(dtype)
    weights = torch.rand(n, k, generator=g, device=dev)
    ids = torch.randint(0, args.experts, (n, k), generator=g, device=dev)
    partial = torch.randn(ctx.world * n, d, generator=g, device=dev)  # the experts' stand-in output
    own = torch.randn(n, d, generator=g, device=dev)

    def stand_in(rows, *_):  # the experts' output: one fp32 row per gathered row (of one micro-batch under overlap)
        return partial[: rows.shape[0]]

    ex = MoEExchange(ctx)
    ex.begin_step(n)
    send, _ = ex.pack(x, weights, ids, args.block)
    recv = send.new_empty(ctx.world * n, send.shape[1])
    scattered = torch.empty(n, d, device=dev)
    fused = {}
    if dev.type == "cuda":  # the fused pack is a Triton kernel (on the CPU only under the interpreter)
        fused["exchange_fused"] = _timed(ctx, lambda: ex.exchange_wire(
            x, weights, ids, args.block, experts=stand_in, local=lambda: own), args.iters, args.warmup)
    return {
        **fused,
        "exchange": _timed(ctx, lambda: ex.exchange(x, weights, ids, args.block, experts=stand_in,
                                                    local=lambda: own), args.iters, args.warmup),
        "all_gather": _timed(ctx, lambda: all_gather(recv, send), args.iters, args.warmup),
        "reduce_scatter": _timed(ctx, lambda: reduce_scatter(scattered, partial), args.iters, args.warmup),
        "row_bytes": [float(send.shape[1])],
    }


def run(args) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < args.ranks:
        raise SuiteError(f"ep-exchange: {args.ranks} ranks need {args.ranks} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    per_rank = spawn(args.ranks, _rank, args, device=device)

    def slowest_ms(name: str) -> float:
        return 1e3 * statistics.median(max(r[name][i] for r in per_rank) for i in range(args.iters))

    ag_bytes = (args.ranks - 1) * args.tokens * per_rank[0]["row_bytes"][0]  # received by each rank
    rs_bytes = (args.ranks - 1) * args.tokens * args.dim * 4  # sent by each rank
    ms = {name: slowest_ms(name) for name in ("exchange", "all_gather", "reduce_scatter")}
    fused = {}
    if "exchange_fused" in per_rank[0]:
        f = slowest_ms("exchange_fused")
        fused = {"exchange_fused_ms": f, "glue_fused_ms": f - ms["all_gather"] - ms["reduce_scatter"]}
    return {
        "suite": "ep-exchange",
        "definition": {"ranks": args.ranks, "tokens_per_rank": args.tokens, "dim": args.dim, "topk": args.topk,
                       "experts": args.experts, "block": args.block, "device": device,
                       "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                       "iters": args.iters, "warmup": args.warmup},
        "metrics": {"exchange_ms": ms["exchange"], "all_gather_ms": ms["all_gather"],
                    "reduce_scatter_ms": ms["reduce_scatter"],
                    "all_gather_GBps": ag_bytes / ms["all_gather"] / 1e6,
                    "reduce_scatter_GBps": rs_bytes / ms["reduce_scatter"] / 1e6,
                    "glue_ms": ms["exchange"] - ms["all_gather"] - ms["reduce_scatter"], **fused},
    }
