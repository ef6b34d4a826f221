"""The indexer top-k's integer keys in one pass (mini.ops.indexer._order_keys, issue 28: fewer kernels per decode
layer). A key orders a bf16 score first by value, then by column, so that one integer top-k picks the k largest
scores and breaks ties toward the newer (higher) column:

    key = order_bits(value) << 16 | column,  order_bits(b) = b ^ ((b >> 15) & 0x7FFF)  (b: the int16 bits)

which flips the magnitude bits of negative values (a larger magnitude, a smaller key). The torch form takes seven
elementwise kernels for it (`x + 0.0`, the column index, the widening, four bit operations); here each program
reads BLOCK columns of one row and writes their keys. As `x + 0.0` does, -0.0 becomes +0.0 (they tie), and every
NaN becomes 0x7FFF, which torch's bf16 add on CUDA returns for a NaN (above +inf, tied with every other NaN). On the
CPU torch's add may keep a NaN's bits instead (its vector path): the keys there agree with the torch form's
wherever the value is a number.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COLS = 1 << 16  # the column fits the key's low 16 bits
BLOCK = 1024


def supported(x: torch.Tensor) -> bool:
    """bf16 rows of 1 to 2^16 columns (the torch form's int32 keys); others take the torch form (int64 keys)."""
    return x.dtype == torch.bfloat16 and x.dim() >= 1 and 0 < x.shape[-1] <= MAX_COLS


@triton.jit
def is_nan_bits(bits):
    """Whether bf16 bits (int16, sign-extended to int32) are a NaN's."""
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x7F) != 0)


@triton.jit
def order_key(bits, cols):
    """int32 keys of bf16 bits (int16, sign-extended to int32) at columns `cols` (the module docstring's rule)."""
    bits = tl.where(bits == -32768, 0, bits)  # -0.0 -> +0.0
    bits = tl.where(is_nan_bits(bits), 0x7FFF, bits)  # NaN -> CUDA's one NaN
    return ((bits ^ ((bits >> 15) & 0x7FFF)) << 16) | cols


@triton.jit
def _order_keys_kernel(x_ptr, out_ptr, N, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    bits = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0).to(tl.int32)  # int16 bits, sign-extended
    tl.store(out_ptr + row * stride_out + cols, order_key(bits, cols), mask=ok)


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys [..., N] of bf16 x [..., N] (`supported`): mini.ops.indexer._order_keys's torch form on CUDA."""
    if not supported(x):
        raise ValueError(f"order_keys: bf16 rows of 1 to {MAX_COLS} columns expected, got {x.dtype} "
                         f"{tuple(x.shape)}")
    N = x.shape[-1]
    rows = x.reshape(-1, N)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.int32, device=x.device)
    if rows.shape[0]:
        _order_keys_kernel[(rows.shape[0], triton.cdiv(N, BLOCK))](
            rows.view(torch.int16), out, N, rows.stride(0), out.stride(0), BLOCK=BLOCK)
    return out.view(x.shape)
