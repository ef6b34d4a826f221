"""Several rank4 workloads measured one after the other on ONE build (docs/perf/010, the realistic rank: the model is
drawn once; on the H200 the build is ~35 s of each process, the steps ~5 s), one rank4 result each in
DIR/rank4_<name>.json, with `raw.same_build` naming the workloads built together (`scripts/gpu.sh rank4_modes`):

    python3 tools/rank4_modes.py --modes uniform,realistic,uniform_host --out DIR [rank4 options]

`--host-engram-rows` sets the host tables' rows (host workloads only).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench.rank4 import add_args, configure, measure, resolve, setup  # noqa: E402
from mini.testing.suites import SuiteError, check_result, environment, write_result  # noqa: E402

SAME_BUILD_MODES = {  # main()'s workloads: name -> the rank4 options that define it
    "uniform": ["--mode", "uniform"],
    "realistic": ["--mode", "realistic"],
    "uniform_host": ["--mode", "uniform", "--engram", "host"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/rank4_modes.py", description=__doc__.split("\n")[0])
    p.add_argument("--modes", default=",".join(SAME_BUILD_MODES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--host-engram-rows", type=int, default=None)
    own, common = p.parse_known_args(argv)
    names = own.modes.split(",")
    if not names or any(n not in SAME_BUILD_MODES for n in names):
        p.error(f"--modes {own.modes!r}: a comma-separated list of {', '.join(SAME_BUILD_MODES)}")
    rank4 = argparse.ArgumentParser(prog="rank4")
    add_args(rank4)

    def parse(name: str):
        extra = SAME_BUILD_MODES[name]
        args = resolve(rank4.parse_args(common + extra))
        if args.engram == "host" and own.host_engram_rows is not None:
            args.engram_rows = own.host_engram_rows
        return args

    modes = {n: parse(n) for n in names}
    base = next((a for a in modes.values() if a.engram == "host"), modes[names[0]])  # host tables only at build
    try:
        r, setup_s = setup(base)
        own.out.mkdir(parents=True, exist_ok=True)
        for name, args in modes.items():
            res = check_result("rank4", measure(configure(r, args), setup_s, args))
            res["raw"]["same_build"] = names
            write_result(own.out / f"rank4_{name}.json", {**res, "env": environment()})
            m = res["metrics"]
            print(f"rank4 {name}: median {m['median_step_ms']:.2f} ms/step, engram_wait "
                  f"{m.get('engram_wait_ms_median', float('nan')):.3f} ms, host_build "
                  f"{m.get('host_build_ms_median', float('nan')):.2f} ms", flush=True)
    except SuiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
