"""tiny-goodput: a fixed random serving workload against an OpenAI-compatible server, streamed.

The workload (request count, prompt / output lengths, Poisson arrival rate, seed) is drawn once from `--seed`, so
every run and every revision sends exactly the same requests. Prompts are random token ids sent as `prompt:
[ids]`, so their lengths are exact. Per request: TTFT (send -> first streamed token), latency, output tokens
(from the usage chunk), TPOT = (latency - TTFT) / (output tokens - 1), and the gaps between streamed chunks (ITL;
the server streams one chunk per token, text or not).
Goodput counts the requests per second that meet both `--slo-ttft-ms` and `--slo-tpot-ms`.

Without `--url` the suite starts `mini serve` in a subprocess (so the client does not share the server's
interpreter) and stops it afterwards. `--repeat N` runs the workload N times back to back on the same server,
the first burst with nothing sent before it but GET /health (the client warms its own HTTP stack, `_touch`): the
metrics are the median of the bursts after the first (the warm server; with N = 1, the first itself), and
`first_*` metrics are the first burst's (a cold server: kernels that compile on first use show there; `mini serve`
warms up at start on CUDA). The per-run metrics are kept under "runs", their wall-clock spans under "bursts" (to
read the server's warm-up trace by: tools/goodput_cold_diag.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from mini import switches

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


# ---------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    send_at: float  # seconds after the start of the run


def make_workload(args, vocab_size: int) -> list[Request]:
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - args.range_ratio))), max(1, int(mean * (1 + args.range_ratio)))
        return rng.randint(lo, hi)

    reqs, t = [], 0.0
    for _ in range(args.num_requests):
        prompt = [rng.randrange(16, vocab_size) for _ in range(length(args.input_len))]
        reqs.append(Request(prompt, length(args.output_len), t))
        if math.isfinite(args.request_rate):
            t += rng.expovariate(args.request_rate)
    return reqs


# ---------------------------------------------------------------------- client
@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _send(client, url: str, model: str, req: Request, ignore_eos: bool) -> Result:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    res = Result(sent=time.perf_counter())
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # each carries one new token
                    if last is None:
                        res.ttft = now - res.sent
                    else:
                        res.itls.append(now - last)
                    last = now
        res.latency = (last or time.perf_counter()) - res.sent
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no output tokens"
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _run_once(url: str, model: str, workload: list[Request], args) -> tuple[list[Result], float]:
    import httpx
    limit = asyncio.Semaphore(args.max_concurrency or len(workload))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(req: Request) -> Result:
            await asyncio.sleep(max(0.0, start + req.send_at - time.perf_counter()))
            async with limit:
                return await _send(client, url, model, req, args.ignore_eos)
        results = await asyncio.gather(*(one(r) for r in workload))
    return list(results), time.perf_counter() - start


async def _touch(url: str) -> None:
    """This process's first use of its async HTTP stack (imports of the async connection pool: ~50 ms; streamed
    reads) on GET /health, which reaches no engine: the first burst then measures the server's cold start, not the
    client's."""
    import httpx
    async with httpx.AsyncClient(timeout=httpx.Timeout(30)) as client:
        async def one() -> None:
            async with client.stream("GET", url + "/health") as r:
                async for _ in r.aiter_lines():
                    pass
        await asyncio.gather(*(one() for _ in range(4)))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[Result], duration: float, args) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok]
    tpots = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    itls = [x * 1e3 for r in ok for x in r.itls]
    good = [r for r in ok if r.ttft * 1e3 <= args.slo_ttft_ms and (r.tpot is None or r.tpot * 1e3 <= args.slo_tpot_ms)]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_p50_ms": _pct(ttfts, 50), "ttft_p99_ms": _pct(ttfts, 99),
        "tpot_p50_ms": _pct(tpots, 50), "tpot_p99_ms": _pct(tpots, 99), "itl_p99_ms": _pct(itls, 99),
        "goodput_req_s": len(good) / duration,
    }


# ---------------------------------------------------------------------- server
class _StartedServer:
    """`mini serve` in a subprocess on a free port."""

    def __init__(self, args):
        from mini.args import engine_argv
        from mini.parallel.launch import free_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mini", "serve", "--model", args.model, "--port", str(self.port),
               "--dtype", args.dtype]
        on_cpu = (args.device or ("cuda" if _cuda() else "cpu")) == "cpu"
        if on_cpu and args.num_blocks is None:
            args = argparse.Namespace(**{**vars(args), "num_blocks": 512})
        for flag, value in (("--device", args.device), ("--backend", args.backend),
                            ("--served-model-name", args.served_model_name)):
            if value is not None:
                cmd += [flag, str(value)]
        cmd += engine_argv(args)
        self.cmd = cmd
        self.timeout = args.server_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        import httpx
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"the server did not answer /health within {self.timeout} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _vocab_size(model: str) -> int:
    from mini.config import PRESETS, ModelConfig
    return PRESETS[model].vocab_size if model in PRESETS else ModelConfig.load(model).vocab_size


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
        "num_requests": args.num_requests,
        "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "seed": args.seed, "ignore_eos": args.ignore_eos,
        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "repeat": args.repeat,
        "metrics_of": "bursts after the first; first_*: the first burst, nothing sent before it but GET /health "
                      "(the client's own warm-up)",
    }

    bursts: list[tuple[float, float]] = []  # wall-clock start and end of each run: tools/goodput_cold_diag.py

    def bench(url: str) -> list[dict[str, float]]:
        runs = []
        asyncio.run(_touch(url))
        for _ in range(args.repeat):
            start = time.time()
            results, duration = asyncio.run(_run_once(url, model_name, workload, args))
            bursts.append((start, time.time()))
            runs.append(summarize(results, duration, args))
            errors = {r.error for r in results if not r.ok}
            if errors:
                print(f"tiny-goodput: {len(results) - runs[-1]['completed']:.0f} requests failed: "
                      f"{sorted(errors)[:3]}", file=sys.stderr)
        return runs

    if args.url:
        runs = bench(args.url.rstrip("/"))
    else:
        with _StartedServer(args) as url:
            runs = bench(url)
    metrics = warm_and_first(runs)
    print(_table(metrics))
    return {"suite": SUITE, "definition": definition, "metrics": metrics, "runs": runs, "bursts": bursts}
