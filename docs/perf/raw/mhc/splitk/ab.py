"""A/B of the mHC pre-norm kernel on one GPU: the previous one-kernel version (a copy of the old module, path in
argv) against the split-K version in mini/kernels/mhc_norm.py, at one V4.1-Flash site (T=4096, hc=4, D=5120,
delayed pre). `--compile N`: compile every config in N worker processes (fills Triton's disk cache) and exit.
Otherwise time (do_bench median), per-kernel times from the torch profiler, parity at T=4096, the kernels-suite
mhc rows; JSON to argv[2]."""
import importlib.util
import json
import sys
import time

import torch
import triton

T, HC, D = 4096, 4, 5120
KW = dict(iters=20, hc_eps=1e-6, norm_eps=1e-20)
PARTIAL = [dict(), dict(num_stages=3), dict(num_warps=8, num_stages=3), dict(block_t=128, num_warps=8),
           dict(block_k=32, num_stages=4), dict(split=5), dict(split=20), dict(block_k=128, num_warps=8)]
FINISH = [dict(finish_block_t=4), dict(finish_block_t=16, finish_warps=8), dict(block_d=1024),
          dict(finish_block_t=2, block_d=1024)]


def data():
    torch.manual_seed(0)
    h = torch.randn(T, HC, D, device="cuda").bfloat16()
    fn = torch.randn((2 + HC) * HC, HC * D, device="cuda") * 0.01
    scale, base = torch.rand(3, device="cuda"), torch.randn((2 + HC) * HC, device="cuda")
    nw = torch.rand(D, device="cuda").bfloat16()
    pre_prev = torch.rand(T, HC, device="cuda")
    return h, fn, scale, base, nw, pre_prev


def load_old(path):
    spec = importlib.util.spec_from_file_location("mhc_norm_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def calls(old_path):
    """(name, fn) for every timed call."""
    from mini.kernels.mhc_norm import mhc_norm
    old = load_old(old_path)
    h, fn, scale, base, nw, pre_prev = data()
    out = [("old/model default (block_t=32)", lambda: old.mhc_norm(h, fn, scale, base, nw, pre_in=pre_prev, **KW)),
           ("old/V4 own pre", lambda: old.mhc_norm(h, fn, scale, base, nw, pre_in=None, **KW))]
    for cfg in PARTIAL + FINISH:
        out.append((f"new/{cfg or 'default'}", lambda cfg=cfg: mhc_norm(h, fn, scale, base, nw, pre_in=pre_prev,
                                                                         **KW, **cfg)))
    out.append(("new/default fp8", lambda: mhc_norm(h, fn, scale, base, nw, pre_in=pre_prev, **KW, quant="fp8")))
    out.append(("new/V4 own pre", lambda: mhc_norm(h, fn, scale, base, nw, pre_in=None, **KW)))
    out.append(("new/mixes only", lambda: mhc_norm(h, fn, scale, base, None, pre_in=None, **KW, collapse=False)))
    return out, (h, fn, scale, base, nw, pre_prev), old


def compile_worker(args):
    old_path, idx = args
    cs, _, _ = calls(old_path)
    for i in idx:
        try:
            cs[i][1]()
        except Exception as e:  # reported again by the timing run
            print("compile error", cs[i][0], repr(e)[:200], flush=True)
    torch.cuda.synchronize()
    return len(idx)


def main():
    old_path, out_path = sys.argv[1], sys.argv[2]
    if "--compile" in sys.argv:
        import multiprocessing as mp
        n = int(sys.argv[sys.argv.index("--compile") + 1])
        cs, _, _ = calls(old_path)
        groups = [list(range(i, len(cs), n)) for i in range(n)]
        t = time.time()
        with mp.get_context("spawn").Pool(n) as pool:
            pool.map(compile_worker, [(old_path, g) for g in groups])
        print(f"compiled {len(cs)} calls in {time.time() - t:.1f}s", flush=True)
        return
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=[])
    cs, (h, fn, scale, base, nw, pre_prev), old = calls(old_path)
    floor_bytes = h.numel() * 2 + T * D * 2 + fn.numel() * 4
    dst = torch.empty_like(h)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(h), warmup=25, rep=100, return_mode="median")
    copy_tbs = 2 * h.numel() * 2 / copy_ms / 1e9
    res["copy"] = dict(ms=copy_ms, tbs=copy_tbs, floor_bytes=floor_bytes, floor_us=floor_bytes / copy_tbs / 1e6)
    print(json.dumps(res["copy"]), flush=True)
    for name, f in cs:
        try:
            ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
            row = dict(name=name, ms=ms, floor_tbs=floor_bytes / ms / 1e9, frac_copy=floor_bytes / ms / 1e9 / copy_tbs)
        except Exception as e:
            row = dict(name=name, error=repr(e)[:300])
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    # per-kernel device times of the default calls
    from mini.kernels.mhc_norm import mhc_norm
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            old.mhc_norm(h, fn, scale, base, nw, pre_in=pre_prev, **KW)
            mhc_norm(h, fn, scale, base, nw, pre_in=pre_prev, **KW)
        torch.cuda.synchronize()
    res["kernels_us"] = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.count}
    print(json.dumps(res["kernels_us"]), flush=True)
    # parity at the real shape: new vs reference and vs the old kernel
    import mini.ops
    from mini.ops.mhc import pre_norm
    mini.ops.set_backend("reference")
    ref = pre_norm(h, fn, scale, base, nw, pre_prev, hc_mult=HC, **KW)
    mini.ops.set_backend("fast")
    new = mhc_norm(h, fn, scale, base, nw, pre_in=pre_prev, **KW)
    prev = old.mhc_norm(h, fn, scale, base, nw, pre_in=pre_prev, **KW)
    par = {}
    for label, got in (("new", new), ("old", prev)):
        for i, name in enumerate(("y", "pre", "post", "comb")):
            diff = (got[i].float() - ref[i].float()).abs()
            par[f"{label}/{name}/max_abs"] = diff.max().item()
            par[f"{label}/{name}/max_rel"] = (diff / ref[i].float().abs().clamp_min(1e-30)).max().item()
            par[f"{label}/{name}/share_differing"] = (got[i] != ref[i]).float().mean().item()
    res["parity_vs_reference_T4096"] = par
    print(json.dumps(par), flush=True)
    from mini.bench.kernels import bench_mhc
    rows = []
    bench_mhc(rows, sweep=False)
    res["kernels_suite_mhc"] = rows
    print("\n".join(json.dumps(r) for r in rows), flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
