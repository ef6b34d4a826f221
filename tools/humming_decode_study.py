"""Humming's routed-expert GEMMs at decode row counts, under its heuristic tile config and hand-made variants.

At decode the adapter (mini/kernels/humming_experts.py) runs Humming's small-M schedule with stream-K off (stream-K
adds partial tiles into the bf16 output: a second rounding), so a GEMM has one CTA per N tile of each touched
expert: at B = 1 on one emulated EP4 rank (~1.4 touched experts) ~50 CTAs for 132 SMs. This study asks whether
other tiles (narrower N, deeper K, more stages, more CTAs per SM) stream an expert's weights faster there.

Setup: one layer's 96 local experts (a recorded case: its own count, DSpark's draft 128) at V4.1-Flash shape
(w1|w3: N 4608, K 5120; w2: N 5120, K 2304), random MXFP4 codes and E8M0 scales, converted to Humming's layout.
For each case (pairs routed to local experts per step), ROTATE different random routings are replayed in turn
inside one CUDA graph, so the touched experts change call to call and their weights come from HBM, not L2 (a
layer's experts are 1.7 GB). Per config: us per GEMM call
(median graph replay / ROTATE), the weight bytes the touched experts hold over that time (GB/s), and the outputs
against the heuristic config's (max |diff|, fraction bit-equal: the same exact products summed in another order).
A variant the library refuses is reported and skipped; one that faults ends the run (run this last in a call).

Take the cases from the step itself: `--step-routing rank4.json` replays each MoE layer's rows per local expert
that a rank4-decode (or spec-decode: its decode, verify and draft steps) run recorded (phase humming_step does
both in one call). Tiles chosen on synthetic spreads (PxR, uDxR) were 5-13% slower in the step, whose routing
concentrates (docs/perf/025: a verify step of 64 x 6 rows put up to 148 rows on one expert where the uniform draw
gave ~24); tiles chosen on the step's own routing held in the step (docs/perf/026: bucket 512).

    python3 tools/humming_decode_study.py --pairs 4x4,96x4,384x4 [--step-routing rank4.json] [--names ...]
        [--variants NAME=JSON ...] [--json out.json]

Our split-K kernel over the same layout (measured in docs/perf/021, 2-7x slower at every case) was dropped.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# patches of the heuristic config, applied per GEMM (JSON object merged over the default's keys)
VARIANTS = {
    "n64": {"block_shape": [None, 64, None]},
    "stages6": {"num_stages": 6},
    "stages8": {"num_stages": 8},
    "ctas2": {"num_ctas_per_sm": 2},
    "ctas4": {"num_ctas_per_sm": 4},
    "n64_ctas2": {"block_shape": [None, 64, None], "num_ctas_per_sm": 2},
    "n64_stages8_ctas2": {"block_shape": [None, 64, None], "num_stages": 8, "num_ctas_per_sm": 2},
    # the heuristic picks its tile from the step's total rows; a decode step's experts hold a few rows each
    "bucket16": {"bucket": 16}, "bucket32": {"bucket": 32}, "bucket64": {"bucket": 64},
    "bucket128": {"bucket": 128}, "bucket256": {"bucket": 256}, "bucket512": {"bucket": 512},
    "bucket1024": {"bucket": 1024}, "bucket2048": {"bucket": 2048},
    # w2's default at decode is a wgmma tile of all 256 columns (20 CTAs per touched expert): w1|w3's mma.sync
    # decode tiles instead (64 or 128 columns, K split between two warps)
    "mma64": {"mma_type": "mma", "block_shape": [8, 64, 64], "warp_shape": [8, 64, 32]},
    "mma64_stages6": {"mma_type": "mma", "block_shape": [8, 64, 64], "warp_shape": [8, 64, 32], "num_stages": 6},
    "mma128": {"mma_type": "mma", "block_shape": [8, 128, 64], "warp_shape": [8, 64, 32]},
    # for scale only, never served: stream-K's bf16 reduce-add rounds twice (what parallelism over K would give)
    "streamk": {"use_stream_k": True},
    # bucket 512's mma.sync tile (8 rows, K split between two warps) with more rows per tile: an expert's rows in one
    # or two tiles instead of 3-18 that each re-read its weights (a verify step puts ~24-148 rows on an expert)
    "mma_m16": {"bucket": 512, "block_shape": [16, None, None], "warp_shape": [16, None, None]},
    "mma_m32": {"bucket": 512, "block_shape": [32, None, None], "warp_shape": [32, None, None]},
    "mma_m16_ctas2": {"bucket": 512, "block_shape": [16, None, None], "warp_shape": [16, None, None],
                      "num_ctas_per_sm": 2},
    "mma_m32_ctas2": {"bucket": 512, "block_shape": [32, None, None], "warp_shape": [32, None, None],
                      "num_ctas_per_sm": 2},
    # bucket 4096's wgmma tile (56 rows; a B = 64 verify step) with more rows: fewer tiles re-read a concentrated
    # expert's weights; and the heuristic's tiles for more rows than the step has
    "wg_m64": {"bucket": 4096, "block_shape": [64, None, None], "warp_shape": [64, None, None]},
    "wg_m96": {"bucket": 4096, "block_shape": [96, None, None], "warp_shape": [96, None, None]},
    "wg_m128": {"bucket": 4096, "block_shape": [128, None, None], "warp_shape": [128, None, None]},
    # fewer rows a tile where a verify step's experts hold ~48 (one emulated EP8 rank's 48 experts, 2,304 rows): the
    # heuristic's 96-row tile for the bucket's 4,096 rows computes twice the rows it keeps
    "wg_m32": {"bucket": 4096, "block_shape": [32, None, None], "warp_shape": [32, None, None]},
    "wg_m48": {"bucket": 4096, "block_shape": [48, None, None], "warp_shape": [48, None, None]},
    "wg_m56": {"bucket": 4096, "block_shape": [56, None, None], "warp_shape": [56, None, None]},
    # bucket 2048's config (what bucket 4096 takes at 48 local experts, docs/perf/039) one key at a time
    "b2048_stages3": {"bucket": 2048, "num_stages": 3}, "b2048_stages6": {"bucket": 2048, "num_stages": 6},
    "b2048_ctas2": {"bucket": 2048, "num_ctas_per_sm": 2},
    "b2048_raster1": {"bucket": 2048, "raster_group_m": 1}, "b2048_raster8": {"bucket": 2048, "raster_group_m": 8},
    "wg_m64_ctas1": {"bucket": 4096, "block_shape": [64, None, None], "warp_shape": [64, None, None],
                     "num_ctas_per_sm": 1},
    "bucket4096": {"bucket": 4096}, "bucket8192": {"bucket": 8192}, "bucket16384": {"bucket": 16384},
    # bucket 2048 (decode at B = 171-341: ~16 rows on each of ~94 touched experts) in a 32-row wgmma tile of 256
    # columns: narrower columns (more CTAs a touched expert); 16-row tiles are bucket 1024's own config
    "n128": {"block_shape": [None, 128, None]},
    "n128_ctas2": {"block_shape": [None, 128, None], "num_ctas_per_sm": 2},
    # deeper K steps: each stage holds twice (four times) the bytes, so a CTA keeps more of its expert's weights in
    # flight (report 020's variants all kept 64-deep steps; at 36 x 4 the decode tiles stream ~2 TB/s, at 384 x 4
    # ~2.6, the B = 256 step's wgmma tiles ~2.2). k128: the mma.sync tiles' two warps split each 128-deep step in
    # halves; k128w: one K partition as deep as the step (the wgmma tiles'). Another summation order, not the same
    # bits. On an H100 (docs/perf/036) none won beyond noise: k128_stages4 took 384 x 4's w1|w3 427.7 -> 413.8 us
    # and lost elsewhere, k128 / k128w lost up to 3x at 1536 x 16, the wgmma tiles' k128w refused to build
    "k128": {"block_shape": [None, None, 128], "warp_shape": [None, None, 64]},
    "k128_stages4": {"block_shape": [None, None, 128], "warp_shape": [None, None, 64], "num_stages": 4},
    "k128_stages8": {"block_shape": [None, None, 128], "warp_shape": [None, None, 64], "num_stages": 8},
    "k128w": {"block_shape": [None, None, 128], "warp_shape": [None, None, 128]},
    "k128w_stages3": {"block_shape": [None, None, 128], "warp_shape": [None, None, 128], "num_stages": 3},
}


def patched(base: str, patch: dict, stack) -> str:
    """The tuning JSON `base` with `patch`'s keys replaced; list entries None keep the base's value. The warp
    shape's N follows a narrower block N. {"bucket": R}: the heuristic's own config for R rows instead (not
    DECODE_TILES' change there), with the patch's other keys over it."""
    from mini.kernels.humming_experts import tuning_for
    if "bucket" in patch:
        base = tuning_for(stack, patch["bucket"], tuned=False)
    t = json.loads(base)
    for key, val in ((k, v) for k, v in patch.items() if k != "bucket"):
        if isinstance(val, list):
            t[key] = [b if v is None else v for v, b in zip(val, t[key])]
        else:
            t[key] = val
    if "block_shape" in patch and t["warp_shape"][1] > t["block_shape"][1]:
        t["warp_shape"][1] = t["block_shape"][1]
    return json.dumps(t)


def step_cases(path: str) -> dict[str, list[list[int]]]:
    """A rank4-decode (or tools/rank4_decode_floor.py) JSON's recorded routings: "step:<shape>" -> each MoE
    layer's pairs per local expert (raw.<shape>.pairs_per_local_expert), the spread the step's GEMMs really saw;
    a spec-decode JSON's steps as "step:<shape>.<decode|verify|draft>"."""
    raw = json.loads(Path(path).read_text())["raw"]
    found = list(raw.items())
    found += [(f"{shape}.{step}", sub) for shape, r in raw.items() for step, sub in r.items() if isinstance(sub, dict)]
    cases = {f"step:{name}": list(r["pairs_per_local_expert"].values())
             for name, r in found if "pairs_per_local_expert" in r}
    if not cases:
        raise SystemExit(f"{path}: no raw.<shape>.pairs_per_local_expert (record it with this tree's rank4-decode)")
    return cases


def select_cases(recorded: dict, names: list[str]) -> dict:
    """Only the recorded cases named (--cases), in their order; a name not recorded is refused with the ones that
    are."""
    unknown = [n for n in names if n not in recorded]
    if unknown:
        raise SystemExit(f"--cases {unknown}: not recorded (the routing JSON has {sorted(recorded)})")
    return {n: recorded[n] for n in names}


def case_experts(spec: str, default: int, recorded: dict) -> int:
    """The experts of a case's layer: a recorded case's own count (DSpark's draft MoE holds 128, a rank's layer 96
    at V4.1-Flash), the default for a synthetic one."""
    return len(recorded[spec][0]) if spec in recorded else default


def case_counts(spec: str, experts: int, rotate: int, g: torch.Generator, recorded: dict) -> list[torch.Tensor]:
    """`rotate` routings of one case, each the pairs (rows) per local expert [experts]: PxR, P rows on P / R
    experts drawn without repeats, R each; uDxR, D pairs drawn uniformly, R rows each; step:<shape>, the recorded
    layers in turn."""
    if spec in recorded:
        layers = recorded[spec]
        if any(len(c) != experts for c in layers):
            raise SystemExit(f"{spec}: recorded with {len(layers[0])} local experts, the study has {experts} "
                             f"(--experts)")
        return [torch.tensor(layers[i % len(layers)]) for i in range(rotate)]
    d, r = (int(v) for v in spec.lstrip("u").split("x"))
    out = []
    for _ in range(rotate):
        if spec.startswith("u"):
            out.append(torch.bincount(torch.randint(0, experts, (d,), generator=g), minlength=experts) * r)
        else:
            counts = torch.zeros(experts, dtype=torch.int64)
            counts[torch.randperm(experts, generator=g)[:d // r]] = r
            out.append(counts)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", default="4x4,8x4,6x1,36x4,96x4,384x4",
                   help="cases, comma-separated: PxR = P local rows per step, R rows on each touched expert (one "
                        "emulated EP4 rank repeats each own token 4 times: B = 1 is ~1.4 experts x 4 rows, its verify "
                        "step of 6 rows per sequence ~36x4); uDxR = D (token, local expert) pairs drawn uniformly "
                        "over the experts, each R rows (a step's spread: B = 64 on the emulated rank is u96x4)")
    p.add_argument("--experts", type=int, default=96,
                   help="local experts of the layer in the synthetic cases (a recorded case has its own count: "
                        "DSpark's draft MoE 128)")
    p.add_argument("--rotate", type=int, default=8, help="different routings replayed in turn")
    p.add_argument("--variants", nargs="*", default=None, metavar="NAME=JSON",
                   help="tuning patches (default: the built-in VARIANTS)")
    p.add_argument("--names", nargs="*", default=None, help="only these of the built-in VARIANTS")
    p.add_argument("--step-routing", default=None, metavar="JSON",
                   help="a rank4-decode (or spec-decode) JSON: a case per recorded step, step:<shape> (spec-decode: "
                        "step:<shape>.decode / .verify / .draft), its layers' routings in turn")
    p.add_argument("--cases", nargs="*", default=None, metavar="CASE",
                   help="only these of --step-routing's cases (e.g. step:b64_c4096.draft)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import triton

    from mini.config import preset
    from mini.kernels import humming_experts as hx
    cfg = preset("v4.1-flash")
    D, I = cfg.dim, cfg.moe_inter_dim
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def stack(E, n, k):
        codes = torch.randint(0, 256, (E, n, k // 2), generator=g, device=dev, dtype=torch.uint8)
        scales = torch.randint(120, 122, (E, n, k // 32), generator=g, device=dev, dtype=torch.uint8)
        return hx.convert(codes, scales)
    variants = {n: VARIANTS[n] for n in args.names} if args.names else VARIANTS if args.variants is None else {
        v.split("=", 1)[0]: json.loads(v.split("=", 1)[1]) for v in args.variants}
    results = {"device": torch.cuda.get_device_name(), "experts": args.experts, "rotate": args.rotate, "cases": {}}
    recorded = step_cases(args.step_routing) if args.step_routing else {}
    if args.cases is not None:
        recorded = select_cases(recorded, args.cases)
    specs = [v for v in args.pairs.split(",") if v] + list(recorded)
    experts_of = {spec: case_experts(spec, args.experts, recorded) for spec in specs}
    stacks_of = {E: {"w13": stack(E, 2 * I, D), "w2": stack(E, D, I)} for E in sorted(set(experts_of.values()))}
    cpu = torch.Generator().manual_seed(0)
    counts_of = {spec: case_counts(spec, experts_of[spec], args.rotate, cpu, recorded) for spec in specs}
    # the rows a case's tile config is chosen for, as the step's: the mean over its routings
    expected_of = {spec: round(sum(int(c.sum()) for c in cs) / len(cs)) for spec, cs in counts_of.items()}
    configs_of = {}  # (case, GEMM) -> {tag: tuning JSON}
    for spec in specs:
        for name, st in stacks_of[experts_of[spec]].items():
            base = hx.tuning_for(st, expected_of[spec])
            configs_of[spec, name] = {"default": base,
                                      **{v: patched(base, patch, st) for v, patch in variants.items()}}
    # every build at once, side by side (one at a time they take seconds each)
    refused = hx.warm_up([(stacks_of[experts_of[spec]][name], t) for (spec, name), cs in configs_of.items()
                          for t in cs.values()])
    results["refused"] = refused
    for spec in specs:
        E, routings = experts_of[spec], []
        for counts in counts_of[spec]:
            offset = torch.zeros(E + 1, dtype=torch.int32, device=dev)
            offset[1:] = counts.cumsum(0).to(dev)
            routings.append((offset, int((counts > 0).sum())))
        pairs, expected = max(int(c.sum()) for c in counts_of[spec]), expected_of[spec]
        touched = sum(t for _, t in routings) / len(routings)
        case = {"touched_experts": touched, "experts": E}
        for name, st in stacks_of[E].items():
            a = torch.randn(pairs, st.k, generator=g, device=dev).bfloat16()
            # zeros: rows past a routing's own count are never written, and the configs' outputs are compared whole
            outs = [torch.zeros(pairs, st.n, dtype=torch.bfloat16, device=dev) for _ in routings]
            configs = configs_of[spec, name]
            case[f"{name}_default_tuning"] = configs["default"]
            print(f"pairs={spec} {name} default: {configs['default']}", flush=True)
            expert_bytes = st.n * st.k // 2 + st.n * st.k // 32
            ref = None
            for tag, tuning in configs.items():
                if tuning in refused:
                    print(f"  {name} {tag}: refused at build ({refused[tuning][:200]})", flush=True)
                    continue
                def calls(tuning=tuning):
                    for (off, _), o in zip(routings, outs):
                        hx.grouped_gemm(a, st, off, expected, out=o, tuning=tuning)
                try:
                    calls()
                    torch.cuda.synchronize()
                    got = torch.stack([o.clone() for o in outs])
                    us = triton.testing.do_bench_cudagraph(calls, rep=50, return_mode="median") * 1e3 / len(routings)
                except Exception as e:  # refused or failed to build: report, keep going
                    print(f"  {name} {tag}: skipped ({type(e).__name__}: {str(e)[:200]})", flush=True)
                    continue
                if ref is None:
                    ref = got
                diff = float((got.float() - ref.float()).abs().max())
                same = float((got == ref).float().mean())
                gbs = touched * expert_bytes / (us * 1e-6) / 1e9
                case[f"{name}_{tag}"] = {"us": us, "GB_s": gbs, "max_abs_diff": diff, "bit_equal": same}
                print(f"  {name} {tag:20s} {us:8.2f} us  {gbs:7.0f} GB/s  diff {diff:.3g}  equal {same:.4f}",
                      flush=True)
            ref = None
        results["cases"][spec] = case
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
