"""Byte layouts of packed MXFP4 weights (plain PyTorch, no Triton: importable anywhere).

checkpoint: byte j of a row holds codes 2j (low nibble) and 2j+1 (high nibble).
split:      in each group of 64 k (32 bytes), byte j holds codes j (low) and 32 + j (high), so a kernel decodes the
            two nibbles into two contiguous 32-wide halves, each with a single E8M0 scale, without interleaving.
"""
import torch

from mini.formats import pack_fp4, unpack_fp4_codes


def split_layout(data: torch.Tensor) -> torch.Tensor:
    """checkpoint layout [..., K/2] (K a multiple of 64) -> split layout, uint8."""
    codes = unpack_fp4_codes(data).unflatten(-1, (-1, 2, 32))
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).flatten(-2)


def checkpoint_layout(data: torch.Tensor) -> torch.Tensor:
    """split layout -> checkpoint layout, uint8."""
    b = data.view(torch.uint8).unflatten(-1, (-1, 32))
    return pack_fp4(torch.stack([b & 15, b >> 4], dim=-2).flatten(-3))
