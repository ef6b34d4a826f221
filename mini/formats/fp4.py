"""E2M1 (FP4) values and MXFP4 weights.

A code has a sign bit (bit 3) and a 3-bit magnitude index into [0, 0.5, 1, 1.5, 2, 3, 4, 6]. MXFP4 weights are
stored as I8 `[out, in/2]`: the low nibble is element 2j, the high nibble element 2j+1 (packed along K), with one
E8M0 scale per 32 consecutive K elements, `[out, in/32]`.
"""
from functools import lru_cache

import torch

from mini.formats.e8m0 import e8m0_to_float

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# midpoints between consecutive magnitudes; round-to-nearest-even sends an exact tie up only when the upper code
# is even (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0)
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
FP4_MAX = 6.0


@lru_cache(maxsize=None)
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, mids, tie_up) on `device`, copied once: a copy from the host cannot run in a captured CUDA graph."""
    return E2M1_VALUES.to(device), _MIDS.to(device), _TIE_UP.to(device)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already scaled, |x| <= 6) -> 4-bit codes (uint8), round to nearest even, sign kept (-0 too)."""
    mag = x.float().abs().unsqueeze(-1)
    _, mids, up = _tables(x.device)
    code = (mag > mids).sum(-1) + ((mag == mids) & up).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of x (|x| <= 6), fp32."""
    return _tables(x.device)[0][e2m1_codes(x).long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> packed uint8 [..., K/2] (even element in the low nibble)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed bytes [..., K/2] (uint8 / int8 / float4_e2m1fn_x2) -> codes uint8 [..., K]."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """MXFP4 weight [out, in/2] + E8M0 scale [out, in/32] -> [out, in] in `dtype` (exact in bf16 unless the
    exponent leaves bf16's range)."""
    vals = E2M1_VALUES.to(packed.device)[unpack_fp4_codes(packed).long()]
    s = e8m0_to_float(scale)
    return (vals.unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weight [out, in] -> (packed uint8 [out, in/2], E8M0 uint8 [out, in/32]). Scale = 2^ceil(log2(amax/6))."""
    from mini.formats.e8m0 import pow2_ceil_scale
    g = w.float().unflatten(-1, (-1, 32))
    s = pow2_ceil_scale(g.abs().amax(-1).clamp_min(6 * 2.0 ** -126) / FP4_MAX)
    codes = e2m1_codes((g / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    e = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return pack_fp4(codes), e
