"""E8M0 (`float8_e8m0fnu`): an unsigned 8-bit exponent, value 2^(e-127); e=0 is 2^-127 (an fp32 subnormal) and
e=255 is NaN. Zero is not representable."""
import torch


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes (uint8 or float8_e8m0fnu) to fp32 without relying on torch's e8m0 cast."""
    e = e.view(torch.uint8).to(torch.int32)
    out = (e << 23).view(torch.float32)  # exact for 1..254
    out = torch.where(e == 0, torch.tensor(2.0 ** -127, dtype=torch.float32, device=e.device), out)
    return torch.where(e == 255, torch.tensor(float("nan"), device=e.device), out)


def pow2_ceil_scale(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive normal fp32 x, from the bits (exponent + (mantissa != 0)), as the reference's
    `fast_round_scale` does."""
    bits = x.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def float_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """Encode exact powers of two (fp32, 2^-126..2^127) as E8M0 bytes (uint8)."""
    bits = s.float().contiguous().view(torch.int32)
    if bool(((bits & 0x7FFFFF) != 0).any()) or bool((s <= 0).any()):
        raise ValueError("float_to_e8m0 takes positive powers of two only")
    return ((bits >> 23) & 0xFF).to(torch.uint8)
