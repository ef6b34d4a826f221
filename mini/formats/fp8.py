"""FP8 e4m3 weights with E8M0 block scales: `W[o, i] * scale[o // B, i // B]`, B = 32 (V4.1) or 128 (V4).
Scale shape is [ceil(out/B), ceil(in/B)]."""
import torch

from mini.formats.e8m0 import e8m0_to_float, pow2_ceil_scale

FP8_MAX = 448.0


def _expand(scale: torch.Tensor, shape, block: int) -> torch.Tensor:
    s = e8m0_to_float(scale) if scale.dtype in (torch.uint8, torch.float8_e8m0fnu) else scale.float()
    return s.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


def dequant_fp8(w: torch.Tensor, scale: torch.Tensor, block: int, dtype=torch.float32) -> torch.Tensor:
    """e4m3 weight [out, in] (float8_e4m3fn or its uint8 bits) -> `dtype`."""
    w = w.view(torch.float8_e4m3fn).float()
    return (w * _expand(scale, w.shape, block)).to(dtype)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, saturating at +-448 (torch alone maps overflow to NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weight [out, in] -> (float8_e4m3fn [out, in], E8M0 uint8 [ceil(out/B), ceil(in/B)]), pow2 block scales."""
    o, i = w.shape
    po, pi = -o % block, -i % block
    g = torch.nn.functional.pad(w.float(), (0, pi, 0, po)).unflatten(0, (-1, block)).unflatten(-1, (-1, block))
    s = pow2_ceil_scale(g.abs().amax(dim=(1, 3)).clamp_min(1e-30) / FP8_MAX)  # [O/B, I/B]
    q = to_e4m3(w.float() / _expand(s, w.shape, block))
    return q, ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
