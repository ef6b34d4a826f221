"""A serving load: a fixed random workload sent to an OpenAI-compatible server, streamed, and its per-request
timings summarised (the `tiny-goodput` suite, mini/bench/serve.py, runs it; tools/goodput_cold_diag.py too).

Per request: TTFT (send -> first streamed token), latency, output tokens (from the usage chunk), TPOT = (latency -
TTFT) / (output tokens - 1), and the gaps between streamed chunks (ITL; the server streams one chunk per token,
text or not). `StartedServer` runs `mini serve` in a subprocess, so the client does not share its interpreter.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch


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


async def send(client, url: str, model: str, req: Request, ignore_eos: bool) -> Result:
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


async def run_once(url: str, model: str, workload: list[Request], args) -> tuple[list[Result], float]:
    import httpx
    limit = asyncio.Semaphore(args.max_concurrency or len(workload))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(req: Request) -> Result:
            await asyncio.sleep(max(0.0, start + req.send_at - time.perf_counter()))
            async with limit:
                return await send(client, url, model, req, args.ignore_eos)
        results = await asyncio.gather(*(one(r) for r in workload))
    return list(results), time.perf_counter() - start


async def touch(url: str) -> None:
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


def percentile(values: list[float], q: float) -> float:
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
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
        "tpot_p50_ms": percentile(tpots, 50), "tpot_p99_ms": percentile(tpots, 99), "itl_p99_ms": percentile(itls, 99),
        "goodput_req_s": len(good) / duration,
    }


# ---------------------------------------------------------------------- server
class StartedServer:
    """`mini serve` in a subprocess on a free port."""

    def __init__(self, args):
        from mini.args import engine_argv
        from mini.parallel.launch import free_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "mini", "serve", "--model", args.model, "--port", str(self.port),
               "--dtype", args.dtype]
        on_cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
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
