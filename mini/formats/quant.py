"""Fake quantization that is part of the model (QAT semantics, spec §5): quantize then dequantize, returning
values in the input dtype. All results are exactly representable in bf16.

| what                               | V4.1                          | V4                             |
| GEMM activations (`act`)           | FP8, 1x32, ue8m0              | FP8, 1x128, ue8m0              |
| window KV                          | FP8, 1x32, all 512 dims       | FP8, 1x64, nope dims only      |
| compressed KV                      | FP4, 1x16, e4m3 scales        | FP8, 1x64, nope dims only      |
| index q / k                        | FP4, 1x32, ue8m0              | Hadamard, then FP4 1x32 ue8m0  |
"""
import contextlib

import torch

from mini.formats.e8m0 import pow2_ceil_scale
from mini.formats.fp4 import FP4_MAX, e2m1_round
from mini.formats.fp8 import FP8_MAX, to_e4m3


_enabled = True


@contextlib.contextmanager
def no_fake_quant():
    """Turn every activation/KV fake quantization into the identity. Only for parity checks against ports that
    leave it out (transformers' DeepSeek-V4); the model as trained always applies it."""
    global _enabled
    prev, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = prev


def fake_quant_enabled() -> bool:
    """False inside no_fake_quant(); fused kernels that quantize on their own check this."""
    return _enabled


def quant_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row 1xblock FP8 e4m3 with power-of-two scales s = 2^ceil(log2(max(amax, 1e-4) / 448)), split:
    (e4m3 values as fp32 [..., n], s fp32 [..., n / block]); values * s is `fake_quant_fp8`. Inside
    no_fake_quant() the values are x itself (fp32) and every scale is 1."""
    g = x.float().unflatten(-1, (-1, block))
    if not _enabled:
        return g.flatten(-2), torch.ones(g.shape[:-1], dtype=torch.float32, device=x.device)
    s = pow2_ceil_scale(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / FP8_MAX))
    return to_e4m3(g / s).float().flatten(-2), s.squeeze(-1)


def fake_quant_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-row 1xblock FP8 e4m3 with power-of-two scales: s = 2^ceil(log2(max(amax, 1e-4) / 448))."""
    if not _enabled:
        return x
    g = x.float().unflatten(-1, (-1, block))
    s = pow2_ceil_scale(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / FP8_MAX))
    return (to_e4m3(g / s).float() * s).flatten(-2).to(x.dtype)


def fake_quant_fp4(x: torch.Tensor, block: int, scale: str) -> torch.Tensor:
    """Per-row 1xblock FP4 e2m1. scale='ue8m0': s = 2^ceil(log2(max(amax, 6*2^-126) / 6)) (index q/k);
    scale='e4m3': s = e4m3(max(amax, 6*2^-9) / 6) (V4.1 compressed KV)."""
    if not _enabled:
        return x
    g = x.float().unflatten(-1, (-1, block))
    amax = g.abs().amax(-1, keepdim=True)
    if scale == "e4m3":
        s = to_e4m3(amax.clamp_min(6 * 2.0 ** -9) / FP4_MAX).float()
    elif scale == "ue8m0":
        s = pow2_ceil_scale(amax.clamp_min(6 * 2.0 ** -126) * (1.0 / FP4_MAX))
    else:
        raise ValueError(f"unknown fp4 scale format {scale!r}")
    return (e2m1_round((g / s).clamp(-FP4_MAX, FP4_MAX)) * s).flatten(-2).to(x.dtype)
