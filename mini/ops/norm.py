"""RMSNorm (spec §2, reference `RMSNorm`): statistics and scaling in fp32, result in the input dtype. The fast
backend runs it as one kernel (mini/kernels/rms_norm.py) where it takes the tensors, else these torch ops."""
import torch

from mini.ops import use_fast


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim; eps is 1e-20 for V4.1 and 1e-6 for V4.

    The reference's `(weight.float() * y).to(x.dtype)` in one mul: type promotion widens a bf16 weight to fp32
    exactly inside the mul, and `out=` rounds the fp32 product to x.dtype as `.to` does. The same bits, two kernels
    fewer per call (issue 28; tests/ops/test_op_hoist.py compares against the three-op form). The fast path's kernel
    sums the squares in another order: the statistic may move by an fp32 ulp (tests/kernels/test_rms_norm.py)."""
    if use_fast(x, weight):
        from mini.kernels.rms_norm import rms_norm as kernel, supported
        if supported(x, weight):
            return kernel(x, weight, eps)
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return torch.mul(weight, xf * inv_rms, out=torch.empty_like(x))
