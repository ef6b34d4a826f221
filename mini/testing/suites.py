"""Suites run from the command line and reported as JSON: the registry shared by `mini bench` (mini/bench/) and
`mini check` (mini/check/), so that neither imports the other.

A suite is a module with
    add_args(parser)            its own command-line options
    run(args) -> dict           {"suite": NAME, "definition": {...}, "metrics": {name: number}}
`definition` holds every parameter that defines the workload (sizes, model, dtype, device kind): two results are
comparable only when their definitions are equal, which is what `tools/bench_rev.py` checks before an A/B. A check
returns the same shape; its metrics are errors, not speeds.

Suites are registered by module path and imported only when asked for, so a suite that is missing from a revision
(or fails to import) affects only its own name. `registry[name](args)` runs a suite like a plain function.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


class SuiteError(RuntimeError):
    """A suite is unknown, missing from this revision, or returned a malformed result."""


@dataclass(frozen=True)
class Suite:
    name: str
    module: str  # dotted path of the module that defines add_args and run
    summary: str

    def load(self) -> ModuleType:
        try:
            mod = importlib.import_module(self.module)
        except ModuleNotFoundError as e:
            if e.name == self.module:
                raise SuiteError(f"suite {self.name!r} lives in {self.module}, which this revision does not have "
                                 f"(not written yet?)") from e
            raise
        for attr in ("add_args", "run"):
            if not callable(getattr(mod, attr, None)):
                raise SuiteError(f"suite module {self.module} has no {attr}() function")
        return mod

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        self.load().add_args(parser)

    def __call__(self, args: argparse.Namespace) -> dict:
        return check_result(self.name, self.load().run(args))


def timed_call(fn, cuda: bool):
    """(fn()'s result, its milliseconds): CUDA events around the call on the GPU (its kernels' time, waited for),
    the wall clock on the CPU."""
    import time
    if not cuda:
        t0 = time.perf_counter()
        out = fn()
        return out, 1e3 * (time.perf_counter() - t0)
    import torch
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = fn()
    b.record()
    b.synchronize()
    return out, a.elapsed_time(b)


def get_suite(name: str, suites: dict[str, Suite]) -> Suite:
    if name not in suites:
        raise SuiteError(f"unknown suite {name!r}; known: {', '.join(sorted(suites))}")
    return suites[name]


def _is_json_value(v) -> bool:
    if isinstance(v, (str, bool, int)) or v is None:
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return all(_is_json_value(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_json_value(x) for k, x in v.items())
    return False


def check_result(name: str, result: dict) -> dict:
    """Raise SuiteError unless `result` has the suite result shape; returns it unchanged."""
    if not isinstance(result, dict) or set(result) < {"suite", "definition", "metrics"}:
        raise SuiteError(f"suite {name!r} must return a dict with suite, definition and metrics")
    if result["suite"] != name:
        raise SuiteError(f"suite {name!r} returned a result labelled {result['suite']!r}")
    if not isinstance(result["definition"], dict) or not _is_json_value(result["definition"]):
        raise SuiteError(f"suite {name!r}: definition must be a dict of plain JSON values")
    metrics = result["metrics"]
    if not isinstance(metrics, dict) or not metrics:
        raise SuiteError(f"suite {name!r}: metrics must be a non-empty dict")
    bad = [k for k, v in metrics.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad:
        raise SuiteError(f"suite {name!r}: metrics {bad} are not finite numbers")
    return result


def environment() -> dict:
    """Where a result was measured; recorded beside (not inside) the definition."""
    import mini
    env = {"python": platform.python_version(), "host": platform.node(),
           "mini_path": str(Path(mini.__file__).resolve().parent)}
    torch = sys.modules.get("torch")  # only if the suite used it: importing torch costs seconds
    if torch is not None:
        env["torch"] = torch.__version__
        env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if "mini.ops" in sys.modules:  # what the suite's ops ran on (mini.ops.backends)
        from mini.ops.backends import current
        env["backends"] = current().as_dict()
    from mini import switches
    env["switches"] = switches.current().as_dict()  # the MINI_* variables as read (mini.switches)
    return env


def write_result(path: Path | str, result: dict) -> None:
    """Write a result (with its `env`, see environment()) as JSON: the one place a suite's file is written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def parser(suite: Suite | None, suites: dict[str, Suite], prog: str) -> argparse.ArgumentParser:
    what = {"mini bench": "benchmark suite", "mini check": "check"}.get(prog, "suite")
    p = argparse.ArgumentParser(prog=prog + (f" {suite.name}" if suite else ""), description=f"Run a {what}.",
                                epilog=f"{what}s:\n" + "\n".join(f"  {s.name:13s} {s.summary}"
                                                                 for s in suites.values()),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", help="suite name", **({"choices": [suite.name]} if suite else {}))
    p.add_argument("--json", type=Path, metavar="FILE", help="write the result (with the environment) to FILE")
    if suite:
        suite.add_args(p)
    return p


def run_on_ranks(name: str, rank_fn, args, min_ranks: int = 1) -> dict:
    """A multi-rank suite's run(): one rank under torchrun, else `args.nproc` (default 2) local ranks started here
    (mini.parallel.launch.run_ranks). Every rank returns the same numbers; only rank 0 writes `args.json`."""
    import torch

    from mini.parallel.launch import run_ranks
    torchrun = "WORLD_SIZE" in os.environ
    nproc = args.nproc if torchrun else (args.nproc or 2)
    if not torchrun and nproc < min_ranks:
        raise SuiteError(f"{name} needs at least {min_ranks} ranks")
    device = args.device
    if not torchrun:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and torch.cuda.device_count() < nproc:
            raise SuiteError(f"{name}: {nproc} ranks need {nproc} GPUs, {torch.cuda.device_count()} visible")
    try:
        rank, result = run_ranks(rank_fn, args, nproc, device)
    except ValueError as e:
        raise SuiteError(f"{name}: {e}") from None
    if rank != 0:
        args.json = None
    return result


def main(argv: list[str] | None, suites: dict[str, Suite], prog: str) -> int:
    """`PROG NAME [--json FILE] [options]` over the registry `suites` (`mini bench`, `mini check`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-"):
        parser(None, suites, prog).parse_args(argv or ["--help"])  # prints help / usage and exits
        return 2
    try:
        suite = get_suite(argv[0], suites)
        args = parser(suite, suites, prog).parse_args(argv)
        result = suite(args)
    except SuiteError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    result = {**result, "env": environment()}
    if args.json:
        write_result(args.json, result)
    if os.environ.get("RANK", "0") != "0":  # under torchrun every rank holds the same numbers
        return 0
    width = max(len(k) for k in result["metrics"])
    print(f"{suite.name}: " + json.dumps(result["definition"], sort_keys=True))
    for k, v in result["metrics"].items():
        print(f"  {k:{width}s} {v:.6g}")
    return 0


def run_as_script(module: str, name: str, summary: str, argv: list[str] | None, prog: str) -> int:
    """A suite module kept under tools/ run as a script, `python3 tools/X.py [options] [--json FILE]`, checked and
    reported as `mini bench` reports a registered suite (`module`: the script's `__name__`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return main([name, *argv], {name: Suite(name, module, summary)}, prog)
