"""The cold-start diagnosis of tiny-goodput (mini/bench/serve.py; issue 15, docs/perf/008; phase `cold_diag` of
scripts/gpu.sh): the suite runs here, then the server's warm-up trace (MINI_WARMUP_TRACE) is summarized per burst
under `cold_diag` in the result:

    MINI_WARMUP_TRACE=trace.jsonl python3 tools/goodput_cold_diag.py [tiny-goodput options] [--json FILE]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini import switches  # noqa: E402
from mini.bench import serve  # noqa: E402
from mini.testing.suites import run_as_script  # noqa: E402

add_args = serve.add_args


def cold_diag(bursts: list[tuple[float, float]]) -> dict | None:
    """The server's warm-up trace (MINI_WARMUP_TRACE, mini.engine.warmup_trace) summarized per burst, where this
    process can read it (a started server inherits the variable); printed as one line per part. None without."""
    from mini.engine import warmup_trace
    path = switches.current().warmup_trace
    if not path or not os.path.exists(path):
        return None
    diag = warmup_trace.summarize(warmup_trace.read(path), bursts)
    for name, part in [("warm-up", diag["warmup"])] + [(f"burst {b['burst']}", b) for b in diag["bursts"]]:
        print(f"{name}: {part['steps']} steps in {part['step_s']:.3f} s (slowest {part['max_step_s']:.3f} s), "
              f"{part['compiles']} Triton compiles ({part['compile_s']:.2f} s) {part['compiled_kernels']}, "
              f"{part['captures']} graph captures, reserved +{part['reserved_growth'] / 2**20:.0f} MiB, "
              f"{part['gc_full']} full GCs ({part['gc_s']:.3f} s)")
    return diag


def run(args) -> dict:
    result = serve.run(args)
    diag = cold_diag(result["bursts"])
    if diag is not None:
        result["cold_diag"] = diag
    return result


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__name__, serve.SUITE, "tiny-goodput with the server's warm-up trace per burst", argv,
                         "tools/goodput_cold_diag.py")


if __name__ == "__main__":
    raise SystemExit(main())
