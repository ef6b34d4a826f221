"""MoE combine: out[t] = sum over the slots j of token t, in slot order, of y[slot_row[t, j]] for the slots whose
expert is held here (+ `add[t - add_at]` for the rows add_at..add_at + len(add)), accumulated in fp32 and written
once. The EP exchange adds its own tokens' shared expert output here (add_at = where its rows start among the
gathered ones) instead of in a pass of its own after the reduce-scatter.

Rows of experts held elsewhere are never read (their loads are masked off), so they may hold anything. No atomics:
the result does not depend on scheduling.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mini.kernels.mxfp4_grouped_gemm import round_bf16


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, slot_row_ptr, add_ptr, out_ptr,
                    D, e_lo, e_hi, add_at, n_add, stride_y, stride_ids, stride_slot, stride_add, stride_out,
                    K: tl.constexpr, HAS_ADD: tl.constexpr, ROUND_BF16: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_ok = d < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(K):
        e = tl.load(ids_ptr + t * stride_ids + j)
        row = tl.load(slot_row_ptr + t * stride_slot + j).to(tl.int64)
        local = (e >= e_lo) & (e < e_hi)
        acc += tl.load(y_ptr + row * stride_y + d, mask=d_ok & local, other=0.0).to(tl.float32)
    if HAS_ADD:
        a = t - add_at
        acc += tl.load(add_ptr + a.to(tl.int64) * stride_add + d, mask=d_ok & (a >= 0) & (a < n_add),
                       other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(out_ptr + t * stride_out + d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def combine(y: torch.Tensor, ids: torch.Tensor, slot_row: torch.Tensor, experts: range, out_dtype: torch.dtype,
            add: torch.Tensor | None = None, out: torch.Tensor | None = None, add_at: int = 0,
            block_d: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """y [R, D] expert outputs by sorted row, ids [T, k] global expert ids, slot_row [T, k] sorted row of each
    slot -> [T, D] in out_dtype. `add` [A, D] is added to the rows add_at..add_at + A (default: A = T, from 0).
    For bf16 out_dtype the fp32 sum is rounded once, as the reference's `y.type_as(x)`. A program takes one token's
    `block_d` columns (None: up to 1,024)."""
    T, k = ids.shape
    D = y.shape[1]
    if slot_row.shape != ids.shape or y.stride(1) != 1 or (ids.numel() and ids.stride(1) != 1):
        raise ValueError("combine: slot_row must match ids, and y and ids must have unit column stride")
    if add is not None and (add.dim() != 2 or add.shape[1] != D or add.stride(1) != 1 or add_at < 0
                            or add_at + add.shape[0] > T):
        raise ValueError(f"combine: add must be a row-major [A, {D}] tensor with 0 <= add_at and add_at + A <= {T}, "
                         f"got {tuple(add.shape)} at {add_at}")
    out = torch.empty(T, D, dtype=out_dtype, device=y.device) if out is None else out
    if T == 0:
        return out
    if add is not None and add.shape[0] == 0:  # an idle EP rank's shared output: nothing to add (and no pointer)
        add = None
    BD = block_d or min(1024, triton.next_power_of_2(D))
    grid = (T, triton.cdiv(D, BD))
    _combine_kernel[grid](y, ids, slot_row, add if add is not None else y, out,
                          D, experts.start, experts.stop, add_at, add.shape[0] if add is not None else 0,
                          y.stride(0), ids.stride(0), slot_row.stride(0), add.stride(0) if add is not None else 0,
                          out.stride(0),
                          K=k, HAS_ADD=add is not None, ROUND_BF16=out.dtype == torch.bfloat16, BD=BD,
                          num_warps=num_warps)
    return out
