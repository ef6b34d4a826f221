"""`moe-layer`: one V4.1-Flash MoE layer as one EP4 rank runs it: the gate over the tokens an all-gather brings
(16,384 = 4 ranks x 4,096), this rank's 96 local experts over the pairs routed to them, the combine; and the
shared expert over the rank's own 4,096 tokens. Random weights drawn on the GPU (uniform E2M1 codes, E8M0 scales
near 2^-6), random bf16 activations.

`--moe-gemm` picks the routed experts' GEMM library (auto = what `mini.ops.backends.moe_gemm` resolves: Humming
where it imports on SM90, else Triton); Humming rewrites the experts into its layout first (`to_humming`).

Metrics: ms per part and in total (CUDA events, median of --iters after --warmup), achieved TFLOP/s of the routed
GEMMs against the floor (their FLOPs at the measured bf16 GEMM peak, `--peak-tflops`), peak memory, an output
checksum, and the relative error of the fast routed output against the reference (`mini.ops.moe` with the
reference backend) on a sample of tokens. `--sweep` also times the grouped GEMMs under several tile configs.

`ms_gate` / `ms_route_plan` time what the fast path runs: the fused gate kernel (mini/kernels/moe_gate.py) and the
Triton routing plan (mini/kernels/moe_route.py). `--old-gate-plan` also times the previous implementations in the
same process (`gate_unfused`: cuBLAS logits + torch epilogue; `plan_routes_torch`: torch sort) and reports how
the two agree; `--gate-configs` times the gate kernel's configs; `--only-gate-plan` stops there (no experts' GEMMs).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from mini.testing.suites import timed_call
from mini.config import preset

SWEEP = {  # (block_m, BN, BK, num_warps, num_stages, SWAP_AB); results: docs/kernels.md (MoE)
    # 256-row tiles decode each weight tile for twice the rows (the decode, not the MMA, is the limit today)
    "swiglu": [(128, 64, 64, 4, 4, False), (128, 128, 64, 8, 4, False), (128, 64, 64, 4, 4, True),
               (256, 64, 64, 8, 3, False), (256, 64, 64, 8, 3, True)],
    "down": [(128, 128, 64, 8, 4, False), (128, 128, 64, 8, 4, True), (256, 128, 64, 8, 3, False),
             (256, 64, 64, 8, 4, False), (256, 128, 64, 8, 3, True)],
}


ROUTE_PLAN_FIELDS = ("token", "weight", "slot_row", "expert_offset", "tile_expert", "tile_start", "tile_end")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--tokens", type=int, default=16384, help="tokens the gate and the local experts see")
    p.add_argument("--own-tokens", type=int, default=4096, help="tokens the shared expert sees (the rank's own)")
    p.add_argument("--local-experts", type=int, default=96)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=804.0, help="bf16 dense GEMM peak for the floor")
    p.add_argument("--check-tokens", type=int, default=256, help="tokens compared against the reference (0: off)")
    p.add_argument("--sweep", action="store_true", help="also time the Triton grouped GEMMs under several tile configs")
    p.add_argument("--moe-gemm", choices=["auto", "humming", "triton"], default="auto",
                   help="routed experts' GEMM library (auto: mini.ops.backends.moe_gemm)")
    p.add_argument("--humming-tiles", nargs="*", metavar="BMxSTAGES", default=[],
                   help="humming: also time the GEMMs with its heuristic config changed to these row tiles and "
                        "pipeline depths, e.g. 128x4 192x4")
    p.add_argument("--old-gate-plan", action="store_true",
                   help="also time the unfused gate and the torch routing plan, and compare their results")
    p.add_argument("--gate-configs", action="store_true", help="also time every config of the fused gate kernel")
    p.add_argument("--only-gate-plan", action="store_true", help="time the gate and the routing plan only")
    p.add_argument("--gate-sweep-tokens", type=int, nargs="*", default=[], metavar="T",
                   help="also time the fused and the unfused gate on the first T tokens (the dispatch threshold)")
    p.add_argument("--route-blocks", type=int, nargs="*", default=[], metavar="PAIRS",
                   help="also time the routing plan with these pairs per program (powers of two; default 1024)")
    p.add_argument("--seed", type=int, default=0)


def random_layer(cfg, n_local: int, device, seed: int):
    """MoEWeights for experts [0, n_local) with random MXFP4 / FP8 / bf16 values, drawn on `device`."""
    from mini.ops.linear import QWeight
    from mini.ops.moe import MoEWeights
    g = torch.Generator(device=device).manual_seed(seed)
    D, I, E, B = cfg.dim, cfg.moe_inter_dim, cfg.n_routed_experts, cfg.fp8_block

    def mxfp4(n, k):
        data = torch.randint(0, 256, (n_local, n, k // 2), generator=g, device=device, dtype=torch.uint8)
        # scale 2^-6 or 2^-7: uniform codes (|v| <= 6) then give weights of about 1/sqrt(k) in size
        scale = torch.randint(120, 122, (n_local, n, k // 32), generator=g, device=device, dtype=torch.uint8)
        return QWeight("mxfp4", data, scale, B)

    def fp8(n, k):
        data = (torch.randn(n, k, generator=g, device=device) * 16).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.full((-(-n // B), -(-k // B)), 127 - 4 - int(math.log2(k)) // 2, dtype=torch.uint8,
                           device=device)
        return QWeight("fp8", data, scale, B)

    return MoEWeights(gate=(torch.randn(E, D, generator=g, device=device) / math.sqrt(D)).bfloat16(),
                      bias=torch.randn(E, generator=g, device=device) * 0.02, bias_vl=None, tid2eid=None,
                      experts=range(0, n_local), w1=mxfp4(I, D), w3=mxfp4(I, D), w2=mxfp4(D, I),
                      shared_w1=fp8(I, D), shared_w3=fp8(I, D), shared_w2=fp8(D, I), swiglu_limit=cfg.swiglu_limit)


def _time(fn, iters: int, warmup: int) -> float:
    """Median ms of fn() over `iters` runs, CUDA events around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        times.append(timed_call(fn, cuda=True)[1])
    return statistics.median(times)


def _timed(ms: dict, name: str, fn, args) -> None:
    """ms[name] = _time(fn), printed at once (a run cut short by a time limit still leaves what it measured)."""
    ms[name] = _time(fn, args.iters, args.warmup)
    print(f"ms_{name}: {ms[name]:.4f}", flush=True)


def run(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("moe-layer needs a CUDA GPU")
    import mini.ops
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.moe_combine import combine
    from mini.kernels.moe_route import plan_routes
    from mini.kernels.mxfp4_grouped_gemm import BLOCK_M
    from mini.ops.backends import moe_gemm
    from mini.ops.moe import fused_gate, gate, gate_unfused, routed, shared

    mini.ops.set_backend("fast")
    cfg = preset(args.preset)
    dev = torch.device("cuda")
    w = random_layer(cfg, args.local_experts, dev, args.seed)
    gemm_lib = moe_gemm() if args.moe_gemm == "auto" else args.moe_gemm
    convert_ms = 0.0
    if gemm_lib == "humming" and not args.only_gate_plan:
        from mini.kernels.humming_experts import warm_up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w.to_humming()
        torch.cuda.synchronize()
        convert_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        expect = args.tokens * cfg.n_activated_experts * args.local_experts // cfg.n_routed_experts
        failed = warm_up([(st, t) for st in w.humming for t in _humming_tunings(args, st, expect).values()])
        print(f"humming: experts rewritten in {convert_ms:.0f} ms, kernels ready in {time.perf_counter() - t0:.1f} s"
              + "".join(f"\n  not built: {t}: {e}" for t, e in failed.items()))
    g = torch.Generator(device=dev).manual_seed(args.seed + 1)
    x = torch.randn(args.tokens, cfg.dim, generator=g, device=dev).bfloat16()
    own = x[: args.own_tokens]
    plan_l = cfg.layers[-1]
    torch.cuda.synchronize()
    base_mem = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    weights, ids = gate(x, w, cfg, plan_l)
    tiles = gemm_lib == "triton"  # Humming's GEMMs take expert_offset, not row tiles
    plan = plan_routes(ids, weights, w.experts, BLOCK_M, tiles)
    n_local = int(((ids >= w.experts.start) & (ids < w.experts.stop)).sum())
    ms = {}
    _timed(ms, "gate", lambda: gate(x, w, cfg, plan_l), args)
    _timed(ms, "route_plan", lambda: plan_routes(ids, weights, w.experts, BLOCK_M, tiles), args)
    extra = {}
    if args.old_gate_plan:
        extra.update(_old_gate_plan(args, cfg, w, x, plan_l, weights, ids, ms))
    if args.gate_configs:
        extra.update(_gate_configs(args, cfg, w, x, ids, ms))
    for pairs in args.route_blocks:
        _timed(ms, f"route_plan_block{pairs}",
               lambda: plan_routes(ids, weights, w.experts, BLOCK_M, tiles, pairs), args)  # noqa: B023
        other = plan_routes(ids, weights, w.experts, BLOCK_M, tiles, pairs)
        extra[f"route_plan_block{pairs}_bit_equal"] = float(all(torch.equal(getattr(other, f), getattr(plan, f))
                                                                for f in ROUTE_PLAN_FIELDS))
    for n in args.gate_sweep_tokens:
        xn = x[:n]
        _timed(ms, f"gate_fused_t{n}", lambda: fused_gate(xn, w, cfg), args)  # noqa: B023
        _timed(ms, f"gate_unfused_t{n}", lambda: gate_unfused(xn, w, cfg, plan_l), args)  # noqa: B023
    if args.only_gate_plan:
        definition = {"preset": args.preset, "tokens": args.tokens, "local_experts": args.local_experts,
                      "topk": cfg.n_activated_experts, "dim": cfg.dim, "experts": cfg.n_routed_experts,
                      "route_tiles": tiles, "dtype": "bfloat16", "seed": args.seed,
                      "device": torch.cuda.get_device_name()}
        return {"suite": "moe-layer", "definition": definition,
                "metrics": {**{f"ms_{k}": v for k, v in ms.items()}, "local_pairs": n_local, **extra}}
    parts = _humming_parts if gemm_lib == "humming" else _triton_parts
    part_ms, y, part_extra = parts(args, cfg, w, x, plan, ids)
    ms.update(part_ms)
    extra.update(part_extra)
    gemm_ms = sum(v for k, v in ms.items() if k.startswith("gemm_"))
    ms["combine"] = _time(lambda: combine(y, ids, plan.slot_row, w.experts, torch.float32), args.iters, args.warmup)
    ms["routed"] = _time(lambda: routed(x, w, cfg, weights, ids), args.iters, args.warmup)
    ms["shared_own_tokens"] = _time(lambda: shared(own, w), args.iters, args.warmup)
    # the same FLOPs as one dense bf16 GEMM through cuBLAS (what dequantized weights without grouping would cost)
    a = torch.randn(n_local, cfg.dim, device=dev).bfloat16()
    b = torch.randn(cfg.dim, 3 * cfg.moe_inter_dim, device=dev).bfloat16()
    ms["dense_bf16_same_flops"] = _time(lambda: a @ b, args.iters, args.warmup)
    del a, b
    ms["layer"] = _time(lambda: (routed(x, w, cfg, *gate(x, w, cfg, plan_l)), shared(own, w)),
                        args.iters, args.warmup)
    peak_gb = (torch.cuda.max_memory_allocated() - base_mem) / 2**30

    out = routed(x, w, cfg, weights, ids)
    D, I = cfg.dim, cfg.moe_inter_dim
    flops = 2 * n_local * (2 * D * I + I * D)
    weight_bytes = sum(t.numel() for q in (w.w1, w.w3, w.w2) for t in (q.data, q.scale))
    floor_ms = max(flops / (args.peak_tflops * 1e9), weight_bytes / 4.26e9)
    metrics = {f"ms_{k}": v for k, v in ms.items()}
    metrics.update({
        "local_pairs": n_local,
        "routed_gemm_tflops": flops / (gemm_ms * 1e9),
        "convert_ms": convert_ms,
        "routed_tflops": flops / (ms["routed"] * 1e9),
        "routed_floor_ms": floor_ms,
        "routed_over_floor": ms["routed"] / floor_ms,
        "peak_mem_gb_above_weights": peak_gb,
        "checksum": float(out.double().sum()),
        "checksum_abs": float(out.double().abs().sum()),
        **extra,
    })
    if args.check_tokens:
        n = min(args.check_tokens, args.tokens)
        mini.ops.set_backend("reference")
        try:
            ref = routed(x[:n], w, cfg, weights[:n], ids[:n])
        finally:
            mini.ops.set_backend("fast")
        metrics["check_rel_err"] = float((out[:n] - ref).norm() / ref.norm())
        metrics["check_equal_fraction"] = float((out[:n] == ref).float().mean())
    if args.sweep and gemm_lib == "triton":
        metrics.update(_sweep(args, cfg, w, fp8_act_quant(x, cfg.fp8_block), ids, weights))
    if args.humming_tiles and gemm_lib == "humming":
        metrics.update(_humming_tiles(args, cfg, w, x, plan, ids))
    definition = {"preset": args.preset, "moe_gemm": gemm_lib, "tokens": args.tokens, "own_tokens": args.own_tokens,
                  "local_experts": args.local_experts, "topk": cfg.n_activated_experts, "dim": D, "inter": I,
                  "dtype": "bfloat16", "seed": args.seed, "device": torch.cuda.get_device_name()}
    return {"suite": "moe-layer", "definition": definition, "metrics": metrics}


def _old_gate_plan(args, cfg, w, x, plan_l, weights, ids, ms: dict) -> dict:
    """Adds the previous gate and routing plan's ms to `ms`; returns how their results agree with the new ones:
    the fraction of equal expert ids, the largest relative weight difference where the ids are equal (the logits'
    summation order differs), and 1.0 when the two plans are bit-identical in every field (else 0.0)."""
    from mini.kernels.moe_route import plan_routes, plan_routes_torch
    from mini.kernels.mxfp4_grouped_gemm import BLOCK_M
    from mini.ops.moe import gate_unfused
    _timed(ms, "gate_unfused", lambda: gate_unfused(x, w, cfg, plan_l), args)
    old_w, old_ids = gate_unfused(x, w, cfg, plan_l)
    same = ids == old_ids
    res = {"gate_ids_equal_fraction": float(same.float().mean()),
           "gate_weight_max_rel_diff": float(((weights - old_w).abs() / old_w.abs()).masked_fill(~same, 0).max())}
    for tiles in (True, False):
        tag = "tiles" if tiles else "no_tiles"
        _timed(ms, f"route_plan_{tag}",
               lambda: plan_routes(ids, weights, w.experts, BLOCK_M, tiles), args)  # noqa: B023
        _timed(ms, f"route_plan_torch_{tag}",
               lambda: plan_routes_torch(ids, weights, w.experts, BLOCK_M, tiles), args)  # noqa: B023
        new, old = plan_routes(ids, weights, w.experts, BLOCK_M, tiles), plan_routes_torch(ids, weights, w.experts,
                                                                                          BLOCK_M, tiles)
        res[f"route_plan_{tag}_bit_equal"] = float(all(torch.equal(getattr(new, f), getattr(old, f))
                                                       for f in ROUTE_PLAN_FIELDS))
    return res


def _gate_sweep():
    """The gate kernel's CONFIGS and variants around them: other tiles, chunk lengths (`steps`), the chunk as a
    pipelined loop, and no promotion (steps=1, for the time the promotion costs)."""
    from mini.kernels.moe_gate import CONFIGS, GateConfig as G
    return CONFIGS + (G(32, 32, 4, 3), G(32, 64, 4, 2), G(32, 32, 4, 2, steps=4), G(32, 16, 4, 4, steps=4),
                      G(64, 64, 8, 3, steps=4, inner_loop=True), G(64, 64, 8, 3, steps=8, inner_loop=True),
                      G(32, 64, 4, 3, steps=4, inner_loop=True), G(32, 64, 4, 3, steps=8, inner_loop=True),
                      G(32, 64, 4, 3, steps=16, inner_loop=True), G(64, 32, 8, 4, steps=8, inner_loop=True),
                      G(32, 32, 4, 4, steps=8, inner_loop=True), G(64, 32, 8, 4, steps=1), G(32, 32, 4, 2, steps=1))


def _gate_configs(args, cfg, w, x, ids, ms: dict) -> dict:
    """Adds the fused gate kernel's ms under each config of `_gate_sweep` to `ms`, at all tokens and at the first
    4,096 (one EP4 rank's own); returns per config the fraction of expert ids equal to the default config's
    (different K steps sum in a different order: near-ties may flip) and the max |logit error| against float64
    over 1,024 rows, also as a multiple of the IEEE fp32 GEMM's (the reference's logits)."""
    from mini.kernels.moe_gate import gate_topk
    from mini.ops.moe import fused_gate
    res = {}
    xs = x[:1024]
    exact = xs.double() @ w.gate.double().t()
    err_fp32 = float((xs.float() @ w.gate.float().t() - exact).abs().max())
    res["gate_fp32_gemm_logit_err"] = err_fp32
    for c in _gate_sweep():
        name = f"gate_m{c.BM}_k{c.BK}_w{c.num_warps}_s{c.num_stages}_c{c.steps}{'_loop' if c.inner_loop else ''}"
        fn = lambda: fused_gate(x, w, cfg, config=c)  # noqa: E731,B023
        try:
            res[name + "_ids_equal_fraction"] = float((fn()[1] == ids).float().mean())
            logits = gate_topk(xs, w.gate, w.bias, cfg.n_activated_experts, 1.0, debug=True, config=c)[2]
            err = float((logits.double() - exact).abs().max())
            res[name + "_logit_err"], res[name + "_logit_err_vs_fp32"] = err, err / err_fp32
            _timed(ms, name, fn, args)
            _timed(ms, name + "_t4096", lambda: fused_gate(x[:4096], w, cfg, config=c), args)  # noqa: B023
        except Exception as e:  # a config that does not build here (shared memory, registers) is skipped
            print(f"{name}: skipped ({type(e).__name__}: {str(e)[:160]})")
    return res


def _triton_parts(args, cfg, w, x, plan, ids) -> tuple[dict, torch.Tensor, dict]:
    """ms of our kernels' parts, the expert outputs by sorted row, no extra metrics."""
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.mxfp4_grouped_gemm import grouped_down, grouped_swiglu
    xq = fp8_act_quant(x, cfg.fp8_block)
    h = grouped_swiglu(xq, plan, w.w1, w.w3, w.swiglu_limit, cfg.fp8_block)
    ms = {"act_quant": _time(lambda: fp8_act_quant(x, cfg.fp8_block), args.iters, args.warmup),
          "gemm_w13_swiglu": _time(lambda: grouped_swiglu(xq, plan, w.w1, w.w3, w.swiglu_limit, cfg.fp8_block),
                                   args.iters, args.warmup),
          "gemm_w2": _time(lambda: grouped_down(h, plan, w.w2), args.iters, args.warmup)}
    return ms, grouped_down(h, plan, w.w2), {}


def _humming_tunings(args, stack, expect: int) -> dict[str, str]:
    """Tile configs (JSON) by name: the heuristic's ("default") and the --humming-tiles variants of it."""
    from mini.kernels.humming_experts import tuning_for
    base = tuning_for(stack, expect)
    res = {"default": base}
    for v in args.humming_tiles:
        bm, stages = (int(p) for p in v.split("x"))
        t = json.loads(base)
        t["block_shape"][0] = t["warp_shape"][0] = bm
        t["num_stages"] = stages
        res[f"m{bm}_s{stages}"] = json.dumps(t)
    return res


def _humming_steps(cfg, w, x, plan, ids):
    """One pass of the Humming path's steps, keeping each output: (expected rows, local row count on the device,
    gathered + quantized rows, w13 output, SwiGLU output, w2 output)."""
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.humming_experts import grouped_gemm
    from mini.kernels.mxfp4_grouped_gemm import swiglu_rows
    w13, w2 = w.humming
    expect = ids.numel() * len(w.experts) // cfg.n_routed_experts
    n_valid = plan.expert_offset[-1:]
    xs = fp8_act_quant(x, cfg.fp8_block, rows=plan.token, n_valid=n_valid)
    gu = grouped_gemm(xs, w13, plan.expert_offset, expect)
    h = swiglu_rows(gu[:, :w13.n // 2], gu[:, w13.n // 2:], plan.weight, n_valid, w.swiglu_limit, cfg.fp8_block)
    return expect, n_valid, xs, gu, h, grouped_gemm(h, w2, plan.expert_offset, expect)


def _humming_parts(args, cfg, w, x, plan, ids) -> tuple[dict, torch.Tensor, dict]:
    """ms of the Humming path's parts, the expert outputs by sorted row, no extra metrics."""
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.humming_experts import grouped_gemm
    from mini.kernels.mxfp4_grouped_gemm import swiglu_rows
    (w13, w2), off = w.humming, plan.expert_offset
    expect, n_valid, xs, gu, h, y = _humming_steps(cfg, w, x, plan, ids)
    I = w13.n // 2
    ms = {"act_quant": _time(lambda: fp8_act_quant(x, cfg.fp8_block, out=xs, rows=plan.token, n_valid=n_valid),
                             args.iters, args.warmup),
          "gemm_w13": _time(lambda: grouped_gemm(xs, w13, off, expect, out=gu), args.iters, args.warmup),
          "swiglu": _time(lambda: swiglu_rows(gu[:, :I], gu[:, I:], plan.weight, n_valid, w.swiglu_limit,
                                              cfg.fp8_block, out=h), args.iters, args.warmup),
          "gemm_w2": _time(lambda: grouped_gemm(h, w2, off, expect, out=y), args.iters, args.warmup)}
    return ms, y, {}


def _humming_tiles(args, cfg, w, x, plan, ids) -> dict:
    """ms of the GEMMs under the --humming-tiles configs and their largest difference from the default config's
    output (~0: the same dot products in fp32; a config whose difference is large is wrong, not fast). Run last:
    a hand-made config that faults leaves the CUDA context unusable."""
    from mini.kernels.humming_experts import grouped_gemm
    w13, w2 = w.humming
    expect, n_valid, xs, gu, h, y = _humming_steps(cfg, w, x, plan, ids)
    extra, nv = {}, int(n_valid)
    for name, a, st, ref in (("w13", xs, w13, gu), ("w2", h, w2, y)):
        for tag, tuning in _humming_tunings(args, st, expect).items():
            if tag == "default":
                continue
            try:
                o = grouped_gemm(a, st, plan.expert_offset, expect, tuning=tuning)
                extra[f"tiles_{name}_{tag}_max_abs_diff"] = float((o[:nv].float() - ref[:nv].float()).abs().max())
                extra[f"ms_tiles_{name}_{tag}"] = _time(
                    lambda: grouped_gemm(a, st, plan.expert_offset, expect, out=o, tuning=tuning),  # noqa: B023
                    args.iters, args.warmup)
            except Exception as e:  # not built or failed at launch: skipped, as the Triton sweep does
                print(f"tiles {name} {tag}: skipped ({type(e).__name__}: {str(e)[:160]})")
    return extra


def _sweep(args, cfg, w, xq, ids, weights) -> dict:
    """ms of each config, and its relative difference from the default config's output (the same values up to
    the summation order: a config whose difference is large is wrong, not fast)."""
    from mini.kernels.moe_combine import combine
    from mini.kernels.moe_route import plan_routes
    from mini.kernels.mxfp4_grouped_gemm import BLOCK_M, grouped_down, grouped_swiglu

    def combined(y, plan):  # per-token results do not depend on the row order of the plan
        return combine(y, ids, plan.slot_row, w.experts, torch.float32)
    plan0 = plan_routes(ids, weights, w.experts, BLOCK_M)
    h0 = grouped_swiglu(xq, plan0, w.w1, w.w3, w.swiglu_limit, cfg.fp8_block)
    ref = combined(grouped_down(h0, plan0, w.w2), plan0)
    res = {}
    for which, configs in SWEEP.items():
        for bm, bn, bk, nw, ns, swap in configs:
            plan = plan_routes(ids, weights, w.experts, bm)
            conf = dict(BN=bn, BK=bk, num_warps=nw, num_stages=ns, SWAP_AB=swap)
            name = f"sweep_{which}_m{bm}_n{bn}_k{bk}_w{nw}_s{ns}" + ("_swap" if swap else "")
            try:
                if which == "swiglu":
                    fn = lambda: grouped_swiglu(xq, plan, w.w1, w.w3, w.swiglu_limit, cfg.fp8_block,  # noqa: E731
                                                config=conf)
                else:
                    h = grouped_swiglu(xq, plan, w.w1, w.w3, w.swiglu_limit, cfg.fp8_block)
                    fn = lambda: grouped_down(h, plan, w.w2, config=conf)  # noqa: E731
                out = fn()
                y = combined(out if which == "down" else grouped_down(out, plan, w.w2), plan)
                res[name + "_rel_diff"] = float((y - ref).norm() / ref.norm())
                res[name] = _time(fn, args.iters, 2)
            except Exception as e:  # a config that does not fit (shared memory, registers) is skipped
                print(f"{name}: skipped ({type(e).__name__}: {str(e)[:160]})")
    return res
