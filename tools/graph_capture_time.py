"""The engine's start-up CUDA graph capture at real V4.1-Flash width (issue 28; docs/perf/042): every bucket the
engine's ModelRunner captures (mini.engine.cuda_graphs: batch sizes `buckets(max_num_seqs)`, widths 1 .. 1 + k
under speculation bounded by `--verify-rows`, spans `spans(max_model_len)`), on one emulated EP rank
(rank4-decode's model, random weights), one span at a time, the longest first (capture_all itself takes each
bucket's spans, longest first, before the next bucket; the same graphs):

    python3 tools/graph_capture_time.py [rank4-decode options] [--max-seqs 64] [--spec-tokens 5] [--json FILE]

Per span: `span_S.capture_s` (its graphs' capture, each with its eager warm-up forward), `span_S.graphs`; then the
total, the graph pool's memory (`reserved_gb_after - reserved_gb_before`) and one replay per span at B = max-seqs.
The drafter's own graphs (DSpark's write / propose) are not counted: they do not depend on the span.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import rank4_decode  # noqa: E402
from mini.testing.suites import SuiteError, run_as_script  # noqa: E402

SUITE = "graph-capture-time"


def add_args(p) -> None:
    rank4_decode.add_args(p)
    p.set_defaults(max_model_len=1 << 20, context="4096", batch="64")
    p.add_argument("--max-seqs", type=int, default=64, help="the engine's max_num_seqs (its default: 64)")
    p.add_argument("--spec-tokens", type=int, default=0, help="k: verify widths up to 1 + k (0: decode only)")
    p.add_argument("--verify-rows", type=int, default=384, help="the engine's spec_max_rows (its default: 384)")


def run(args) -> dict:
    import torch

    from mini.engine.cuda_graphs import buckets, spans
    if not args.device.startswith("cuda"):
        raise SuiteError(f"{SUITE}: capture needs CUDA; --device cuda")
    cfg, exchange, model, metrics = rank4_decode.build(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    width, context = 1 + args.spec_tokens, int(args.context.split(",")[0])
    extra = args.warmup + args.steps + width + 2
    run_ = rank4_decode.DecodeRun(model, cfg, exchange, args.max_seqs, context, extra, args.block_tokens, device,
                                  dtype, args.seed, width, args.max_model_len)
    graphs = run_.graphs
    graphs.sizes, graphs.widths = buckets(args.max_seqs), list(range(1, width + 1))
    graphs.verify_rows = args.verify_rows if args.spec_tokens else None
    all_spans = spans(args.max_model_len)
    torch.cuda.synchronize()
    metrics["reserved_gb_before"] = torch.cuda.memory_reserved() / 2**30
    total = 0.0
    for span in sorted(all_spans, reverse=True):
        graphs.spans = [span]
        before = len(graphs.graphs) + len(graphs.verify_graphs)
        t0 = time.perf_counter()
        graphs.capture_all()
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        total += took
        n_graphs = len(graphs.graphs) + len(graphs.verify_graphs) - before
        metrics |= {f"span_{span}.capture_s": took, f"span_{span}.graphs": n_graphs}
        print(f"{SUITE} span {span}: {n_graphs} graphs in {took:.1f} s ({took / max(n_graphs, 1) * 1e3:.0f} ms each)",
              flush=True)
    graphs.spans = sorted(all_spans)
    metrics["reserved_gb_after"] = torch.cuda.memory_reserved() / 2**30
    metrics["capture_s"] = total
    metrics["graphs"] = len(graphs.graphs) + len(graphs.verify_graphs)
    run_.width = 1  # decode steps from here: the fills feed one row a sequence
    for span in graphs.spans:  # the step at B = max-seqs per span: what a span's padding costs
        ms = rank4_decode.time_calls(lambda: graphs.replay(args.max_seqs, args.max_seqs, 1, span), args.steps, True,
                                     before=run_.fill)
        metrics[f"span_{span}.replay_ms"] = statistics.median(ms)
    print(f"{SUITE}: {metrics['graphs']} graphs in {total:.1f} s; reserved {metrics['reserved_gb_before']:.1f} -> "
          f"{metrics['reserved_gb_after']:.1f} GiB; replay ms by span "
          + ", ".join(f"{s}: {metrics[f'span_{s}.replay_ms']:.2f}" for s in graphs.spans), flush=True)
    definition = {"what": "the engine's start-up graph capture, every bucket, one emulated rank", "ep": args.ep,
                  "max_seqs": args.max_seqs, "spec_tokens": args.spec_tokens, "verify_rows": args.verify_rows,
                  "max_model_len": args.max_model_len, "spans": graphs.spans, "preset": args.preset,
                  "device": torch.cuda.get_device_name()}
    return {"suite": SUITE, "definition": definition, "metrics": metrics, "raw": {}}


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__name__, SUITE, "the engine's start-up graph capture", argv, "tools/graph_capture_time.py")


if __name__ == "__main__":
    raise SystemExit(main())
