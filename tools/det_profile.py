"""Where the deterministic mode's cost goes on rank4 (issue 17 item 4): one model build, then

1. the rank4 step per stage (mini.testing.stage_times' stages) and its 20 costliest GPU kernels in each of `--modes`
   (default: the mode off, then on; det-triton: on with MINI_DET_SPARSE_ATTN=triton), side by side;
2. every GEMM the step sends to aten under the mode (op, dtype, batch, M, N, K, operand layouts, calls per step),
   recorded by a dispatch mode over one step;
3. each of those GEMMs timed alone on random data: cuBLAS (the mode off) vs the batch-invariant kernel at its
   per-dtype default config, TFLOP/s and ms per step (x calls);
4. a tile sweep: per weight shape (dtype, N, K), at the row count where it does the most work, each candidate
   fixed config of mini/kernels/batch_invariant.py timed, the fastest printed with what it would save per step,
   and the table as `TUNED` entries (a config keyed by (dtype, N, K) is never chosen by M: invariance holds).

5. with --ab-rounds R: R interleaved rounds of every mode (one build, --ab-steps timed steps each per round), the
   A/B that the mode's cost is read from (issue 17: det at most 1.10x default);
6. --variants-only (no model): the kernel variants of batch_invariant.py (VARIANTS: TMA, persistent, flattened
   persistent, fp32 small-row tiles) at the rank4 GEMM shapes (RANK4_GEMMS), timed and compared bit for bit with
   the current kernel.

`python3 tools/det_profile.py --out DIR [--modes ...] [--gemms none|bench|sweep] [--ab-rounds R] [rank4 args]`
(scripts/gpu.sh phases det_profile, det_final, det_gemm); DIR/det_profile.json holds everything printed.
On a CPU (e.g. `--preset tiny-v4.1 --device cpu --tokens 64`) it runs 1, 2 and 5.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mini.ops  # noqa: E402
from mini.bench import rank4  # noqa: E402
from mini.testing.rank_step import time_steps  # noqa: E402
from mini.testing.stage_times import report, staged  # noqa: E402

# candidate fixed configs of the sweep: (BM, BN, BK, num_warps, num_stages), GROUP_M 8
CANDIDATES = {
    torch.bfloat16: [(64, 128, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                     (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
                     (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 128, 4, 3), (64, 128, 32, 4, 4),
                     # below one warpgroup's 64 rows: mma.sync rather than wgmma (same bits or not?)
                     (16, 64, 64, 4, 4), (32, 128, 64, 4, 4)],
    torch.float32: [(64, 64, 32, 4, 2), (128, 64, 32, 8, 2), (64, 128, 32, 8, 2), (32, 64, 32, 4, 2),
                    (64, 64, 16, 4, 3)],
}
MAX_BENCHED, MAX_SWEPT = 25, 12  # GEMM shapes timed / weight shapes swept, the most work per step first
SMALL_M = 64  # the sweep also times each config at this many rows (decode steps run the same weights)


class GemmShapes(TorchDispatchMode):
    """Counts the aten GEMM calls (mm, addmm, bmm and their overloads) by shape and operand layout."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # under inference mode composite ops (matmul, linear, einsum) reach the mode whole: decompose them in it
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        op = func.overloadpacket.__name__
        if op in ("mm", "addmm", "bmm"):
            a, b = (args[1], args[2]) if op == "addmm" else (args[0], args[1])
            bt = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            key = (op, str(a.dtype).replace("torch.", ""), str(out.dtype).replace("torch.", ""), bt, m, n, k,
                   "T" if a.stride(-1) != 1 else "N", "T" if b.stride(-1) != 1 else "N")
            self.seen[key] += 1
        return out


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def top_kernels(r, cuda: bool, n: int = 20) -> list[dict]:
    """The n kernels (or CPU ops) with the most self time in one step."""
    acts = [torch.profiler.ProfilerActivity.CUDA] if cuda else [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        r.step()
        _sync(cuda)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total
        rows.append({"name": e.key[:90], "ms": t / 1e3, "calls": e.count})
    rows.sort(key=lambda x: -x["ms"])
    return rows[:n]


# --modes: the mode off; on (FlashMLA for multi-token chunks, the mode's default); on with every query on our
# Triton attention kernel (MINI_DET_SPARSE_ATTN=triton). "det-flashmla" is "det" (its name before FlashMLA became
# the default)
MODES = ("default", "det", "det-triton", "det-flashmla")


def set_mode(r, mode: str) -> None:
    """Switches the process to `mode` between two steps of the same build."""
    from mini.ops import attention
    if mode not in MODES:
        raise SystemExit(f"--modes: unknown mode {mode!r}; known: {MODES}")
    mini.ops.set_deterministic(mode != "default")
    attention.DET_SPARSE_ATTN = "triton" if mode == "det-triton" else "flashmla"
    getattr(r.batch, "_layouts", {}).clear()  # a reused batch's row lists were built under the previous mode


def profile_mode(r, mode: str, args, cuda: bool) -> dict:
    set_mode(r, mode)
    for _ in range(args.warmup):
        r.step()
    _sync(cuda)
    plain = time_steps(r, args.steps)
    with staged(cuda) as timer:
        timed = time_steps(r, args.profile_steps)
        totals = timer.totals()
    return {"mode": mode, "deterministic": mode != "default", "step_ms": plain,
            "median_step_ms": statistics.median(plain),
            "stages_ms_per_step": report(totals, statistics.mean(timed), len(timed)),
            "top_kernels": top_kernels(r, cuda)}


def ab_rounds(r, modes: list[str], rounds: int, steps: int, cuda: bool) -> dict:
    """Interleaved A/B: `rounds` rounds, each running every mode in turn (one untimed step after the switch, then
    `steps` timed ones), so that a drift of the machine (clocks, temperature) over the run falls on every mode
    alike. Per mode: every timed step, the median; per other mode: the median of its per-round ratio to the
    first mode's median of the same round."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}
    for _ in range(rounds):
        med = {}
        for m in modes:
            set_mode(r, m)
            r.step()
            _sync(cuda)
            t = time_steps(r, steps)
            times[m] += t
            med[m] = statistics.median(t)
        for m in modes[1:]:
            ratios[m].append(med[m] / med[modes[0]])
    return {"rounds": rounds, "steps_per_round": steps, "step_ms": times,
            "median_step_ms": {m: statistics.median(t) for m, t in times.items()},
            "median_ratio_to_" + modes[0]: {m: statistics.median(x) for m, x in ratios.items()},
            "ratios_per_round": ratios}


def _operands(key, device):
    op, dt, odt, bt, m, n, k, la, lb = key
    dtype = getattr(torch, dt)
    a = torch.randn(bt, k, m, device=device).to(dtype).transpose(1, 2) if la == "T" else \
        torch.randn(bt, m, k, device=device).to(dtype)
    b = torch.randn(bt, n, k, device=device).to(dtype).transpose(1, 2) if lb == "T" else \
        torch.randn(bt, k, n, device=device).to(dtype)
    add = torch.randn(n, device=device).to(getattr(torch, odt)) if op == "addmm" else None
    return a, b, add, getattr(torch, odt)


def _cublas(key, a, b, add, odt):
    if key[3] > 1 or key[0] == "bmm":
        return lambda: torch.bmm(a, b)
    a2, b2 = a[0], b[0]
    if add is not None:
        return lambda: torch.addmm(add, a2, b2)
    if odt != a.dtype:
        return lambda: torch.mm(a2, b2, out_dtype=odt)
    return lambda: torch.mm(a2, b2)


def _tflops(key, ms: float) -> float:
    _, _, _, bt, m, n, k, _, _ = key
    return 2 * bt * m * n * k / (ms * 1e-3) / 1e12


def bench_gemms(seen: Counter, device="cuda", sweep: bool = True) -> tuple[list[dict], list[dict]]:
    import triton

    from mini.kernels import batch_invariant as bi

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    rows = []
    by_work = sorted(seen.items(), key=lambda kv: -kv[1] * kv[0][3] * kv[0][4] * kv[0][5] * kv[0][6])
    for key, calls in by_work[:MAX_BENCHED]:
        a, b, add, odt = _operands(key, device)
        cub = bench(_cublas(key, a, b, add, odt))
        default = bench(lambda: bi.bmm(a, b, out_dtype=odt, add=add))
        rows.append({"gemm": key, "calls_per_step": calls, "cublas_ms": cub, "bi_ms": default,
                     "cublas_tflops": _tflops(key, cub), "bi_tflops": _tflops(key, default),
                     "bi_config": str(bi.config_for(a.dtype, key[5], key[6], key[4]))})
    # the sweep: per weight shape, at its row count with the most work per step
    by_weight: dict = {}
    for key, calls in seen.items():
        wk = (key[1], key[5], key[6])
        work = calls * key[3] * key[4]
        if wk not in by_weight or work > by_weight[wk][1]:
            by_weight[wk] = (key, work)
    swept = []
    heavy = sorted(by_weight.items(), key=lambda kv: -kv[1][1] * kv[0][1] * kv[0][2])[:MAX_SWEPT if sweep else 0]
    for (dt, n, k), (key, _) in heavy:
        a, b, add, odt = _operands(key, device)
        small = SMALL_M if key[4] > SMALL_M else None  # the same weight at a decode-sized row count
        want = _cublas(key, a, b, add, odt)().float().reshape(key[3], key[4], key[5])
        default = bi.bmm(a, b, out_dtype=odt, add=add)
        times, times_small, same_bits = {}, {}, {}
        for c in CANDIDATES.get(a.dtype, []):
            cfg = bi.TileConfig(*c)
            try:
                got = bi.bmm(a, b, out_dtype=odt, add=add, config=cfg)
                rel = float((got.float() - want).norm() / want.norm().clamp_min(1e-30))
                if not rel < 1e-2:  # a config that builds but computes something else is not a candidate
                    raise ValueError(f"relative error {rel:.3g} vs cuBLAS")
                # the same bits as the default config: then the tile shape does not enter the sums at all
                same_bits[c] = torch.equal(got, default)
                times[c] = bench(lambda: bi.bmm(a, b, out_dtype=odt, add=add, config=cfg))
                if small:
                    times_small[c] = bench(lambda: bi.bmm(a[:, :small], b, out_dtype=odt, add=add, config=cfg))
            except Exception as e:  # a config the GPU cannot build (shared memory): skipped, named
                times[c] = None
                print(f"  sweep {key}: {c} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        ok = {c: t for c, t in times.items() if t is not None}
        best = min(ok, key=ok.get) if ok else None
        cub = bench(_cublas(key, a, b, add, odt))
        row = {"weight": (dt, n, k), "at": key, "calls_per_step": seen[key], "cublas_ms": cub,
               "times_ms": {str(c): t for c, t in times.items()}, "best": best,
               "best_ms": ok.get(best), "best_tflops": _tflops(key, ok[best]) if best else None,
               "cublas_tflops": _tflops(key, cub), "same_bits_as_default": {str(c): v for c, v in same_bits.items()}}
        found = f"best {best} {row['best_ms']:.4f} ms ({row['best_tflops']:.0f} TFLOP/s)" if best else "no config"
        print(f"  sweep {dt} N={n} K={k} at {key}: {found} vs cuBLAS {cub:.4f} ms ({row['cublas_tflops']:.0f})",
              flush=True)
        print(f"    same bits as the default config: {sorted(c for c, v in same_bits.items() if v)}; "
              f"differ: {sorted(c for c, v in same_bits.items() if not v)}", flush=True)
        if small and times_small:
            sk = key[:4] + (small,) + key[5:]
            cub_s = bench(_cublas(sk, a[:, :small], b, add, odt))
            best_s = min(times_small, key=times_small.get)
            row["small"] = {"m": small, "cublas_ms": cub_s, "times_ms": {str(c): t for c, t in times_small.items()},
                            "best": best_s}
            d0 = times_small.get(CANDIDATES[a.dtype][0])
            print(f"    at M={small}: cuBLAS {cub_s:.4f} ms, default {d0 if d0 is None else round(d0, 4)} ms, "
                  f"prefill-best {best} {times_small.get(best, float('nan')):.4f} ms, best here {best_s} "
                  f"{times_small[best_s]:.4f} ms", flush=True)
        swept.append(row)
    return rows, swept


# the GEMMs of one deterministic rank4 step (H200 at 56388c4, phase det_final): key as GemmShapes records it -> calls
RANK4_GEMMS = {
    ("mm", "bfloat16", "bfloat16", 1, 4096, 512, 5120, "N", "T"): 41,
    ("mm", "bfloat16", "bfloat16", 1, 4096, 1280, 5120, "N", "T"): 40,
    ("mm", "bfloat16", "bfloat16", 1, 4096, 32768, 1280, "N", "T"): 40,
    ("bmm", "bfloat16", "bfloat16", 8, 4096, 1024, 4096, "N", "T"): 40,
    ("mm", "bfloat16", "bfloat16", 1, 4096, 5120, 8192, "N", "T"): 40,
    ("mm", "bfloat16", "bfloat16", 1, 4096, 4608, 5120, "N", "T"): 40,
    ("mm", "bfloat16", "bfloat16", 1, 4096, 5120, 2304, "N", "T"): 40,
    ("mm", "bfloat16", "bfloat16", 1, 4096, 4096, 1280, "N", "T"): 8,
    ("mm", "bfloat16", "bfloat16", 1, 4096, 32, 5120, "N", "T"): 8,
    ("mm", "bfloat16", "float32", 1, 4096, 512, 5120, "N", "T"): 6,
    ("mm", "bfloat16", "bfloat16", 1, 2048, 128, 512, "N", "T"): 3,
    ("mm", "bfloat16", "bfloat16", 1, 4096, 25600, 6144, "N", "T"): 2,
    ("mm", "bfloat16", "bfloat16", 1, 4096, 128, 512, "N", "T"): 1,
    ("mm", "float32", "float32", 1, 1, 129280, 5120, "N", "T"): 1,
}
# the kernel variants of mini/kernels/batch_invariant.py measured by --variants-only: (BM, BN, BK, warps, stages,
# GROUP_M, kernel); BK the dtype's (the sums must stay the current kernel's). (Flattened 128 x 256 tiles need 272 KB
# of shared memory, over the H200's 227: left out)
VARIANTS = {
    torch.bfloat16: [(128, 256, 64, 8, 3, 8, "pointer"),
                     (128, 128, 64, 8, 3, 8, "tma"), (128, 256, 64, 8, 3, 8, "tma"), (256, 128, 64, 8, 3, 8, "tma"),
                     (128, 128, 64, 8, 3, 8, "tma-persistent"),
                     (128, 128, 64, 8, 3, 8, "tma-persistent-flat"), (128, 128, 64, 4, 4, 8, "tma-persistent-flat")],
    torch.float32: [(64, 64, 32, 4, 2, 8, "pointer"), (16, 128, 32, 4, 3, 8, "pointer"),
                    (16, 32, 32, 1, 1, 8, "fma-rows"), (16, 64, 32, 2, 1, 8, "fma-rows"),
                    (16, 128, 32, 4, 1, 8, "fma-rows")],
}
HEAD_ROWS = (1, 16, 64, 256)  # --variants-only runs the fp32 head at these row counts
MAX_VARIANT_SHAPES = 7  # bf16 weight shapes measured, the most work per step first (plus every fp32 one)


def bench_variants(seen: dict, device: str = "cuda") -> list[dict]:
    """Each kernel variant (VARIANTS) at the step's heaviest GEMM shapes: ms and TFLOP/s next to cuBLAS and the
    current kernel (config_for's choice), and whether its fp32 sums are the current kernel's bit for bit (a
    variant that differs must not be used: rows would round differently at other row counts). fp32 calls of few
    rows (the head) are also run at 16 rows, each variant's rows compared with the default 64 x 64 tile's over the
    same rows (and rows 0 and 15 alone): the small-row tile must give a row the bits the large-M tile gives it.
    Variant by variant over every shape, the fp32 ones and the pointer kernel first: a variant that faults the
    GPU (and so every call after it) costs only the variants after it."""
    import triton

    from mini.kernels import batch_invariant as bi

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    f32 = torch.float32
    work = {key: calls * key[3] * key[4] * key[5] * key[6] for key, calls in seen.items()}
    bf16 = sorted((k for k in seen if k[1] == "bfloat16"), key=lambda k: -work[k])[:MAX_VARIANT_SHAPES]
    cases = []  # (shape key as run, calls per step, operands, the current kernel's fp32 sums, row)
    for key in [k for k in seen if k[1] == "float32"] + bf16:
        a, b, add, odt = _operands(key, device)
        # the fp32 head also at the row counts of decode steps (1..256 sequences)
        m_list = [key[4]] if key[1] == "bfloat16" or key[4] > bi.SMALL_ROWS else sorted({key[4], *HEAD_ROWS})
        for m in m_list:
            am = a if m <= a.shape[1] else torch.randn(a.shape[0], m, a.shape[2], device=device).to(a.dtype)
            k_m = key[:4] + (m,) + key[5:]
            want = _cublas(k_m, am, b, add, odt)().float().reshape(key[3], m, key[5])
            # fp32: a row's bits from the large-M tile (what it gets among >= 17 rows)
            cur32 = bi.bmm(am, b, out_dtype=f32, config=bi.CONFIGS[f32] if key[1] == "float32" else None)
            cub = bench(_cublas(k_m, am, b, add, odt))
            cur = bench(lambda: bi.bmm(am, b, out_dtype=odt, add=add))
            row = {"gemm": k_m, "calls_per_step": seen[key], "cublas_ms": cub, "current_ms": cur,
                   "current_config": str(bi.config_for(am.dtype, key[5], key[6], m)), "variants": {}}
            print(f"  shape {k_m} x{seen[key]}: cuBLAS {cub:.4f} ms ({_tflops(k_m, cub):.0f} TFLOP/s), current "
                  f"{row['current_config']} {cur:.4f} ms ({_tflops(k_m, cur):.0f})", flush=True)
            cases.append((k_m, seen[key], (am, b, add, odt, want, cur32), row))
    for dtype in (f32, torch.bfloat16):
        for v in VARIANTS.get(dtype, []):
            cfg = bi.TileConfig(*v)
            print(f"  variant {v}:", flush=True)
            for k_m, _, (am, b, add, odt, want, cur32), row in cases:
                if am.dtype != dtype:
                    continue
                try:
                    got = bi.bmm(am, b, out_dtype=f32, config=cfg)
                    rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
                    if not rel < 1e-2:
                        raise ValueError(f"relative error {rel:.3g} vs cuBLAS")
                    same = torch.equal(got, cur32)
                    if dtype == f32:  # and each row alone
                        m = am.shape[1]
                        same = same and all(torch.equal(bi.bmm(am[:, r:r + 1], b, out_dtype=f32, config=cfg),
                                                        cur32[:, r:r + 1]) for r in (0, m - 1))
                    t = bench(lambda: bi.bmm(am, b, out_dtype=odt, add=add, config=cfg))
                    row["variants"][str(v)] = {"ms": t, "tflops": _tflops(k_m, t), "same_bits": same}
                    print(f"    {k_m}: {t:.4f} ms ({_tflops(k_m, t):.0f} TFLOP/s; current {row['current_ms']:.4f}, "
                          f"cuBLAS {row['cublas_ms']:.4f}) same bits: {same}", flush=True)
                except Exception as e:  # a variant this GPU / Triton cannot build: named, skipped
                    row["variants"][str(v)] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                    print(f"    {k_m}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
    total = {"cublas": 0.0, "current": 0.0, "best_same_bits": 0.0}
    print("  best per shape with the current kernel's bits:", flush=True)
    for k_m, calls, _, row in cases:
        ok = {"current": row["current_ms"]} | {v: x["ms"] for v, x in row["variants"].items() if x.get("same_bits")}
        row["best_same_bits"] = min(ok, key=ok.get)
        best_ms = ok[row["best_same_bits"]]
        if k_m in seen:  # the step's own row count (not the head's extra 16-row run)
            total["cublas"] += row["cublas_ms"] * calls
            total["current"] += row["current_ms"] * calls
            total["best_same_bits"] += best_ms * calls
        print(f"    {k_m}: {row['best_same_bits']} {best_ms:.4f} ms ({_tflops(k_m, best_ms):.0f} TFLOP/s) vs "
              f"cuBLAS {row['cublas_ms']:.4f}", flush=True)
    print(f"  per step over these shapes: cuBLAS {total['cublas']:.1f} ms, current {total['current']:.1f} ms, "
          f"best same-bits variant {total['best_same_bits']:.1f} ms", flush=True)
    print("TUNED entries from the variants (bf16 at the step's rows; fp32: the variant fastest over both row counts "
          "among those with the default tile's bits at each):")
    for k_m, _, _, row in cases:
        if k_m[1] == "bfloat16" and row["best_same_bits"] != "current":
            print(f"    (torch.bfloat16, {k_m[5]}, {k_m[6]}): TileConfig{row['best_same_bits']},")
    for label, pick in (("SMALL_FP32 (<= SMALL_ROWS rows)", lambda m: m <= bi.SMALL_ROWS),
                        ("fp32 above SMALL_ROWS", lambda m: m > bi.SMALL_ROWS)):
        f32_rows = [row for k_m, _, _, row in cases if k_m[1] == "float32" and pick(k_m[4])]
        both = {v: sum(r["variants"][v]["ms"] for r in f32_rows) for v in (f32_rows[0]["variants"] if f32_rows else ())
                if all(r["variants"].get(v, {}).get("same_bits") for r in f32_rows)}
        if both:
            best = min(both, key=both.get)
            print(f"    {label}: TileConfig{best}  # {both[best]:.4f} ms over those fp32 runs "
                  f"(current {sum(r['current_ms'] for r in f32_rows):.4f})", flush=True)
    return [{"per_step_ms": total}] + [row for *_, row in cases]


def flashmla_rows_probe() -> dict:
    """Is FlashMLA's sparse prefill row-invariant? A query's output computed alone, among a few rows, among all
    4,096, and in a shuffled batch, compared bit for bit (the same keys, lists and counts per query)."""
    from mini.kernels import flashmla_attention as fm
    if not fm.available():
        return {"available": False}
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    T, H, D, N, n = 4096, fm.HEADS[0], fm.HEAD_DIM, 8192, 5 * fm.TOPK_MULTIPLE
    q = torch.randn(T, H, D, device=dev, generator=g).to(bf)
    kv = torch.randn(N, D, device=dev, generator=g).to(bf)
    rows = torch.randint(0, N, (T, n), device=dev, generator=g, dtype=torch.int32)
    count = torch.randint(1, n + 1, (T,), device=dev, generator=g, dtype=torch.int32)
    sink = torch.randn(H, device=dev, generator=g)
    scale = D ** -0.5
    full = fm.sparse_prefill(q, kv, rows, count, sink, scale)
    res = {}
    for lo, hi in ((0, 1), (5, 12), (100, 400), (3000, 4096)):
        part = fm.sparse_prefill(q[lo:hi].contiguous(), kv, rows[lo:hi].contiguous(), count[lo:hi].contiguous(),
                                 sink, scale)
        res[f"rows {lo}:{hi}"] = torch.equal(part, full[lo:hi])
    perm = torch.randperm(T, device=dev, generator=g)
    res["shuffled"] = torch.equal(fm.sparse_prefill(q[perm], kv, rows[perm], count[perm], sink, scale), full[perm])
    return {"available": True, "bitwise_equal": res}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    rank4.add_args(p)
    p.add_argument("--out", type=Path, default=Path("det-profile-out"))
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--modes", default="default,det", help=f"comma-separated, the first the baseline: {MODES}")
    p.add_argument("--gemms", choices=("none", "bench", "sweep"), default="sweep",
                   help="after the profiles: nothing, each GEMM cuBLAS vs ours, or that and the tile sweep")
    p.add_argument("--ab-rounds", type=int, default=0,
                   help="after the profiles: this many interleaved rounds of every mode (A/B in one build)")
    p.add_argument("--ab-steps", type=int, default=2, help="timed steps per mode per --ab-rounds round")
    p.add_argument("--variants-only", action="store_true",
                   help="no model: the GEMM kernel variants at the rank4 step's GEMM shapes (RANK4_GEMMS), "
                        "TFLOP/s and bits vs the current kernel")
    p.set_defaults(steps=3, warmup=1)
    args = p.parse_args(argv)
    if hasattr(rank4, "resolve"):  # rank4's --mode defaults (idempotent), where this revision has them
        rank4.resolve(args)
    cuda = args.device.startswith("cuda")
    if args.variants_only:
        result = {"variants": bench_variants(RANK4_GEMMS, device=args.device)}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "det_profile.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        return 0
    r, setup_s = rank4.setup(args)
    print(f"built in {setup_s:.1f} s", flush=True)
    names = args.modes.split(",")
    modes = [profile_mode(r, m, args, cuda) for m in names]
    ab = ab_rounds(r, names, args.ab_rounds, args.ab_steps, cuda) if args.ab_rounds else None
    rec = GemmShapes()
    with rec:  # under the last mode profiled (a deterministic one: the GEMMs the overrides take)
        r.step()
    _sync(cuda)
    mini.ops.set_deterministic(False)
    result = {"definition": rank4.definition(args), "modes": modes, "ab": ab,
              "gemms_per_step_det": [{"gemm": k, "calls": c} for k, c in rec.seen.items()]}

    base = modes[0]["stages_ms_per_step"]
    print("\nrank4 step, median ms: " + ", ".join(f"{m['mode']} {m['median_step_ms']:.1f}" for m in modes))
    if ab:
        first = names[0]
        print(f"rank4 A/B interleaved ({ab['rounds']} rounds x {ab['steps_per_round']} steps per mode), median ms: "
              + ", ".join(f"{m} {v:.1f}" for m, v in ab["median_step_ms"].items())
              + "; median per-round ratio to " + first + ": "
              + ", ".join(f"{m} {v:.3f}" for m, v in ab["median_ratio_to_" + first].items()))
    others = modes[1:]
    heads = " ".join(f"{m['mode']:>13s} {'-' + modes[0]['mode']:>9s}" for m in others)
    print(f"  {'stage (ms/step)':32s} {modes[0]['mode']:>9s} {heads}")
    for s in base:
        cols = " ".join(f"{m['stages_ms_per_step'].get(s, 0.0):13.2f} "
                        f"{m['stages_ms_per_step'].get(s, 0.0) - base[s]:9.2f}" for m in others)
        print(f"  {s:32s} {base[s]:9.2f} {cols}")
    for m in modes:
        print(f"\ntop kernels, {m['mode']} (ms in one step, calls):")
        for row in m["top_kernels"]:
            print(f"  {row['ms']:8.2f} {row['calls']:5d}  {row['name']}")
    print("\nGEMMs of one deterministic step (op dtype out batch M N K a-layout b-layout: calls):")
    for k, c in sorted(rec.seen.items(), key=lambda kv: -kv[1]):
        print(f"  {k}: {c}")

    if cuda and args.gemms != "none":
        del r
        torch.cuda.empty_cache()
        print("\nGEMM micro-benchmark (cuBLAS vs the batch-invariant kernel at the tile config_for gives):", flush=True)
        try:
            result["flashmla_rows"] = flashmla_rows_probe()
        except Exception as e:  # the probe informs; it must not cost the GEMM numbers
            result["flashmla_rows"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"FlashMLA sparse prefill, row invariance: {result['flashmla_rows']}", flush=True)
        rows, sweep = bench_gemms(rec.seen, sweep=args.gemms == "sweep")
        result["gemm_bench"], result["sweep"] = rows, sweep
        tot_c = sum(x["cublas_ms"] * x["calls_per_step"] for x in rows)
        tot_b = sum(x["bi_ms"] * x["calls_per_step"] for x in rows)
        for x in rows:
            print(f"  {x['gemm']} x{x['calls_per_step']}: cuBLAS {x['cublas_tflops']:6.0f} TFLOP/s "
                  f"{x['cublas_ms']:.4f} ms, bi {x['bi_tflops']:6.0f} TFLOP/s {x['bi_ms']:.4f} ms")
        print(f"  per step: cuBLAS {tot_c:.1f} ms, batch-invariant {tot_b:.1f} ms")
        result["per_step_ms"] = {"cublas": tot_c, "batch_invariant": tot_b}
        if sweep:
            print("the sweep's fastest tile per weight shape:\nTUNED = {")
            for x in sweep:
                if x["best"] is not None:
                    dt, n, k = x["weight"]
                    print(f"    (torch.{dt}, {n}, {k}): TileConfig{tuple(x['best'])},")
            print("}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "det_profile.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
