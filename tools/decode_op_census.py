"""Every kernel a decode or verify step launches, by the source line that launched it (issues 27/28: at B = 1 the
verify step's graph runs ~1,988 kernels, docs/perf/043, and each costs a few us in a replay however little it
reads; fusion needs to know which lines they come from). One emulated EP rank (rank 0 of --ep) steps eagerly under
a dispatch mode that counts each aten op that launches a kernel (views and allocations left out) and each Triton /
Gluon launch, each by its call site: the innermost mini/ line and the innermost mini/model or mini/ops line above
it. On CUDA the eager step's kernels are also counted by torch.profiler (what the census does not see: library
kernels launched outside torch's dispatch, ops of several kernels) and the graph replay's by name with their time,
so that each Triton site gets its kernel's us per launch; `--alone` replays each Triton launch of the step alone
(10 back to back) against its time in the graph: a kernel far slower in the step than alone has its code or its
operands fetched cold there (docs/perf/049: the index top-k, 95 us against 17.6, its unrolled code):

    python3 tools/decode_op_census.py [rank4-decode options: --ep 8 --shapes 1x4096] [--widths 6,1] [--json F]
    TRITON_INTERPRET=1 python tools/decode_op_census.py --device cpu --preset tiny-v4.1 --shapes 1x40 --rope-dim 32

(on the CPU the fast backend runs under Triton's interpreter: small presets only; tiny-v4.1's RoPE tail of 16 with
1x32 quant blocks sends the fused norm/RoPE/quant kernel to its torch fallback, V4.1-Flash's shapes take it: try
--rope-dim 32). A width 1 + k is a verify step of k drafts (on a preset with DSpark stages, as spec-decode builds it).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# ops that launch nothing on CUDA: views, metadata, allocation
NO_KERNEL = {"view", "_unsafe_view", "reshape", "select", "slice", "as_strided", "expand", "unsqueeze", "squeeze",
             "t", "permute", "transpose", "detach", "alias", "split", "split_with_sizes", "unbind", "chunk", "narrow",
             "_reshape_alias", "lift_fresh", "view_as_real", "view_as_complex", "unflatten", "flatten", "diagonal",
             "movedim", "expand_as", "view_as", "sym_size", "empty", "empty_like", "empty_strided", "new_empty",
             "new_empty_strided", "resolve_conj", "resolve_neg", "set_"}


class Census(TorchDispatchMode):
    """Counts the aten ops that launch a kernel and (`launch`, patched onto Triton) the Triton launches, each by
    (kind, name, site); torch ops inside Triton's own code (the interpreter's bookkeeping) are not the step's."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name in NO_KERNEL or _returns_input(name, args, out):
            return out
        stack = traceback.extract_stack(limit=40)
        if not any("/triton/" in f.filename for f in stack):
            self.sites["aten", name, _site(stack)] += 1
        return out

    def launch(self, name: str) -> None:
        self.sites["triton", name, _site(traceback.extract_stack(limit=40))] += 1

    def total(self, kind: str | None = None) -> int:
        return sum(n for (k, _, _), n in self.sites.items() if kind in (None, k))


def _site(stack) -> str:
    """The innermost line in mini/, and the innermost in mini/model or mini/ops above it when that is another."""
    mine = [f for f in reversed(stack) if "/mini/" in f.filename and "/tools/" not in f.filename]
    if not mine:
        return "?"
    inner = mine[0]
    caller = next((f for f in mine if "/mini/model/" in f.filename or "/mini/ops/" in f.filename), inner)
    where = f"{inner.filename.split('/mini/')[-1]}:{inner.lineno} {(inner.line or '').strip()[:60]}"
    return where if caller is inner else f"{where}  <- {caller.filename.split('/mini/')[-1]}:{caller.lineno}"


def _returns_input(name: str, args: tuple, out) -> bool:
    """A .to / .contiguous that was already so returns its input and launches nothing."""
    return (name in ("to", "contiguous") and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor)
            and out.data_ptr() == args[0].data_ptr())


class counting_launches:
    """Within: every `kernel[grid](...)` (Triton's KernelInterface: JIT, Gluon, autotuned, interpreted) is reported
    to `census.launch` with the kernel's name before it runs; with `record`, each launch is also kept there as (name,
    a call that launches it again with the same arguments)."""

    def __init__(self, census: Census, record: list | None = None):
        self.census, self.record = census, record

    def __enter__(self):
        from triton.runtime.jit import KernelInterface
        self.original = original = KernelInterface.__getitem__
        census, record = self.census, self.record

        def getitem(kernel, grid):
            launch = original(kernel, grid)
            name = getattr(getattr(kernel, "fn", kernel), "__name__", type(kernel).__name__)

            def counted(*args, **kwargs):
                census.launch(name)
                if record is not None:
                    record.append((name, lambda: launch(*args, **kwargs)))
                return launch(*args, **kwargs)
            return counted
        KernelInterface.__getitem__ = getitem
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import KernelInterface
        KernelInterface.__getitem__ = self.original


def alone_us(launches: list, cuda: bool, repeats: int = 10) -> dict[str, tuple[float, int]]:
    """Per Triton kernel: (us a launch, launches) when each of the step's launches is replayed alone, `repeats` times
    back to back after one warm call (on the GPU in one CUDA graph, as the step runs it): its code and small operands
    then stay in the caches, as in a micro-benchmark. Run after the step's figures: the replays overwrite the step's
    outputs."""
    from mini.testing.suites import timed_call
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for name, again in launches:
        again()
        if cuda:  # the repeats in one CUDA graph: timed from the host, a small kernel's time is its launch's
            # (docs/perf/050: 16-62 us "alone" against 1-34 in the step, every Triton kernel)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(repeats):
                    again()
            graph.replay()
            _, ms = timed_call(graph.replay, cuda)
            del graph
        else:
            _, ms = timed_call(lambda: [again() for _ in range(repeats)], cuda)
        total[name] += 1e3 * ms / repeats
        count[name] += 1
    return {name: (total[name] / count[name], count[name]) for name in count}


def by_caller(census: Census, us_per_launch: dict[str, float]) -> list[tuple[str, int, float]]:
    """(caller line, kernels, us of its Triton launches at their graph-replay time) per mini/model or mini/ops line,
    most kernels first: fusion's worklist."""
    kernels: collections.Counter[str] = collections.Counter()
    us: dict[str, float] = collections.defaultdict(float)
    for (kind, name, site), n in census.sites.items():
        caller = site.split("  <- ")[-1].split(" ")[0]
        kernels[caller] += n
        if kind == "triton":
            us[caller] += n * us_per_launch.get(name, 0.0)
    return [(c, n, us[c]) for c, n in kernels.most_common()]


def census(model, cfg, exchange, args, B: int, C: int, width: int) -> dict:
    """One eager step of B sequences x `width` rows at context C under the census (after two warm-up steps); on
    CUDA also the profiler's count of that step's kernels, the graph replay's kernels with their time, and the
    replay's own time (`graph_step_ms`)."""
    from mini.bench import rank4_decode
    cuda = args.device.startswith("cuda")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    run = rank4_decode.DecodeRun(model, cfg, exchange, B, C, 24, args.block_tokens, device, dtype, args.seed, width,
                                 args.max_model_len)
    for _ in range(2):  # warm-up: compilation and first-call work (lazy buffers) are not a step's
        run.fill()
        run.eager()
    run.fill()
    counts, launches = Census(), [] if args.alone else None
    with counting_launches(counts, launches), counts:
        run.eager()
    n = len(cfg.layers)
    out: dict = {"batch": B, "context": C, "width": width, "layers": n, "census_kernels": counts.total(),
                 "census_triton": counts.total("triton"), "census_aten": counts.total("aten")}
    us_per_launch: dict[str, float] = {}
    if cuda:
        from rank4_decode_floor import kernel_split
        run.fill()
        eager_parts, eager_kernels = kernel_split(run.eager, 1)
        run.capture()
        run.fill()
        run.replay()
        run.fill()
        graph_parts, graph_kernels = kernel_split(run.replay, 2)
        out["graph_step_ms"] = statistics.median(rank4_decode.time_calls(run.replay, 10, cuda, before=run.fill))
        us_per_launch = {name: 1e3 * ms / calls for name, ms, calls in graph_kernels if calls}
        out |= {"eager_kernels": eager_parts.get("launches.total", 0),
                "graph_kernels": graph_parts.get("launches.total", 0), "graph_kernel_ms": graph_parts.get("total", 0),
                "graph_kernels_ms_launches": graph_kernels, "eager_kernels_ms_launches": eager_kernels}
    if launches:
        alone = alone_us(launches, cuda)
        # per kernel: us a launch in the step's graph against alone; the step's extra us (launches x the gap)
        rows = [(name, us_per_launch.get(name, float("nan")), a, calls) for name, (a, calls) in alone.items()]
        out["in_step_vs_alone"] = sorted(rows, key=lambda r: -((r[1] - r[2]) * r[3] if r[1] == r[1] else 0))
    del run, launches
    if cuda:
        torch.cuda.empty_cache()
    callers = by_caller(counts, us_per_launch)
    out["sites"] = [[kind, name, site, count] for (kind, name, site), count in counts.sites.most_common()]
    out["callers"] = callers
    print(f"\n{args.preset} B={B} C={C} width={width} EP{args.ep} rank 0: {out['census_kernels']} kernels "
          f"counted per step ({out['census_triton']} Triton, {out['census_aten']} aten), "
          f"{out['census_kernels'] / n:.1f} per layer ({n} layers)"
          + (f"; the profiler: {out['eager_kernels']:.0f} in the eager step, {out['graph_kernels']:.0f} in the graph "
             f"replay ({out['graph_kernel_ms']:.2f} ms of kernels; the replay {out['graph_step_ms']:.2f} ms, median of "
             "10)" if cuda else ""))
    print("by caller (mini/model or mini/ops line): kernels, per layer, us of its Triton kernels (graph replay)")
    for caller, count, us in callers[:args.top]:
        print(f"{count:6d} {count / n:6.1f}/layer {us:8.1f} us  {caller}")
    if out.get("in_step_vs_alone"):
        print("Triton kernels in the step's graph against the same launches replayed alone (us a launch), most extra "
              "time a step first:")
        for name, step_us, a, count in out["in_step_vs_alone"][:args.top]:
            print(f"{count:6d} launches {step_us:8.2f} in step {a:8.2f} alone {step_us / a:6.2f}x  {name}")
    print("by site: kind, kernel or op, count")
    for (kind, name, site), count in counts.sites.most_common(args.top):
        us = f"{count * us_per_launch[name]:8.1f} us" if name in us_per_launch else " " * 11
        print(f"{count:6d} {count / n:6.1f}/layer {us} {kind:6s} {name[:34]:34s} {site}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from mini.bench import rank4_decode
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rank4_decode.add_args(p)
    p.set_defaults(shapes="1x4096", profile_steps=0)
    p.add_argument("--widths", default="", help="comma-separated rows per sequence, each a census of every shape "
                   "(default: --width)")
    p.add_argument("--rope-dim", type=int, default=None, help="the preset with this RoPE tail (see above)")
    p.add_argument("--top", type=int, default=60, help="sites printed")
    p.add_argument("--json", default="", help="write every site, caller and (CUDA) kernel here")
    p.add_argument("--alone", action="store_true", help="also replay each Triton launch of the step alone, as a "
                   "micro-benchmark would (code and small operands warm), against its time in the step's graph")
    args = p.parse_args(argv)
    import mini.ops
    from mini.bench.spec_decode import dspark_config
    from mini.config import preset
    widths = rank4_decode.int_list(args.widths, "widths") if args.widths else [args.width]
    cfg = preset(args.preset)
    if max(widths) > 1 and cfg.is_v41 and not cfg.has_dspark:
        try:  # as spec-decode builds it: the verify step also gathers the draft module's target features
            cfg = dspark_config(args.preset)
        except ValueError as e:
            print(f"{args.preset}: no DSpark stages ({e}): a verify step without the draft's target features")
    if args.rope_dim is not None:
        cfg = cfg.replace(rope_head_dim=args.rope_dim, index_head_dim=max(cfg.index_head_dim, 2 * args.rope_dim))
    if not args.device.startswith("cuda"):
        mini.ops.set_backend("fast", interpret_on_cpu=True)  # needs TRITON_INTERPRET=1 (it says so)
    cfg, exchange, model, _ = rank4_decode.build(args, cfg)
    out = {"preset": args.preset, "ep": args.ep, "device": rank4_decode.definition(args, [], [])["device"],
           "steps": {}}
    for width in widths:
        for B, C in rank4_decode.shape_list(args):
            out["steps"][f"b{B}_c{C}_w{width}"] = census(model, cfg, exchange, args, B, C, width)
            if args.json:  # as each finishes: a run cut by its time limit keeps what it counted
                Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
