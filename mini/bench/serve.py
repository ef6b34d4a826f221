"""tiny-goodput: a fixed random serving workload against an OpenAI-compatible server, streamed.

The workload (request count, prompt / output lengths, Poisson arrival rate, seed) is drawn once from `--seed`, so
every run and every revision sends exactly the same requests. Prompts are random token ids sent as `prompt:
[ids]`, so their lengths are exact. Per request: TTFT (send -> first streamed token), latency, output tokens
(from the usage chunk), TPOT = (latency - TTFT) / (output tokens - 1), and the gaps between streamed chunks (ITL;
the server streams one chunk per token, text or not).
Goodput counts the requests per second that meet both `--slo-ttft-ms` and `--slo-tpot-ms`.

Without `--url` the suite starts `mini serve` in a subprocess (so the client does not share the server's
interpreter) and stops it afterwards. `--repeat N` runs the workload N times back to back on the same server,
the first burst with nothing sent before it but GET /health (the client warms its own HTTP stack,
`serving_load.touch`): the metrics are the median of the bursts after the first (the warm server; with N = 1, the
first itself), and `first_*` metrics are the first burst's (a cold server: kernels that compile on first use show
there; `mini serve` warms up at start on CUDA). The per-run metrics are kept under "runs", their wall-clock spans
under "bursts" (to read the server's warm-up trace by: tools/goodput_cold_diag.py). The load generator itself is
mini/testing/serving_load.py.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
import sys
import time

from mini import switches
from mini.testing.serving_load import StartedServer, make_workload, run_once, summarize, touch

SUITE = "tiny-goodput"


def add_args(p: argparse.ArgumentParser) -> None:
    from mini.args import add_engine_args, add_model_args
    p.add_argument("--url", default=None, help="benchmark a running server (default: start `mini serve`)")
    add_model_args(p)  # of the started server; --model is also the vocab source
    add_engine_args(p, unset=True)  # forwarded to the started server when given
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -/+ ratio)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: burst)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for the started server")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _vocab_size(model: str) -> int:
    from mini.config import PRESETS, ModelConfig
    return PRESETS[model].vocab_size if model in PRESETS else ModelConfig.load(model).vocab_size


SPEC_COUNTERS = {"mini_spec_draft_tokens_total": "spec_draft_tokens", "mini_spec_accepted_tokens_total":
                 "spec_accepted_tokens", "mini_spec_acceptance_length_count": "spec_verified_drafts",
                 "mini_spec_plain_steps_total": "spec_plain_steps", "mini_overlapped_steps_total": "overlapped_steps"}


STEP_SERIES = re.compile(r'mini_(steps|step_seconds)_total\{kind="(\w+)"\}')


def spec_counters(url: str) -> dict[str, float]:
    """A mini server's overlapped steps, its steps and their host seconds by kind (steps_KIND, step_seconds_KIND,
    step_ms_KIND) and, where it speculates, its draft counters from /metrics, over all bursts (none from other
    servers), and the tokens each verified draft committed on average (its accepted drafts + the target's own
    token)."""
    import httpx
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] = float(value)
        elif m := STEP_SERIES.fullmatch(name):
            out[f"{m[1]}_{m[2]}"] = float(value)
    for key, n in list(out.items()):  # the mean host time of a step of each kind (step_ms_decode: plain decode's)
        if key.startswith("steps_") and n:
            kind = key.removeprefix("steps_")
            out[f"step_ms_{kind}"] = 1000 * out[f"step_seconds_{kind}"] / n
    if out.get("spec_verified_drafts"):
        out["spec_tokens_per_verify"] = 1 + out["spec_accepted_tokens"] / out["spec_verified_drafts"]
    return out


# ---------------------------------------------------------------------- the suite
FIRST_BURST = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "request_throughput", "goodput_req_s", "failed")


def warm_and_first(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median of the bursts after the first (all of them if there is one), the first burst's main metrics
    as first_*, and the first burst's TTFT p50 over the warm one (cold start cost; 1.0: none)."""
    warm = runs[1:] or runs
    metrics = {k: statistics.median(r[k] for r in warm) for k in runs[0]}
    metrics.update({f"first_{k}": runs[0][k] for k in FIRST_BURST})
    metrics["first_ttft_p50_over_warm"] = runs[0]["ttft_p50_ms"] / metrics["ttft_p50_ms"] \
        if metrics["ttft_p50_ms"] > 0 else 0.0
    return metrics


def _table(metrics: dict[str, float]) -> str:
    rows = [("requests completed / failed", f"{metrics['completed']:.0f} / {metrics['failed']:.0f}"),
            ("request throughput (req/s)", f"{metrics['request_throughput']:.3f}"),
            ("output throughput (tok/s)", f"{metrics['output_tok_s']:.1f}"),
            ("total throughput (tok/s)", f"{metrics['total_tok_s']:.1f}"),
            ("TTFT p50 / p99 (ms)", f"{metrics['ttft_p50_ms']:.1f} / {metrics['ttft_p99_ms']:.1f}"),
            ("TPOT p50 / p99 (ms)", f"{metrics['tpot_p50_ms']:.2f} / {metrics['tpot_p99_ms']:.2f}"),
            ("ITL p99 (ms)", f"{metrics['itl_p99_ms']:.2f}"),
            ("goodput (req/s within SLO)", f"{metrics['goodput_req_s']:.3f}"),
            ("first burst: TTFT p50 / p99 (ms)", f"{metrics['first_ttft_p50_ms']:.1f} / "
                                                 f"{metrics['first_ttft_p99_ms']:.1f}"),
            ("first burst: goodput (req/s)", f"{metrics['first_goodput_req_s']:.3f}"),
            ("first burst TTFT p50 / warm", f"{metrics['first_ttft_p50_over_warm']:.2f}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:{width}s}  {v}" for k, v in rows)


def run(args) -> dict:
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1 or args.repeat < 1:
        raise ValueError("num-requests, input-len, output-len and repeat must be >= 1")
    workload = make_workload(args, _vocab_size(args.model))
    model_name = args.served_model_name or args.model
    definition = {
        "model": args.model, "dtype": args.dtype, "device": args.device or ("cuda" if _cuda() else "cpu"),
        "backend": args.backend or switches.current().backend or "default",
        "server": args.url or "mini serve", "num_blocks": args.num_blocks, "block_tokens": args.block_tokens,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefix_caching": args.enable_prefix_caching is not False, "enforce_eager": bool(args.enforce_eager),
        "speculative": args.speculative, "spec_tokens": args.spec_tokens,
        "num_requests": args.num_requests,
        "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "seed": args.seed, "ignore_eos": args.ignore_eos,
        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "repeat": args.repeat,
        "metrics_of": "bursts after the first; first_*: the first burst, nothing sent before it but GET /health "
                      "(the client's own warm-up)",
    }

    bursts: list[tuple[float, float]] = []  # wall-clock start and end of each run: tools/goodput_cold_diag.py
    spec: dict[str, float] = {}

    def bench(url: str) -> list[dict[str, float]]:
        runs = []
        asyncio.run(touch(url))
        for _ in range(args.repeat):
            start = time.time()
            results, duration = asyncio.run(run_once(url, model_name, workload, args))
            bursts.append((start, time.time()))
            runs.append(summarize(results, duration, args))
            errors = {r.error for r in results if not r.ok}
            if errors:
                print(f"tiny-goodput: {len(results) - runs[-1]['completed']:.0f} requests failed: "
                      f"{sorted(errors)[:3]}", file=sys.stderr)
        spec.update(spec_counters(url))
        return runs

    if args.url:
        runs = bench(args.url.rstrip("/"))
    else:
        with StartedServer(args) as url:
            runs = bench(url)
    metrics = warm_and_first(runs) | spec
    print(_table(metrics))
    return {"suite": SUITE, "definition": definition, "metrics": metrics, "runs": runs, "bursts": bursts}
