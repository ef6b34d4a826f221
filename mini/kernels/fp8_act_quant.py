"""FP8 e4m3 activation fake quantization, 1 x block groups with power-of-two (ue8m0) scales, in one pass.

Same function as `mini.formats.fake_quant_fp8` (the tile math: mini.kernels.quant.fp8_group_quant), out in x's
dtype; optionally gathering rows by index first (the routed experts' rows in expert order).
"""
import torch
import triton
import triton.language as tl

from mini.kernels.quant import fp8_group_quant


@triton.jit
def _act_quant_kernel(x_ptr, out_ptr, src_row_ptr, n_valid_ptr, n_rows, n_cols, stride_x, stride_out,
                      BLOCK: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr, GATHER: tl.constexpr,
                      QUANT: tl.constexpr):
    if GATHER:  # the row count lives on the device (no host sync): programs past it return at once
        n_rows = tl.load(n_valid_ptr)
        if tl.program_id(0) * ROWS >= n_rows:
            return
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * (GROUPS * BLOCK) + tl.arange(0, GROUPS * BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    src = rows
    if GATHER:
        src = tl.load(src_row_ptr + rows, mask=rows < n_rows, other=0)
    v = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = v
    if QUANT:
        q = fp8_group_quant(v, GROUPS, BLOCK, ROWS)
    r64 = rows.to(tl.int64)[:, None]
    tl.store(out_ptr + r64 * stride_out + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_act_quant(x: torch.Tensor, block: int, out: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                  n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] (D a multiple of `block`) -> fake-quantized [T, D] in x.dtype.

    With `rows` (int [R]) and `n_valid` (a one-element int tensor on the device): out [R, D] with
    out[r] = fake_quant(x[rows[r]]) for r < n_valid; rows past it are left unwritten. block = 0 copies the rows
    without quantizing (activation fake quant switched off)."""
    if x.dim() != 2 or (block and x.shape[1] % block):
        raise ValueError(f"fp8_act_quant takes [T, D] with D a multiple of {block}, got {tuple(x.shape)}")
    if (rows is None) != (n_valid is None) or (rows is None and not block):
        raise ValueError("fp8_act_quant: pass rows and n_valid together; block 0 only with rows")
    x = x if x.stride(1) == 1 else x.contiguous()
    T, D = x.shape
    R = T if rows is None else rows.numel()
    out = torch.empty(R, D, dtype=x.dtype, device=x.device) if out is None else out
    if R == 0:
        return out
    group = block or 32
    groups = max(1, min(512 // group, triton.next_power_of_2(D // group)))
    n = 4
    grid = (triton.cdiv(R, n), triton.cdiv(D, groups * group))
    _act_quant_kernel[grid](x, out, rows if rows is not None else x, n_valid if n_valid is not None else x,
                            R, D, x.stride(0), out.stride(0), BLOCK=group, GROUPS=groups, ROWS=n,
                            GATHER=rows is not None, QUANT=block > 0)
    return out
