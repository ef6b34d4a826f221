"""Benchmark suites: `mini bench NAME [--json FILE] [suite options]`. Each suite is a module registered here by its
dotted path and imported only when asked for; the registry's machinery (the result shape, the JSON with the
environment, runs on several ranks) is mini/testing/suites.py, shared with `mini check`."""
from __future__ import annotations

from mini.testing.suites import Suite
from mini.testing.suites import main as _run_registry

SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("tiny-cpu", "mini.bench.tiny_cpu", "prefill + decode throughput of tiny-v4.1 on CPU (seconds)"),
    Suite("moe-layer", "mini.bench.moe_layer", "one MoE layer at real V4.1-Flash shape, one EP4 rank's experts"),
    Suite("rank4", "mini.bench.rank4", "prefill step of one EP4/DP4 rank at real V4.1-Flash shape"),
    Suite("tiny-goodput", "mini.bench.serve", "serving goodput of the tiny model: TTFT, TPOT, req/s"),
    Suite("ep-exchange", "mini.bench.ep_exchange", "EP MoE exchange communication on N local ranks (NCCL / gloo)"),
    Suite("kernels", "mini.bench.kernels", "attention-side kernel micro-benchmarks (H200)"),
    Suite("ep-prefill", "mini.bench.ep_prefill", "lock-step EP prefill steps on N ranks (torchrun or --nproc)"),
    Suite("ep-exact", "mini.check.ep_exact", "the check `mini check ep-exact`, kept under its old name"),
    Suite("decode-host", "mini.bench.decode_host", "host vs GPU share of a decode step, eager vs CUDA graphs"),
    Suite("rank4-decode", "mini.bench.rank4_decode", "decode of one EP4 rank at real V4.1-Flash shape vs its floor"),
    Suite("spec-decode", "mini.bench.spec_decode", "speculation (DSpark) vs plain decode, one EP4 rank, real width"),
    Suite("long-context", "mini.bench.long_context", "a 131,072-token prompt prefilled in chunks on one EP4 rank"),
)}


def main(argv: list[str] | None = None) -> int:
    return _run_registry(argv, SUITES, "mini bench")
