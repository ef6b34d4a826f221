"""`moe-layer`: one V4.1-Flash MoE layer as one EP4 rank runs it: the gate over the tokens an all-gather brings
(16,384 = 4 ranks x 4,096), this rank's 96 local experts over the pairs routed to them, the combine; and the
shared expert over the rank's own 4,096 tokens. Random weights drawn on the GPU (uniform E2M1 codes, E8M0 scales
near 2^-6), random bf16 activations.

`--moe-gemm` picks the routed experts' GEMM library (auto = what `mini.ops.backends.moe_gemm` resolves: Humming
where it imports on SM90, else Triton); Humming rewrites the experts into its layout first (`to_humming`).

Metrics: ms per part and in total (CUDA events, median of --iters after --warmup), achieved TFLOP/s of the routed
GEMMs against the floor (their FLOPs at the measured bf16 GEMM peak, `--peak-tflops`), peak memory, an output
checksum, and the relative error of the fast routed output against the reference (`mini.ops.moe` with the
reference backend) on a sample of tokens. `ms_gate` / `ms_route_plan` time what the fast path runs: the fused gate
kernel (mini/kernels/moe_gate.py) and the Triton routing plan (mini/kernels/moe_route.py).

The same layer with studies added (tile sweeps, the previous gate and plan, the gate's configs, Humming's tiles):
tools/moe_layer_studies.py.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from mini.config import preset
from mini.testing.suites import timed_call


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--tokens", type=int, default=16384, help="tokens the gate and the local experts see")
    p.add_argument("--own-tokens", type=int, default=4096, help="tokens the shared expert sees (the rank's own)")
    p.add_argument("--local-experts", type=int, default=96)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=804.0, help="bf16 dense GEMM peak for the floor")
    p.add_argument("--check-tokens", type=int, default=256, help="tokens compared against the reference (0: off)")
    p.add_argument("--moe-gemm", choices=["auto", "humming", "triton"], default="auto",
                   help="routed experts' GEMM library (auto: mini.ops.backends.moe_gemm)")
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


def run(args, study=None) -> dict:
    """The suite; `study` (tools/moe_layer_studies.py) adds its timings at three points: the Humming tile configs
    built in the warm-up, after the gate and routing plan (and may stop there), after the layer."""
    if not torch.cuda.is_available():
        raise SystemExit("moe-layer needs a CUDA GPU")
    import mini.ops
    from mini.kernels.moe_combine import combine
    from mini.kernels.moe_route import plan_routes
    from mini.kernels.mxfp4_grouped_gemm import BLOCK_M
    from mini.ops.backends import moe_gemm
    from mini.ops.moe import gate, routed, shared

    mini.ops.set_backend("fast")
    cfg = preset(args.preset)
    dev = torch.device("cuda")
    w = random_layer(cfg, args.local_experts, dev, args.seed)
    gemm_lib = moe_gemm() if args.moe_gemm == "auto" else args.moe_gemm
    convert_ms = 0.0
    only_gate_plan = study is not None and study.only_gate_plan
    if gemm_lib == "humming" and not only_gate_plan:
        from mini.kernels.humming_experts import tuning_for, warm_up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w.to_humming()
        torch.cuda.synchronize()
        convert_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        expect = args.tokens * cfg.n_activated_experts * args.local_experts // cfg.n_routed_experts
        tunings = study.humming_tunings if study is not None else lambda st, n: {"default": tuning_for(st, n)}
        failed = warm_up([(st, t) for st in w.humming for t in tunings(st, expect).values()])
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
    extra = study.after_gate(cfg, w, x, plan_l, weights, ids, plan, tiles, ms) if study is not None else {}
    if only_gate_plan:  # the study's gate-and-plan timing ends here
        return study.gate_plan_result(cfg, tiles, ms, n_local, extra)
    parts = _humming_parts if gemm_lib == "humming" else _triton_parts
    part_ms, y, part_extra = parts(args, cfg, w, x, plan, ids)
    ms.update(part_ms)
    extra.update(part_extra)
    gemm_ms = sum(v for k, v in ms.items() if k.startswith("gemm_"))
    ms["combine"] = _time(lambda: combine(y, ids, plan.slot_row, w.experts, torch.float32), args.iters, args.warmup)
    ms["routed"] = _time(lambda: routed(x, w, cfg, weights, ids), args.iters, args.warmup)
    ms["shared_own_tokens"] = _time(lambda: shared(own, w), args.iters, args.warmup)
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
    if study is not None:
        metrics.update(study.after_layer(gemm_lib, cfg, w, x, plan, ids, weights))
    definition = {"preset": args.preset, "moe_gemm": gemm_lib, "tokens": args.tokens, "own_tokens": args.own_tokens,
                  "local_experts": args.local_experts, "topk": cfg.n_activated_experts, "dim": D, "inter": I,
                  "dtype": "bfloat16", "seed": args.seed, "device": torch.cuda.get_device_name()}
    return {"suite": "moe-layer", "definition": definition, "metrics": metrics}


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


