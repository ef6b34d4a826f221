"""Per-call times of the mHC glue at the rank4 shape (T=4096, hc=4, D=5120, bf16) on the fast and the reference
backend: `expand` (hc_post) and `pre_norm` (mixes + collapse + RMSNorm of one site), with the eager sequence the
model ran before (mixes kernel, then eager collapse and rms_norm). Run on the device: prints one JSON object."""
import json

import torch
import triton

import mini.ops
from mini.ops import mhc
from mini.ops.norm import rms_norm

T, HC, D = 4096, 4, 5120
KW = dict(hc_mult=HC, iters=20, hc_eps=1e-6, norm_eps=1e-20)


def ms(fn, backend):
    mini.ops.set_backend(backend)
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    finally:
        mini.ops.set_backend("fast")


h = torch.randn(T, HC, D, device="cuda").bfloat16()
f = torch.randn(T, D, device="cuda").bfloat16()
fn, scale, base = torch.randn((2 + HC) * HC, HC * D, device="cuda") * 0.05, torch.rand(3, device="cuda") + 0.5, \
    torch.randn((2 + HC) * HC, device="cuda")
w, pre_in = (torch.rand(D, device="cuda") + 0.5).bfloat16(), torch.rand(T, HC, device="cuda")
post, comb = torch.rand(T, HC, device="cuda") * 2, torch.rand(T, HC, HC, device="cuda")


def before_pre_norm():  # what the model called per site before pre_norm: mixes on the kernel, the rest eager
    mhc.mixes(h, fn, scale, base, **KW)
    mini.ops.set_backend("reference")
    rms_norm(mhc.collapse(h, pre_in), w, 1e-20)
    mini.ops.set_backend("fast")


expand_bytes = f.numel() * 2 + 2 * h.numel() * 2
rows = {
    "expand.fast_ms": ms(lambda: mhc.expand(f, h, post, comb), "fast"),
    "expand.reference_ms": ms(lambda: mhc.expand(f, h, post, comb), "reference"),
    "pre_norm.fast_ms": ms(lambda: mhc.pre_norm(h, fn, scale, base, w, pre_in, **KW), "fast"),
    "pre_norm.before_ms": ms(before_pre_norm, "fast"),
    "pre_norm.reference_ms": ms(lambda: mhc.pre_norm(h, fn, scale, base, w, pre_in, **KW), "reference"),
}
rows["expand.fast_tbs"] = expand_bytes / rows["expand.fast_ms"] / 1e9
print(json.dumps({"shape": [T, HC, D], **rows}, indent=1))
