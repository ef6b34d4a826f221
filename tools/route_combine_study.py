"""The routing plan and the combine at a step's pair counts (docs/perf/038: at the B = 64 x 6 verify step on one
emulated EP8 rank the plan's count and place kernels took 15 us a layer each, three times the decode step's, and the
combine 26 us): each case times them in a CUDA graph (as the step replays them) under other launch shapes, and
checks that every shape gives the same plan and the same bits.

- Routing plan (mini/kernels/moe_route.py), tokens x 6 pairs over 384 experts, one rank's 384 / EP local: the
  count and place kernels over `pick_block`'s blocks (about one program an SM, each walking several SUB-pair steps
  at a verify step) against fixed blocks of 64..1,024 pairs (more, shorter programs).
- Combine (mini/kernels/moe_combine.py), the tokens' outputs from the local rows: a program per token and 1,024
  columns at 4 warps (the default) against other column blocks and warps.

    python3 tools/route_combine_study.py [--cases NAME ...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from looped_rows_study import nominal_tbs  # noqa: E402
from mini.bench.kernels import _bench_graph  # noqa: E402

DIM, TOPK, EXPERTS = 5120, 6, 384  # V4.1-Flash
# name: (tokens the rank's plan holds = B x rows a sequence x ranks, EP)
CASES = {
    "decode_b64_ep8": (64 * 8, 8),
    "verify_b64x6_ep8": (64 * 6 * 8, 8),
    "verify_b16x6_ep8": (16 * 6 * 8, 8),
    "decode_b64_ep4": (64 * 4, 4),
    "verify_b64x6_ep4": (64 * 6 * 4, 4),
    "decode_b256_ep4": (256 * 4, 4),
    "prefill_rank4": (4096 * 4, 4),
}
PLAN_BLOCKS = (None, 64, 128, 256, 512, 1024)  # None: pick_block
COMBINE_SHAPES = ((None, 4), (512, 4), (2048, 4), (1024, 8), (2048, 8))  # (block_d, num_warps); None: the default


def run_case(name: str, tokens: int, ep: int, dev="cuda", dim: int = DIM) -> dict:
    from mini.kernels.moe_combine import combine
    from mini.kernels.moe_route import pick_block, plan_routes, launch_sizes
    from mini.kernels.device_info import sm_count
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(tokens, EXPERTS, device=dev, generator=g).argsort(dim=1)[:, :TOPK]
    weights = torch.rand(tokens, TOPK, device=dev, generator=g)
    local = EXPERTS // ep
    experts = range(local, 2 * local)
    out = {"tokens": tokens, "pairs": tokens * TOPK, "local_experts": local,
           "pick_block": pick_block(tokens * TOPK, launch_sizes(local)[1], sm_count(torch.device(dev)))}
    first = None
    for block in PLAN_BLOCKS:
        plan = plan_routes(ids, weights, experts, 128, False, block=block, one_program=False)
        n = int(plan.expert_offset[-1])
        got = (plan.expert_offset.clone(), plan.token[:n].clone(), plan.weight[:n].clone(), plan.slot_row.clone())
        same = True if first is None else all(torch.equal(a, b) for a, b in zip(got, first))
        first = got if first is None else first
        us = _bench_graph(lambda: plan_routes(ids, weights, experts, 128, False, block=block, one_program=False)) * 1e3
        out[f"plan.block_{block or 'pick'}"] = {"us": round(us, 2), "same_plan": same}
        print(name, f"plan block {block or 'pick_block'}: {us:.2f} us, same plan {same}", flush=True)
    plan = plan_routes(ids, weights, experts, 128, False)
    n_local = int(plan.expert_offset[-1])
    y = torch.randn(plan.n_rows, dim, device=dev).bfloat16()
    res = torch.empty(tokens, dim, device=dev, dtype=torch.bfloat16)
    nbytes = tokens * dim * 2 + n_local * dim * 2  # the outputs written, the local rows read
    tbs = nominal_tbs()
    ref = None
    for block_d, warps in COMBINE_SHAPES:
        def call():
            combine(y, ids, plan.slot_row, experts, torch.bfloat16, out=res, block_d=block_d, num_warps=warps)
        res.fill_(float("nan"))
        call()
        got = res.clone()
        same = True if ref is None else torch.equal(got.view(torch.int16), ref.view(torch.int16))
        ref = got if ref is None else ref
        us = _bench_graph(call) * 1e3
        out[f"combine.bd_{block_d or 'default'}_w{warps}"] = {"us": round(us, 2), "bit_equal": same,
                                                              "frac_hbm": round(nbytes / us / 1e6 / tbs, 3)}
        print(name, f"combine block_d {block_d or 'default'} warps {warps}: {us:.2f} us "
              f"({nbytes / us / 1e6:.2f} TB/s), bit-equal {same}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    p.add_argument("--json")
    args = p.parse_args(argv)
    results = {"device": torch.cuda.get_device_name(), "cases": {}}
    for name in args.cases:
        results["cases"][name] = run_case(name, *CASES[name])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
