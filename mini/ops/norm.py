"""RMSNorm (spec §2, reference `RMSNorm`): statistics and scaling in fp32, result in the input dtype."""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim; eps is 1e-20 for V4.1 and 1e-6 for V4."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * (xf * inv_rms)).to(x.dtype)
