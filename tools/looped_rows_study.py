"""The routed experts' gathered passes at real shape: a program per capacity tile vs programs that loop to the
device's row count (mini/kernels/device_info.looped_row_programs; docs/perf/037 Next 5).

In front of Humming's GEMMs the gathered act quant (`fp8_act_quant(x, rows=plan.token, n_valid=...)`) and after
the first the SwiGLU epilogue (`swiglu_rows`) run over a plan's capacity, tokens x top-k rows, of which one rank's
experts hold ~1 / EP; the count lives on the device (no host sync, CUDA graphs). Each case times both passes in a
CUDA graph (as the step replays them) at LOOPED_PROGRAMS_PER_SM = 10**6 (a program per capacity tile: the grid
before the loop), 16 (the default: one wave), 8 and 4, checks that the outputs are bit-equal across them, and
prints us per call and GB/s of the valid rows' bytes (read + written) against the card's bandwidth.

    python3 tools/looped_rows_study.py [--cases NAME ...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench.kernels import _bench_graph  # noqa: E402
from mini.kernels import device_info  # noqa: E402

DIM, INTER, TOPK = 5120, 2304, 6  # V4.1-Flash
# name: (tokens the rank's plan holds, local rows) -- decode / verify at B = 64 on one emulated EP4 / EP8 rank
# (tokens = B x rows a sequence x ranks; local rows ~ tokens x 6 / EP) and a rank4 prefill step
CASES = {
    "decode_b64_ep8": (64 * 8, 64 * 8 * TOPK // 8),
    "verify_b64x6_ep8": (64 * 6 * 8, 64 * 6 * 8 * TOPK // 8),
    "decode_b64_ep4": (64 * 4, 64 * 4 * TOPK // 4),
    "verify_b64x6_ep4": (64 * 6 * 4, 64 * 6 * 4 * TOPK // 4),
    "decode_b256_ep4": (256 * 4, 256 * 4 * TOPK // 4),
    "prefill_rank4": (4096 * 4, 4096 * 4 * TOPK // 4),
}
PER_SM = (10 ** 6, 16, 8, 4)


def nominal_tbs() -> float:
    """The card's nominal memory bandwidth, TB/s: an H200 (141 GB) 4.8, an H100 (80 GB) 3.35."""
    return 4.8 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 3.35


def run_case(name: str, tokens: int, local: int, dev="cuda") -> dict:
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.mxfp4_grouped_gemm import swiglu_rows
    cap = tokens * TOPK
    x = torch.randn(tokens, DIM, device=dev).bfloat16()
    rows = torch.randint(0, tokens, (cap,), device=dev, dtype=torch.int32)
    n_valid = torch.tensor([local], device=dev, dtype=torch.int32)
    gu = torch.randn(cap, 2 * INTER, device=dev).bfloat16() * 3
    route_w = torch.rand(cap, device=dev)
    xs = torch.empty(cap, DIM, device=dev, dtype=torch.bfloat16)
    h = torch.empty(cap, INTER, device=dev, dtype=torch.bfloat16)
    passes = {
        "act_quant": (lambda: fp8_act_quant(x, 32, out=xs, rows=rows, n_valid=n_valid), xs, local * DIM * 4),
        "swiglu_rows": (lambda: swiglu_rows(gu[:, :INTER], gu[:, INTER:], route_w, n_valid, 10.0, 32, out=h), h,
                        local * INTER * 6),
    }
    tbs = nominal_tbs()
    out = {"tokens": tokens, "capacity_rows": cap, "local_rows": local}
    default = device_info.LOOPED_PROGRAMS_PER_SM
    try:
        _time_passes(name, passes, local, tbs, out)
    finally:
        device_info.LOOPED_PROGRAMS_PER_SM = default
    return out


def _time_passes(name: str, passes: dict, local: int, tbs: float, out: dict) -> None:
    for pname, (fn, res, nbytes) in passes.items():
        first = None
        for per_sm in PER_SM:
            device_info.LOOPED_PROGRAMS_PER_SM = per_sm
            res.fill_(float("nan"))
            fn()
            got = res[:local].clone()
            same = True if first is None else torch.equal(got.view(torch.int16), first.view(torch.int16))
            first = got if first is None else first
            us = _bench_graph(fn) * 1e3
            key = f"{pname}.per_sm_{per_sm}"
            out[key] = {"us": round(us, 2), "gbs": round(nbytes / us / 1e3, 1),
                        "frac_hbm": round(nbytes / us / 1e6 / tbs, 3), "bit_equal": same}
            print(f"{name:18s} {pname:11s} per_sm={per_sm:>7d} {us:8.2f} us {nbytes / us / 1e3:7.1f} GB/s "
                  f"bit_equal={same}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--json")
    a = ap.parse_args()
    res = {name: run_case(name, *CASES[name]) for name in a.cases}
    if a.json:
        Path(a.json).write_text(json.dumps({"suite": "looped_rows", "metrics": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
