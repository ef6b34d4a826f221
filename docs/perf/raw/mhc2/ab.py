"""A/B of the mHC split-K pass on one GPU, one V4.1-Flash site (T=4096, hc=4, D=5120, delayed pre), do_bench median:
  old    = the module before this change (fn split into bf16 pieces in registers by every program), argv[1];
  pieces = mini/kernels/mhc_norm.py (fn's bf16 pieces computed once per weight, loaded into three chained MMAs);
  kcat   = .cache/mhc2/mhc_norm_kcat.py (same pieces; the hc copies of a D step along K: 3 MMAs per step);
  nstack = .cache/mhc2/mhc_norm_nstack.py (the pieces side by side along N: one MMA per h tile; kcat=True: and
           the copies along K, one MMA per step).
`--compile N`: compile every call and run the gpu test's `check` per config in N worker processes (JSON of the
checks to argv[2]), then exit. Otherwise: two timing rounds, per-kernel times,
bit-identity pieces vs old at equal configs, parity vs the fp32 reference at T=4096. JSON to argv[2]. The gpu test's `check`
(tests/kernels/test_mhc_norm.py, same bounds) runs for every config at the test's shapes in the compile phase."""
import importlib.util
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.environ.get("TRITON_INTERPRET") == "1"  # CPU dry run of this script at toy sizes
DEV = "cpu" if SMOKE else "cuda"
T, HC, D = (8, 4, 128) if SMOKE else (4096, 4, 5120)
TEST_SHAPES = ((5, 128, True), (5, 128, False)) if SMOKE else ((333, 5120, True), (333, 5120, False), (77, 1000, True))


def bench(f):
    if SMOKE:
        t = time.perf_counter()
        f()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-20)
CONFIGS = {
    "old": [dict(), dict(split=20), dict(block_k=32, num_stages=3)],
    "pieces": [dict(), dict(split=20), dict(block_k=32), dict(block_k=32, num_stages=3), dict(block_k=32, split=20),
               dict(block_k=16, num_stages=4), dict(block_k=16, num_stages=4, split=6),
               dict(block_k=16, num_stages=3, split=20),
               dict(block_k=32, block_t=128, num_warps=8), dict(block_k=64, block_t=128, num_warps=8)],
    "kcat": [dict(block_k=16), dict(block_k=16, num_stages=3), dict(block_k=16, num_stages=4), dict(block_k=32),
             dict(block_k=32, num_stages=3), dict(block_k=16, num_stages=3, split=20),
             dict(block_k=16, num_stages=4, split=20), dict(block_k=16, num_stages=3, block_t=128, num_warps=8),
             dict(block_k=32, block_t=128, num_warps=8), dict(block_k=8, num_stages=4),
             dict(block_k=16, num_stages=3, split=8), dict(block_k=16, num_stages=4, split=6),
             dict(block_k=32, split=4)],
    "nstack": [dict(block_k=32), dict(block_k=32, split=20), dict(kcat=True, block_k=16),
               dict(kcat=True, block_k=16, num_stages=3), dict(kcat=True, block_k=16, num_stages=4),
               dict(kcat=True, block_k=8, num_stages=4), dict(kcat=True, block_k=16, num_stages=3, split=20),
               dict(kcat=True, block_k=16, num_stages=3, block_t=128, num_warps=8),
               dict(kcat=True, block_k=16, num_stages=3, split=6)],
}


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def modules(old_path):
    import mini.kernels.mhc_norm as pieces
    here = os.path.dirname(os.path.abspath(__file__))
    return dict(old=load("mhc_norm_old", old_path), pieces=pieces,
                kcat=load("mhc_norm_kcat", os.path.join(here, "mhc_norm_kcat.py")),
                nstack=load("mhc_norm_nstack", os.path.join(here, "mhc_norm_nstack.py")))


def data():
    torch.manual_seed(0)
    h = torch.randn(T, HC, D, device=DEV).bfloat16()
    fn = torch.randn((2 + HC) * HC, HC * D, device=DEV) * 0.01
    scale, base = torch.rand(3, device=DEV), torch.randn((2 + HC) * HC, device=DEV)
    nw = torch.rand(D, device=DEV).bfloat16()
    pre_prev = torch.rand(T, HC, device=DEV)
    return h, fn, scale, base, nw, pre_prev


def calls(old_path):
    mods = modules(old_path)
    h, fn, scale, base, nw, pre_prev = data()
    out = []
    for fam, cfgs in CONFIGS.items():
        for cfg in cfgs:
            f = mods[fam].mhc_norm
            out.append((fam, cfg, lambda f=f, cfg=cfg: f(h, fn, scale, base, nw, pre_in=pre_prev, **KW, **cfg)))
    p = mods["pieces"].mhc_norm
    out.append(("pieces", "V4 own pre", lambda: p(h, fn, scale, base, nw, pre_in=None, **KW)))
    out.append(("pieces", "mixes only", lambda: p(h, fn, scale, base, None, pre_in=None, **KW, collapse=False)))
    o = mods["old"].mhc_norm
    out.append(("old", "V4 own pre", lambda: o(h, fn, scale, base, nw, pre_in=None, **KW)))
    out.append(("old", "mixes only", lambda: o(h, fn, scale, base, None, pre_in=None, **KW, collapse=False)))
    return out, mods, (h, fn, scale, base, nw, pre_prev)


def check_jobs():
    return [(fam, cfg) for fam, cfgs in CONFIGS.items() if fam != "old" for cfg in cfgs]


def compile_worker(args):
    """Compiles its share of the timed calls, then runs the test check for its share of the configs."""
    old_path, i, n = args
    cs, mods, _ = calls(old_path)
    for fam, cfg, f in cs[i::n]:
        try:
            f()
        except Exception as e:
            print("compile error", fam, cfg, repr(e)[:200], flush=True)
    if not SMOKE:
        torch.cuda.synchronize()
    out = {}
    for fam, cfg in check_jobs()[i::n]:
        out[f"{fam} {cfg or 'default'}"] = test_check(mods, fam, cfg)
        print("check", fam, cfg, out[f"{fam} {cfg or 'default'}"], flush=True)
    return out


def test_check(mods, fam, cfg):
    """tests/kernels/test_mhc_norm.py's check (its bounds) at its gpu shapes, through this family's mhc_norm."""
    import mini.kernels.mhc_norm as pkg
    import mini.ops
    sys.path.insert(0, "tests/kernels")
    import test_mhc_norm as t
    keep = pkg.mhc_norm
    pkg.mhc_norm = mods[fam].mhc_norm
    mini.ops.set_backend("reference")
    try:
        for T_, D_, delayed in TEST_SHAPES:
            h, fn, scale, base, w, pre_prev = t.make(T_, D_, DEV, torch.bfloat16)
            t.check(h, fn, scale, base, w, pre_prev if delayed else None, False, **cfg)
        return "pass"
    except Exception as e:
        import traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        return f"FAIL {type(e).__name__} at {os.path.basename(where.filename)}:{where.lineno}: {str(e)[:200]}"
    finally:
        pkg.mhc_norm = keep
        mini.ops.set_backend("fast")


def main():
    old_path, out_path = sys.argv[1], sys.argv[2]
    if "--compile" in sys.argv:
        import multiprocessing as mp
        n = int(sys.argv[sys.argv.index("--compile") + 1])
        t = time.time()
        with mp.get_context("spawn").Pool(n) as pool:
            parts = pool.map(compile_worker, [(old_path, i, n) for i in range(n)])
        checks = {k: v for part in parts for k, v in part.items()}
        print(f"compiled + checked in {time.time() - t:.1f}s", json.dumps(checks, indent=0), flush=True)
        with open(out_path, "w") as f:
            json.dump(checks, f, indent=1)
        return
    res = dict(device=DEV if SMOKE else torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=[])
    cs, mods, (h, fn, scale, base, nw, pre_prev) = calls(old_path)
    floor_bytes = h.numel() * 2 + T * D * 2 + fn.numel() * 4
    dst = torch.empty_like(h)
    copy_ms = bench(lambda: dst.copy_(h))
    res["copy"] = dict(ms=copy_ms, tbs=2 * h.numel() * 2 / copy_ms / 1e9)
    print(json.dumps(res["copy"]), flush=True)
    for rnd in range(2):
        for fam, cfg, f in cs:
            try:
                ms = bench(f)
                row = dict(round=rnd, family=fam, config=str(cfg or "default"), us=ms * 1e3,
                           floor_tbs=floor_bytes / ms / 1e9)
            except Exception as e:
                row = dict(round=rnd, family=fam, config=str(cfg or "default"), error=repr(e)[:300])
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    # best V4.1 config per family (mean of both rounds)
    best = {}
    for fam, cfg, f in cs:
        if isinstance(cfg, str):
            continue
        us = [r["us"] for r in res["rows"] if r["family"] == fam and r["config"] == str(cfg or "default") and "us" in r]
        if len(us) == 2 and (fam not in best or sum(us) / 2 < best[fam][0]):
            best[fam] = (sum(us) / 2, cfg, f)
    res["best"] = {fam: dict(us=b[0], config=str(b[1] or "default")) for fam, b in best.items()}
    print("best", json.dumps(res["best"]), flush=True)
    from torch.profiler import ProfilerActivity, profile
    kern = {}
    for fam, (_, cfg, f) in best.items():
        for label, g in ((f"{fam} best", f), (f"{fam} default", next(c[2] for c in cs if c[0] == fam and c[1] == (CONFIGS[fam][0])))):
            with profile(activities=[ProfilerActivity.CPU if SMOKE else ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    g()
                if not SMOKE:
                    torch.cuda.synchronize()
            kern[label] = {e.key: e.device_time_total / e.count for e in prof.key_averages()
                           if e.count and "kernel" in e.key}
    res["kernels_us"] = kern
    print(json.dumps(kern), flush=True)
    # bit-identity: pieces vs old at equal configs
    ident = {}
    for cfg in (dict(), dict(block_k=32), dict(split=20)):
        a = mods["old"].mhc_norm(h, fn, scale, base, nw, pre_in=pre_prev, **KW, **cfg)
        b = mods["pieces"].mhc_norm(h, fn, scale, base, nw, pre_in=pre_prev, **KW, **cfg)
        ident[str(cfg or "default")] = [bool(torch.equal(x, y)) for x, y in zip(a, b)]
        a = mods["old"].mhc_norm(h, fn, scale, base, nw, pre_in=None, **KW, **cfg)
        b = mods["pieces"].mhc_norm(h, fn, scale, base, nw, pre_in=None, **KW, **cfg)
        ident[str(cfg or "default") + " V4"] = [bool(torch.equal(x, y)) for x, y in zip(a, b)]
    res["bit_identical_pieces_vs_old (y, pre, post, comb)"] = ident
    print(json.dumps(ident), flush=True)
    # parity vs the fp32 reference at T=4096
    import mini.ops
    from mini.ops.mhc import pre_norm
    mini.ops.set_backend("reference")
    ref = pre_norm(h, fn, scale, base, nw, pre_prev, hc_mult=HC, **KW)
    mini.ops.set_backend("fast")
    par = {}
    for fam, (_, cfg, f) in best.items():
        got = f()
        for i, name in enumerate(("y", "pre", "post", "comb")):
            diff = (got[i].float() - ref[i].float()).abs()
            par[f"{fam} {cfg}/{name}"] = dict(max_abs=diff.max().item(), max_rel=(diff / ref[i].float().abs().clamp_min(
                1e-30)).max().item(), share_differing=(got[i] != ref[i]).float().mean().item())
    res["parity_vs_reference_T4096"] = par
    print(json.dumps(par), flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
