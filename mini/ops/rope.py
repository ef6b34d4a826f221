"""Rotary position embedding (spec §2.4.2): interleaved pairs (x[2i], x[2i+1]) of the *last* `rope_dim` channels
are rotated as complex numbers by e^{i·pos·f_i}. Compressed layers (ratio > 0) use base 160000 with YaRN, window-only
layers base 10000 without; the attention output is rotated back with the conjugate (`inverse=True`).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from mini.config import LayerPlan, ModelConfig
from mini.formats import fake_quant_fp4, fake_quant_fp8
from mini.ops import use_fast
from mini.ops.norm import rms_norm

# fake quantizers that may follow a rotation: name -> (x, block) -> x (mini/kernels/quant.py has the same names)
_QUANT = {None: lambda x, block: x, "fp8": fake_quant_fp8,
          "fp4_ue8m0": lambda x, block: fake_quant_fp4(x, block, "ue8m0"),
          "fp4_e4m3": lambda x, block: fake_quant_fp4(x, block, "e4m3")}


def yarn_bounds(rope_dim: int, base: float, original_seq_len: int, beta_fast: int, beta_slow: int) -> tuple[int, int]:
    """The pair indices where the YaRN ramp starts (unscaled below) and ends (fully scaled above)."""
    def corrected(rotations: float) -> float:  # the pair whose wavelength turns `rotations` times in the context
        return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(corrected(beta_fast)), 0), min(math.ceil(corrected(beta_slow)), rope_dim - 1)


@lru_cache(maxsize=16)
def rope_frequencies(rope_dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: int = 32, beta_slow: int = 1) -> torch.Tensor:
    """fp32 [rope_dim // 2] angular frequencies; YaRN (original_seq_len > 0) divides the long-wavelength pairs by
    `factor`, with a linear ramp between the bounds. No attention scaling factor (mscale) is applied."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        lo, hi = yarn_bounds(rope_dim, base, original_seq_len, beta_fast, beta_slow)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


def layer_frequencies(cfg: ModelConfig, plan: LayerPlan) -> torch.Tensor:
    if plan.yarn:
        return rope_frequencies(cfg.rope_head_dim, plan.rope_base, cfg.original_seq_len, cfg.rope_factor,
                                cfg.beta_fast, cfg.beta_slow)
    return rope_frequencies(cfg.rope_head_dim, plan.rope_base)


_DEVICE_FREQS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _freqs_on(freqs: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`freqs` on `device`, copied once per (table, device): a copy from the host cannot run inside a captured CUDA
    graph. The frequency tables are the few long-lived rope_frequencies results; the entry holds the host table
    too, so that its id stays unique."""
    if freqs.device == device:
        return freqs
    key = (id(freqs), device)
    if key not in _DEVICE_FREQS:
        _DEVICE_FREQS[key] = (freqs, freqs.to(device))
    return _DEVICE_FREQS[key][1]


def rope_table(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """complex64 [n, rope_dim // 2]: e^{i·pos·f} for each position (fp32 angles, as the reference's table)."""
    angles = positions.to(torch.float32).unsqueeze(-1) * _freqs_on(freqs, positions.device).unsqueeze(0)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2·table.shape[-1] channels of x ([n, d] or [n, heads, d]) by `table` ([n, rope_dim // 2]);
    returns a new tensor in x.dtype (the math is fp32)."""
    if use_fast(x) and x.dtype == torch.bfloat16:
        from mini.kernels.rope_quant import rope_quant, supported
        if supported(x.shape[-1], 2 * table.shape[-1], None, 1):
            return rope_quant(x, table, inverse)
    rd = 2 * table.shape[-1]
    if inverse:
        table = table.conj()
    if x.dim() == 3:
        table = table.unsqueeze(1)
    rot = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous()) * table
    return torch.cat([x[..., :-rd], torch.view_as_real(rot).flatten(-2).to(x.dtype)], dim=-1)


def norm_rope_quant(x: torch.Tensor, table: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    quant: str | None = None, quant_block: int = 32) -> torch.Tensor:
    """fake_quant(apply_rope(rms_norm(x, norm_weight, eps)), quant, quant_block) with the norm optional: the KV /
    index producers' chain. quant: None, 'fp8' (1×block ue8m0), 'fp4_ue8m0', 'fp4_e4m3'. One fused kernel on the
    fast path (mini/kernels/rope_quant.py) instead of ~20 elementwise launches, where its blocks fit the shape."""
    if quant not in _QUANT:
        raise ValueError(f"unknown fake-quant kind {quant!r}")
    if use_fast(x) and x.dtype == torch.bfloat16:
        from mini.kernels.rope_quant import rope_quant, supported
        if supported(x.shape[-1], 2 * table.shape[-1], quant, quant_block):
            return rope_quant(x, table, False, norm_weight, eps, quant, quant_block)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    return _QUANT[quant](apply_rope(x, table), quant_block)
