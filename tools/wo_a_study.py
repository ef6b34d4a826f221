"""V4.1's block-diagonal output projection wo_a at decode rows (mini.ops.linear.grouped_linear): cuBLAS's batched
GEMM on the bf16 copy (every row count but one), at one row the grouped FP8 read of the checkpoint's bytes (half
the copy's), and at every row count the FP8 read's Gluon build in each candidate tiling (x as it is). (Report 040
also timed the grouped GEMV on the copy: 6-12% slower than the bmm at 1-16 rows.)

Each case replays ROTATE calls in one CUDA graph, each on its own weight copy (so the weights come from HBM, as in
a step where 40 layers' wo_a pass through L2), and prints us per call, GB/s of the bytes the call must read (the
weight's; x and y are ~0.1% of them) against the card's nominal bandwidth, and whether each output is within the
GEMV's bound of the exact products' sums.

    python3 tools/wo_a_study.py [--rows 1,2,6,16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from looped_rows_study import nominal_tbs  # noqa: E402

from mini.bench.kernels import _bench_graph  # noqa: E402

G, R, K = 8, 1024, 4096  # V4.1-Flash: 8 groups of 8 heads x 512, o_lora_rank 1024
ROTATE = 8  # 8 x 67 MB of bf16 copies: far past the 50-60 MB L2


def weights(dev: str, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """ROTATE (e4m3 [G R, K], E8M0 bytes [G R / 32, K / 32], bf16 copy [G, R, K]) of realistic magnitudes."""
    from mini.formats import dequant_fp8, quantize_fp8
    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for _ in range(ROTATE):
        q, s = quantize_fp8(torch.randn(G * R, K, device=dev, generator=g) * 0.02, 32)
        s = s.view(torch.uint8)
        out.append((q, s, dequant_fp8(q, s, 32, torch.bfloat16).view(G, R, K)))
    return out


def within_bound(y: torch.Tensor, x: torch.Tensor, copy: torch.Tensor) -> bool:
    """tests/kernels/test_gemv.py's bound: a bf16 rounding of the fp32 sums plus 1e-5 of the sum of |products|."""
    xs = x.view(x.shape[0], G, K).double()
    ref = torch.einsum("tgd,grd->tgr", xs, copy.double()).flatten(1)
    spread = torch.einsum("tgd,grd->tgr", xs.abs(), copy.double().abs()).flatten(1)
    return bool(((y.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + spread * 1e-5).all())


def run(rows: list[int], dev: str = "cuda") -> dict:
    from mini.kernels.gemv import MMA_CANDIDATES, gemv
    ws = weights(dev)
    tbs = nominal_tbs()
    result = {"device": torch.cuda.get_device_name(), "nominal_tb_s": tbs, "cases": {}}
    for T in rows:
        x = (torch.randn(T, G * K, device=dev) * 2).bfloat16()
        outs = [torch.empty(T, G * R, dtype=torch.bfloat16, device=dev) for _ in ws]

        def bmm():
            for (_, _, c), o in zip(ws, outs):
                torch.bmm(x.view(T, G, K).transpose(0, 1), c.transpose(1, 2), out=o.view(T, G, R).transpose(0, 1))

        def gemv_fp8(config=None):
            def call():
                for (q, s, _), o in zip(ws, outs):
                    gemv(x, q, out=o, scale=s, w_block=32, groups=G, config=config)
            return call
        paths = {"cublas_bmm": (bmm, 2)} | ({"gemv_fp8": (gemv_fp8(), 1)} if T == 1 else {})
        paths |= {f"gluon {label}": (gemv_fp8(cfg), 1) for label, cfg in MMA_CANDIDATES.items() if cfg.gluon_k_width}
        case = {}
        for name, (fn, bytes_per_value) in paths.items():
            for o in outs:
                o.fill_(float("nan"))
            us = _bench_graph(fn) * 1e3 / ROTATE
            gbs = G * R * K * bytes_per_value / (us * 1e-6) / 1e9
            ok = all(within_bound(o, x, c) for (_, _, c), o in zip(ws, outs))
            case[name] = {"us": us, "GB_s": gbs, "frac_nominal": gbs / (tbs * 1e3), "within_bound": ok}
            print(f"wo_a T={T:2d} {name:26s} {us:7.2f} us  {gbs:6.0f} GB/s ({gbs / (tbs * 1e3):.2f} of nominal)  "
                  f"bound {'ok' if ok else 'MISSED'}", flush=True)
        result["cases"][f"T{T}"] = case
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,6,16")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = run([int(v) for v in args.rows.split(",") if v])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(c["within_bound"] for case in result["cases"].values() for c in case.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
