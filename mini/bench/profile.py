"""`mini profile --suite rank4`: ms per step of each stage of the rank4 prefill step, adding up to the step.

Stages and their timing: mini/testing/stage_times.py.

The run first measures the rank4 suite as `mini bench rank4` does (written as rank4.json: one model build serves
both), then the staged steps; one more step runs under torch.profiler with every stage a named range
(record_function), its Chrome trace gzipped beside them.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from mini.bench import rank4
    from mini.ops.stages import recording
    from mini.testing.rank_step import sync, time_steps
    from mini.testing.stage_times import report, staged
    from mini.testing.suites import check_result, environment, write_result
    p = argparse.ArgumentParser(prog="mini profile", description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=("rank4",), default="rank4")
    p.add_argument("--out", type=Path, default=Path("profile-out"), help="folder for the JSON report and the trace")
    p.add_argument("--profile-steps", type=int, default=3, help="steps timed by stage")
    rank4.add_args(p)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    r, setup_s = rank4.setup(args)
    suite = check_result("rank4", rank4.measure(r, setup_s, args))  # the rank4 suite's numbers, unwrapped
    plain = suite["raw"]["step_ms"]
    with staged(cuda) as timer:
        timed = time_steps(r, args.profile_steps)
        totals = timer.totals()
    step_ms = sum(timed) / len(timed)
    stages = report(totals, step_ms, len(timed))
    args.out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof, recording(torch.profiler.record_function):
        r.step()
        sync(r.batch.input_ids.device)
    trace = args.out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(args.out / "trace.json.gz", "wb") as z:  # Perfetto reads .json.gz
        shutil.copyfileobj(f, z)
    trace.unlink()
    result = {"suite": args.suite, "definition": rank4.definition(args), "stages_ms_per_step": stages,
              "step_ms_unwrapped_mean": sum(plain) / len(plain), "step_ms_wrapped": timed, "raw_totals_ms": totals,
              "profile_steps": len(timed), "env": environment()}
    write_result(args.out / "profile.json", result)
    write_result(args.out / "rank4.json", {**suite, "env": environment()})
    width = max(len(k) for k in stages)
    print(f"profile {args.suite}: " + json.dumps(result["definition"], sort_keys=True))
    for k, v in stages.items():
        print(f"  {k:{width}s} {v:10.3f}")
    print(f"  (unwrapped step {result['step_ms_unwrapped_mean']:.3f} ms; trace {args.out / 'trace.json.gz'})")
    return 0
