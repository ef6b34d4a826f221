"""Correctness checks that need more than a unit test's budget (real-width layers, a GPU, several ranks): `mini check
NAME [--json FILE] [options]`, run and reported like the benchmark suites (mini/testing/suites.py: the same result
shape, the environment and backends recorded), but their metrics are errors, not speeds.
"""
from __future__ import annotations

from mini.testing.suites import Suite
from mini.testing.suites import main as _run_registry

CHECKS: dict[str, Suite] = {s.name: s for s in (
    Suite("fastpath", "mini.check.fastpath", "fast path vs reference: real-width layers, tiny decode"),
    Suite("ep-exact", "mini.check.ep_exact", "N EP/DP ranks vs one rank holding every expert: tokens and logits"),
)}


def main(argv: list[str] | None = None) -> int:
    return _run_registry(argv, CHECKS, "mini check")
