"""The greedy pick of biased logits: out = a + b, ids = argmax(out) per row (DSpark's Markov chain, spec §2.7:
each draft position's logits are its base logits plus the Markov head's bias for the token picked before it).

The reference is torch's add and argmax (the largest value, NaN above all, the first column among equals); on the
fast path one Triton pass over the rows computes both (mini/kernels/add_argmax.py), the same sums and the same ids.
"""
from __future__ import annotations

import torch

from mini.ops import use_fast


def add_argmax(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """fp32 a, b [R, N] -> out = a + b (written into `out`, [R, N], any row stride) and int64 ids [R]."""
    if use_fast(a, b, out):
        from mini.kernels import add_argmax as kernel
        if kernel.supported(a, b, out):
            return kernel.add_argmax(a, b, out)
    return torch.add(a, b, out=out).argmax(-1)
