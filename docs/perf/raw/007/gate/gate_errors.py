"""Max |logit error| against float64 of the fused gate kernel's configs at V4.1-Flash's gate shape (384 x 5120), on
the H200: x [4096, 5120] bf16 (x3: logits of a few units), w ~ N(0, 1/D) bf16. Printed beside the IEEE fp32 GEMM's
error on the same rows. Run: python docs/perf/raw/007/gate/gate_errors.py"""
import torch

from mini.kernels.moe_gate import CONFIGS, GateConfig as G, gate_topk

g = torch.Generator(device="cpu").manual_seed(7)
x = (torch.randn(4096, 5120, generator=g) * 3).bfloat16().cuda()
w = (torch.randn(384, 5120, generator=g) / 5120 ** 0.5).bfloat16().cuda()
bias = torch.zeros(384, device="cuda")
exact = x.double() @ w.double().t()
fp32 = (x.float() @ w.float().t() - exact).abs().max().item()
print(f"fp32 GEMM: {fp32:.3g}")
for c in CONFIGS + (G(64, 64, 8, 3, steps=4, inner_loop=True), G(32, 64, 4, 3, steps=8, inner_loop=True),
                    G(64, 64, 8, 3, steps=16, inner_loop=True), G(64, 32, 8, 4, steps=1)):
    logits = gate_topk(x, w, bias, 6, 1.0, debug=True, config=c)[2]
    err = (logits.double() - exact).abs()
    print(f"{c}: max {err.max().item():.3g} ({err.max().item() / fp32:.2f}x fp32), "
          f"mean {err.mean().item():.3g}, beyond 1e-5 + 1e-5|ref|: "
          f"{(err > 1e-5 + 1e-5 * exact.abs()).float().mean().item():.2e}", flush=True)
