"""The EP exchange's local work on one GPU, no collectives (issue 18 items 2-3; docs/parallel.md, phases `ep_glue`
and `ep_overlap_gpu` of scripts/gpu.sh): `--glue` or `--parts`, at the shapes of `mini bench ep-exchange` (its
options), reported as it reports (suite `ep-exchange`, `definition.mode` glue / parts).

`--glue`: one process on one GPU, no collectives: the exchange's local work per MoE layer at `--ranks` ranks, with
the other ranks' received rows emulated (drawn and packed here) and the reduce-scatter left out (this rank's rows
of its own partial sums stand for the result). Each piece is timed alone (median of `--iters` after `--warmup`,
CUDA events), for the eager glue and the fused one:
* eager: pack (encode_fp8 + byte rows), unpack (split + decode_fp8 + ids/weights), the experts' gather + act
  quant (`fp8_act_quant(rows=)`, what Humming's path runs), the combine (fp32 partials), the final add + rounding;
* fused: pack (`fp8_act_quant_wire`: codes, scales, ids, weights into the send buffer), unpack (views), the
  experts' gather + decode (`fp8_act_quant(FP8Rows, rows=)`), the combine with the shared expert added, the final
  rounding.
`glue_*_ms` is what the one-device MoE does not run: eager pack + unpack + add; fused pack + unpack + rounding + what
its gather and combine take beyond the eager ones. Each piece is timed alone (its host launch time included:
`glue_*_ms`, `eager.*_ms`, `fused.*_ms`) and, on a GPU, as GPU time only (10 calls captured in a CUDA graph and
replayed: `glue_*_gpu_ms`, `gpu.*_ms`; the eager unpack cannot be captured and keeps its alone time), what a
forward pays when the host runs ahead of the GPU. The route plan and the stand-in expert outputs (random bf16
rows in place of the GEMMs) are the same for both and untimed. The outputs are checked bit for bit: the wire bytes,
the GEMM input rows and the final bf16 rows of the two glues must be identical (`identical` 1).

    python3 tools/ep_exchange_local.py --glue --ranks 4               # one GPU: the glue at EP4 row counts
    python3 tools/ep_exchange_local.py --parts 1,2,4 --ranks 2        # one GPU: the overlap's compute side at EP2

`--parts 1,2,4`: one process on one GPU, no collectives: what splitting the exchange into micro-batches
(MINI_EP_OVERLAP, mini/parallel/exchange.py) costs the compute it is meant to hide under. This rank's routed experts
(random MXFP4 at the preset's shape, E / `--ranks` of them; Humming where it loads) over the gathered wire rows of
`--ranks` ranks (drawn and packed here), in one piece and in N parts as the exchange cuts them (each part its own
buffer, the whole layer's tile hint), every part enqueued back to back and timed together (CUDA events: GPU time,
and the host's where it cannot keep ahead): `parts<N>_routed_ms`, `parts<N>_overhead` (vs 1 part) and
`parts<N>_identical` (every partial-sum row equals the one-piece one, bit for bit). `shared_ms`: the shared expert
on one rank's tokens, the window the first all-gather hides under.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import ep_exchange  # noqa: E402
from mini.parallel.exchange import MoEExchange  # noqa: E402
from mini.parallel.groups import DistContext  # noqa: E402
from mini.testing.suites import SuiteError, run_as_script  # noqa: E402


def add_args(p) -> None:
    ep_exchange.add_args(p)
    p.add_argument("--glue", action="store_true",
                   help="one process, no collectives: time the exchange's local work, eager vs fused glue")
    p.add_argument("--parts", default=None, metavar="N,N,...",
                   help="one process, no collectives: time this rank's routed experts over the gathered rows in one "
                        "piece and in these micro-batch counts (e.g. 1,2,4)")
    p.add_argument("--preset", default="v4.1-flash", help="--parts: the expert shapes (dim, inter, experts, top-k)")


def run(args) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.glue == bool(args.parts):
        raise SuiteError("ep_exchange_local: pass --glue or --parts (the exchange itself: mini bench ep-exchange)")
    return run_glue(args, device) if args.glue else run_parts(args, device)


# ------------------------------------------------------------------------------------------ --glue: one device
def _timer(device: torch.device):
    """fn -> seconds of one call (CUDA events on a GPU)."""
    if device.type != "cuda":
        def cpu(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return cpu

    def gpu(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return gpu


def _median_ms(timer, fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return 1e3 * statistics.median(timer(fn) for _ in range(iters))


def _graph_ms(timer, fn, iters: int, reps: int = 10) -> float:
    """GPU time of one call of fn: `reps` calls captured in a CUDA graph, replayed `iters` times (median / reps).
    Without the host's launch time, which the alone timing includes and a busy stream hides in a forward."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, lazy inits)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    return 1e3 * statistics.median(timer(graph.replay) for _ in range(iters)) / reps


def _rank_rows(g: torch.Generator, n: int, d: int, k: int, n_experts: int, dtype, dev):
    """One rank's MoE input and routing: a wide dynamic range per row, k distinct experts per token."""
    x = (torch.randn(n, d, generator=g, device=dev) * torch.logspace(-3, 2, n, device=dev)[:, None]).to(dtype)
    ids = torch.rand(n, n_experts, generator=g, device=dev).topk(k, dim=1).indices
    return x, torch.rand(n, k, generator=g, device=dev), ids


def run_glue(args, device: str) -> dict:
    """The --glue mode (see the module doc)."""
    import triton

    from mini.kernels.fp8_act_quant import FP8Rows, fp8_act_quant, fp8_act_quant_wire
    from mini.kernels.moe_combine import combine
    from mini.kernels.moe_route import plan_routes
    from mini.kernels.mxfp4_grouped_gemm import BLOCK_M
    from mini.parallel.exchange import WireRow

    dev = torch.device(device)
    if dev.type == "cpu" and not triton.knobs.runtime.interpret:
        raise SuiteError("ep-exchange --glue runs Triton kernels: on the CPU only with TRITON_INTERPRET=1")
    if dev.type == "cpu":  # the interpreter with the GPU's semantics (bf16 tiles, int1 masks), as every CPU test
        from mini.kernels.interpreter import patch_bf16
        patch_bf16()
    if args.experts % args.ranks:
        raise SuiteError(f"ep-exchange --glue: {args.experts} experts do not split over {args.ranks} ranks")
    n, d, k, block, world = args.tokens, args.dim, args.topk, args.block, args.ranks
    dtype = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    experts = range(0, args.experts // world)  # this rank (0) holds the first share; its rows come first
    ranks = [_rank_rows(g, n, d, k, args.experts, dtype, dev) for _ in range(world)]
    x, weights, ids = ranks[0]
    own_bf16 = torch.randn(n, d, generator=g, device=dev).to(dtype)  # the shared expert (the fused glue's form)
    own = own_bf16.float()  # the eager glue's: the same values in fp32

    ex = MoEExchange(DistContext(0, world, dev, None))
    ex.set_counts([n] * world)
    row = WireRow(k, d, block)
    eager_sends = [ex.pack(*r, block) for r in ranks]
    widths = eager_sends[0][1]
    recv_eager = torch.cat([s for s, _ in eager_sends])

    def pack_fused(r, send):
        ids_out, weights_out, codes, scales = row.fields(send)
        fp8_act_quant_wire(r[0], block, codes, scales, r[2], r[1], ids_out, weights_out)
        return send

    recv_fused = torch.cat([pack_fused(r, torch.empty(n, row.width, dtype=torch.uint8, device=dev)) for r in ranks])
    send_fused = torch.empty(n, row.width, dtype=torch.uint8, device=dev)
    used = 8 * k + d + d // block  # the bytes past it are padding (the fused pack leaves them unwritten)

    # eager: unpack -> x, weights, ids of all ranks; the route plan and stand-in expert outputs (untimed)
    xa, wa, ia = ex._unpack(recv_eager, widths, dtype, block)
    plan = plan_routes(ia, wa, experts, BLOCK_M, tiles=False)
    n_valid = plan.expert_offset[-1:]
    y = torch.randn(plan.n_rows, d, generator=g, device=dev).to(dtype)
    ids_w, weights_w, codes_w, scales_w = row.fields(recv_fused)
    rows_w = FP8Rows(codes_w, scales_w, block, dtype)
    plan_w = plan_routes(ids_w, weights_w, experts, BLOCK_M, tiles=False)

    out = {}
    steps = {
        "eager.pack": lambda: ex.pack(x, weights, ids, block),
        "eager.unpack": lambda: ex._unpack(recv_eager, widths, dtype, block),
        "eager.gather_quant": lambda: out.__setitem__("xs_eager", fp8_act_quant(xa, block, rows=plan.token,
                                                                                   n_valid=n_valid)),
        "eager.combine": lambda: out.__setitem__("partial_eager", combine(y, ia, plan.slot_row, experts,
                                                                          torch.float32)),
        "eager.final_add": lambda: out.__setitem__("y_eager", (out["partial_eager"][:n] + own).to(dtype)),
        "fused.pack": lambda: pack_fused(ranks[0], send_fused),
        "fused.unpack": lambda: FP8Rows(*row.fields(recv_fused)[2:], block, dtype),
        "fused.gather_decode": lambda: out.__setitem__("xs_fused", fp8_act_quant(rows_w, block, rows=plan_w.token,
                                                                                    n_valid=plan_w.expert_offset[-1:])),
        "fused.combine_add": lambda: out.__setitem__("partial_fused", combine(
            y, ids_w, plan_w.slot_row, experts, torch.float32, add=own_bf16, add_at=0)),
        "fused.final_round": lambda: out.__setitem__("y_fused", out["partial_fused"][:n].to(dtype)),
    }
    timer = _timer(dev)
    ms = {name: _median_ms(timer, fn, args.iters, args.warmup) for name, fn in steps.items()}
    m = int(plan.expert_offset[-1])
    identical = (torch.equal(recv_fused[:, :used], recv_eager[:, :used])
                 and torch.equal(plan_w.expert_offset, plan.expert_offset)
                 and torch.equal(plan_w.slot_row, plan.slot_row)
                 and torch.equal(out["xs_fused"][:m], out["xs_eager"][:m])
                 and torch.equal(out["y_fused"], out["y_eager"]))

    def glue(t: dict) -> tuple[float, float, dict, dict]:
        e = {p: t[f"eager.{p}"] for p in ("pack", "unpack", "gather_quant", "combine", "final_add")}
        f = {p: t[f"fused.{p}"] for p in ("pack", "unpack", "gather_decode", "combine_add", "final_round")}
        return (e["pack"] + e["unpack"] + e["final_add"],
                f["pack"] + f["unpack"] + f["final_round"] + (f["gather_decode"] - e["gather_quant"])
                + (f["combine_add"] - e["combine"]), e, f)

    glue_eager, glue_fused, e, f = glue(ms)
    gpu = {}
    if dev.type == "cuda":
        try:
            # decode_fp8's e8m0_to_float copies Python scalars to the device, which a capture refuses: the eager
            # unpack keeps its alone time (GPU-bound: 0.65 ms at EP2 on the H200, most of it decode)
            gpu_ms = {name: ms[name] if name == "eager.unpack" else _graph_ms(timer, fn, args.iters)
                      for name, fn in steps.items()}
            ge, gf, _, _ = glue(gpu_ms)
            gpu = {"glue_eager_gpu_ms": ge, "glue_fused_gpu_ms": gf,
                   **{f"gpu.{name}_ms": v for name, v in gpu_ms.items()}}
        except RuntimeError as err:  # a piece that cannot be captured: the alone timings stand
            print(f"ep-exchange --glue: no CUDA-graph timing ({err})")
            gpu = {"gpu_timing_failed": 1}
    return {
        "suite": "ep-exchange",
        "definition": {"mode": "glue", "ranks": world, "tokens_per_rank": n, "dim": d, "topk": k,
                       "experts": args.experts, "block": block, "device": device,
                       "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
                       "iters": args.iters, "warmup": args.warmup},
        "metrics": {"glue_eager_ms": glue_eager, "glue_fused_ms": glue_fused,
                    "glue_speedup": glue_eager / glue_fused if glue_fused > 0 else 0.0,
                    "local_eager_ms": sum(e.values()), "local_fused_ms": sum(f.values()),
                    **{f"{name}_ms": v for name, v in ms.items()},
                    "local_rows": m, "gathered_rows": world * n, "identical": int(identical), **gpu},
    }


# ------------------------------------------------------------------------------------------ --parts: one device
def run_parts(args, device: str) -> dict:
    """The --parts mode (see the module doc)."""
    import mini.ops
    from mini.testing.suites import timed_call
    from mini.bench.moe_layer import random_layer
    from mini.config import preset
    from mini.kernels.fp8_act_quant import FP8Rows, fp8_act_quant_wire
    from mini.ops.backends import moe_gemm
    from mini.ops.moe import routed_wire, shared
    from mini.parallel.exchange import WireRow, micro_batches

    try:
        counts_of_parts = sorted({int(v) for v in args.parts.split(",")} | {1})
    except ValueError:
        raise SuiteError(f"ep-exchange --parts takes micro-batch counts, e.g. 1,2,4; got {args.parts!r}") from None
    if min(counts_of_parts) < 1:
        raise SuiteError("ep-exchange --parts: micro-batch counts must be >= 1")
    dev = torch.device(device)
    if dev.type == "cuda":
        mini.ops.set_backend("fast")
    else:
        mini.ops.set_backend("fast", interpret_on_cpu=True)
    cfg = preset(args.preset)
    world, n, k, block = args.ranks, args.tokens, cfg.n_activated_experts, cfg.fp8_block
    if cfg.n_routed_experts % world:
        raise SuiteError(f"ep-exchange --parts: {cfg.n_routed_experts} experts do not split over {world} ranks")
    w = random_layer(cfg, cfg.n_routed_experts // world, dev, 0)  # this rank (0) holds the first share
    if dev.type == "cuda" and moe_gemm() == "humming":
        w.to_humming()
    g = torch.Generator(device=dev).manual_seed(1)
    row = WireRow(k, cfg.dim, block)
    recv = torch.empty(world, n, row.width, dtype=torch.uint8, device=dev)  # every rank's rows, as gathered
    for r in range(world):
        x, weights, ids = _rank_rows(g, n, cfg.dim, k, cfg.n_routed_experts, torch.bfloat16, dev)
        ids_out, weights_out, codes, scales = row.fields(recv[r])
        fp8_act_quant_wire(x, block, codes, scales, ids, weights, ids_out, weights_out)
        if r == 0:
            own = shared(x, w, x.dtype)  # rank 0's shared expert output, added in the combine
            shared_ms = _median_ms(_timer(dev), lambda: shared(x, w, x.dtype), args.iters, args.warmup)  # noqa: B023
    layer_pairs = world * n * k

    def part_buffers(m: int):
        """(part, its gathered rows [world * rows, width]) for m micro-batches: each part's own buffer."""
        return [(p, recv[:, p.rows(0)].reshape(world * p.counts[0], row.width))
                for p in micro_batches([n] * world, m)]

    def run(buffers):
        out = []
        for p, buf in buffers:
            ids_all, weights_all, codes, scales = row.fields(buf)
            out.append(routed_wire(FP8Rows(codes, scales, block, torch.bfloat16), w, weights_all, ids_all,
                                   own[p.rows(0)], 0, layer_pairs=layer_pairs))
        return out

    whole = run(part_buffers(1))[0].view(world, n, cfg.dim)
    ms, identical = {}, {}
    for m in counts_of_parts:
        buffers = part_buffers(m)
        pieces = run(buffers)
        identical[m] = all(torch.equal(y.view(world, p.counts[0], cfg.dim), whole[:, p.rows(0)])
                           for (p, _), y in zip(buffers, pieces))
        for _ in range(args.warmup):
            run(buffers)
        ms[m] = statistics.median(timed_call(lambda: run(buffers), dev.type == "cuda")[1]  # noqa: B023
                                  for _ in range(args.iters))
    metrics = {"shared_ms": shared_ms}
    for m in counts_of_parts:
        metrics.update({f"parts{m}_routed_ms": ms[m], f"parts{m}_overhead": ms[m] / ms[1] - 1.0,
                        f"parts{m}_identical": int(identical[m])})
    return {
        "suite": "ep-exchange",
        "definition": {"mode": "parts", "preset": args.preset, "ranks": world, "tokens_per_rank": n,
                       "dim": cfg.dim, "inter": cfg.moe_inter_dim, "topk": k, "experts": cfg.n_routed_experts,
                       "local_experts": len(w.experts), "parts": counts_of_parts, "device": device,
                       "gemm": "humming" if w.humming is not None else "triton",
                       "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
                       "iters": args.iters, "warmup": args.warmup},
        "metrics": metrics,
    }


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__name__, "ep-exchange", "the EP exchange's local work on one GPU", argv,
                         "tools/ep_exchange_local.py")


if __name__ == "__main__":
    raise SystemExit(main())
