"""Correctness checks that need more than a unit test's budget (real-width layers, a GPU): `mini check NAME [--json
FILE] [options]`, run and reported like the benchmark suites (mini.bench: the same result shape, the environment
and backends recorded), but their metrics are errors, not speeds.
"""
from __future__ import annotations

from mini.bench import Suite
from mini.bench import main as _run_registry

CHECKS: dict[str, Suite] = {s.name: s for s in (
    Suite("fastpath", "mini.check.fastpath", "fast path vs reference: real-width layers, tiny decode"),
)}


def main(argv: list[str] | None = None) -> int:
    return _run_registry(argv, CHECKS, "mini check")
