"""DSpark's draft step by kernel at real V4.1-Flash width (issue 27; docs/perf/027): spec-decode's draft step
(mini/bench/spec_decode.py `DraftStep`: the ring write of B x (1 + k) committed rows, then one block proposal per
sequence, each a CUDA graph) replayed under torch.profiler, its kernels grouped by part as
tools/rank4_decode_floor.py groups a decode step's:

    python3 tools/draft_census.py [spec-decode options: --batch 1,64 ...] [--kernel-split-steps 3] [--json FILE]

Per B: `write_ms` / `propose_ms` (median replays), `propose.kernel_ms.PART` and every kernel of the proposal
(name, ms per step, launches per step) in the raw record, longest first.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mini.bench import rank4_decode, spec_decode  # noqa: E402
from mini.testing.suites import SuiteError, run_as_script  # noqa: E402

SUITE = "draft-census"


def add_args(p) -> None:
    spec_decode.add_args(p)
    p.set_defaults(batch="1,64")
    p.add_argument("--kernel-split-steps", type=int, default=3, help="graph replays under torch.profiler")


def run(args) -> dict:
    import torch

    from rank4_decode_floor import kernel_class, kernel_split
    if not args.device.startswith("cuda"):
        raise SuiteError(f"{SUITE}: the census profiles CUDA graph replays; --device cuda")
    cfg = spec_decode.dspark_config(args.preset)
    k = args.spec_tokens or cfg.dspark_block_size
    cfg, _, model, metrics = rank4_decode.build(args, cfg)
    raw = {}
    for B in rank4_decode.int_list(args.batch, "batch", SUITE):
        step = spec_decode.DraftStep(model, B, int(args.context.split(",")[0]), 1 + k, args.seed,
                                     getattr(torch, args.dtype))
        step.write()
        step.propose()  # the eager warm-up: kernels compiled and configs looked up before the capture
        why = step.capture()
        if why:
            raise SuiteError(f"{SUITE}: B={B}: the draft step did not capture: {why}")
        for _ in range(max(args.warmup, 1)):
            step.write()
            step.propose()
        m = {f"{part}_ms": statistics.median(rank4_decode.time_calls(fn, args.steps, True))
             for part, fn in (("write", step.write), ("propose", step.propose))}
        parts, top = kernel_split(step.propose, args.kernel_split_steps)
        m |= {f"propose.kernel_ms.{p}" if not p.startswith("launches.") else f"propose.kernels_per_step.{p[9:]}": v
              for p, v in parts.items()}
        metrics |= {f"b{B}.{n}": v for n, v in m.items()}
        raw[f"b{B}"] = {"propose_kernels_ms_launches": top}
        print(f"{SUITE} B={B}: write {m['write_ms']:.3f} ms, propose {m['propose_ms']:.3f} ms "
              f"(kernels {parts.get('total', 0):.3f} ms in {parts.get('launches.total', 0):.0f} launches)", flush=True)
        for name, ms, n in top[:25]:
            print(f"{SUITE} B={B} {ms:7.3f} ms {n:5.0f}x {kernel_class(name):16s} {name[:90]}", flush=True)
        del step
    definition = {"what": "DSpark's draft step (spec-decode's DraftStep, CUDA graphs) by kernel", "spec_tokens": k,
                  "context": args.context, "preset": args.preset}
    return {"suite": SUITE, "definition": definition, "metrics": metrics, "raw": raw}


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__name__, SUITE, "DSpark's draft step by kernel", argv, "tools/draft_census.py")


if __name__ == "__main__":
    raise SystemExit(main())
