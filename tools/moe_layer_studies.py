"""Studies of one MoE layer at real shape beside the standing suite (`mini bench moe-layer`, mini/bench/moe_layer.py),
which runs here with them added; results and their questions: docs/kernels.md (MoE), phases `moe_layer`, `gate`
and `humming` of scripts/gpu.sh.

* `--old-gate-plan`: the previous gate and routing plan in the same process (`gate_unfused`: cuBLAS logits + torch
  epilogue; `plan_routes_torch`: torch sort), timed, and how their results agree with the fused ones;
  `--gate-configs` times the gate kernel's configs; `--gate-sweep-tokens T ...` the fused and the unfused gate on
  the first T tokens (the dispatch threshold); `--route-blocks` the routing plan at other pairs per program;
  `--only-gate-plan` stops there (no experts' GEMMs).
* `--sweep`: the Triton grouped GEMMs under several tile configs; `--humming-tiles BMxSTAGES ...`: Humming's GEMMs
  with its heuristic config changed to these row tiles and pipeline depths.
* always (after the layer): `ms_dense_bf16_same_flops`, the local pairs' FLOPs as one dense bf16 GEMM (cuBLAS).

    python3 tools/moe_layer_studies.py --only-gate-plan --old-gate-plan --gate-configs --route-blocks 256 512
    python3 tools/moe_layer_studies.py --moe-gemm humming --humming-tiles 128x4 192x4
    python3 tools/moe_layer_studies.py --sweep
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import moe_layer  # noqa: E402
from mini.bench.moe_layer import _humming_steps, _time, _timed  # noqa: E402
from mini.testing.suites import run_as_script  # noqa: E402

SWEEP = {  # (block_m, BN, BK, num_warps, num_stages, SWAP_AB); results: docs/kernels.md (MoE)
    # 256-row tiles decode each weight tile for twice the rows (the decode, not the MMA, is the limit today)
    "swiglu": [(128, 64, 64, 4, 4, False), (128, 128, 64, 8, 4, False), (128, 64, 64, 4, 4, True),
               (256, 64, 64, 8, 3, False), (256, 64, 64, 8, 3, True)],
    "down": [(128, 128, 64, 8, 4, False), (128, 128, 64, 8, 4, True), (256, 128, 64, 8, 3, False),
             (256, 64, 64, 8, 4, False), (256, 128, 64, 8, 3, True)],
}
ROUTE_PLAN_FIELDS = ("token", "weight", "slot_row", "expert_offset", "tile_expert", "tile_start", "tile_end")


def add_args(p) -> None:
    moe_layer.add_args(p)
    p.add_argument("--sweep", action="store_true", help="also time the Triton grouped GEMMs under several tile configs")
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


class Studies:
    """The hooks `moe_layer.run(args, study)` calls, each adding what its flags ask for."""

    def __init__(self, args):
        self.args = args
        self.only_gate_plan = args.only_gate_plan

    def humming_tunings(self, stack, expect: int) -> dict[str, str]:
        return _humming_tunings(self.args, stack, expect)

    def after_gate(self, cfg, w, x, plan_l, weights, ids, plan, tiles, ms: dict) -> dict:
        from mini.kernels.moe_route import plan_routes
        from mini.kernels.mxfp4_grouped_gemm import BLOCK_M
        from mini.ops.moe import fused_gate, gate_unfused
        args = self.args
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
        return extra

    def gate_plan_result(self, cfg, tiles: bool, ms: dict, n_local: int, extra: dict) -> dict:
        """--only-gate-plan: the suite's result after the gate and the routing plan."""
        args = self.args
        definition = {"preset": args.preset, "tokens": args.tokens, "local_experts": args.local_experts,
                      "topk": cfg.n_activated_experts, "dim": cfg.dim, "experts": cfg.n_routed_experts,
                      "route_tiles": tiles, "dtype": "bfloat16", "seed": args.seed,
                      "device": torch.cuda.get_device_name()}
        return {"suite": "moe-layer", "definition": definition,
                "metrics": {**{f"ms_{k}": v for k, v in ms.items()}, "local_pairs": n_local, **extra}}

    def after_layer(self, gemm_lib: str, cfg, w, x, plan, ids, weights) -> dict:
        from mini.kernels.fp8_act_quant import fp8_act_quant
        args = self.args
        # the local pairs' FLOPs as one dense bf16 GEMM through cuBLAS (dequantized weights without grouping)
        n_local = int(((ids >= w.experts.start) & (ids < w.experts.stop)).sum())
        a = torch.randn(n_local, cfg.dim, device=x.device).bfloat16()
        b = torch.randn(cfg.dim, 3 * cfg.moe_inter_dim, device=x.device).bfloat16()
        metrics = {"ms_dense_bf16_same_flops": _time(lambda: a @ b, args.iters, args.warmup)}
        del a, b
        if args.sweep and gemm_lib == "triton":
            metrics.update(_sweep(args, cfg, w, fp8_act_quant(x, cfg.fp8_block), ids, weights))
        if args.humming_tiles and gemm_lib == "humming":
            metrics.update(_humming_tiles(args, cfg, w, x, plan, ids))
        return metrics


def run(args) -> dict:
    return moe_layer.run(args, Studies(args))


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


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__name__, "moe-layer", "one MoE layer at real shape, with studies", argv,
                         "tools/moe_layer_studies.py")


if __name__ == "__main__":
    raise SystemExit(main())
