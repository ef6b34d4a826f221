"""FP8 e4m3 activation fake quantization, 1 x block groups with power-of-two (ue8m0) scales, in one pass.

Same function as `mini.formats.fake_quant_fp8`: s = 2^ceil(log2(max(amax, 1e-4) / 448)) from the bits of the fp32
value (exponent + (mantissa != 0)), q = e4m3_rne(clamp(x / s, ±448)), out = q * s in x's dtype. Division and
product by a power of two are exact, so the only rounding is the e4m3 one.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def e4m3_round(v):
    """fp32 v (|v| <= 448) -> the nearest e4m3 value, ties to even, as fp32. Written with bit arithmetic rather than
    a cast so that it rounds the same everywhere (Triton's interpreter casts with ties away from zero)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits (mask 0xFFF00000)
    sub = (v * 512.0 + 12582912.0) - 12582912.0  # below 2^-6 the step is 2^-9: round v * 2^9 to an integer
    return tl.where(tl.abs(v) < 0.015625, sub * (1.0 / 512.0), normal.to(tl.float32, bitcast=True))


@triton.jit
def fp8_group_quant(v, GROUPS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Fake-quantize fp32 `v` [ROWS, GROUPS * BLOCK] in groups of BLOCK consecutive columns; returns fp32."""
    g = tl.reshape(v, [ROWS, GROUPS, BLOCK])
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-4) * (1.0 / 448.0)
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    q = e4m3_round(tl.clamp(g * inv[:, :, None], -448.0, 448.0))
    return tl.reshape(q * scale[:, :, None], [ROWS, GROUPS * BLOCK])


@triton.jit
def _act_quant_kernel(x_ptr, out_ptr, n_rows, n_cols, stride_x, stride_out,
                      BLOCK: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * (GROUPS * BLOCK) + tl.arange(0, GROUPS * BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    r64 = rows.to(tl.int64)[:, None]
    v = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = fp8_group_quant(v, GROUPS, BLOCK, ROWS)
    tl.store(out_ptr + r64 * stride_out + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_act_quant(x: torch.Tensor, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] (D a multiple of `block`) -> fake-quantized [T, D] in x.dtype."""
    if x.dim() != 2 or x.shape[1] % block:
        raise ValueError(f"fp8_act_quant takes [T, D] with D a multiple of {block}, got {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty_like(x) if out is None else out
    T, D = x.shape
    groups = max(1, min(512 // block, triton.next_power_of_2(D // block)))
    rows = 4
    grid = (triton.cdiv(T, rows), triton.cdiv(D, groups * block))
    _act_quant_kernel[grid](x, out, T, D, x.stride(0), out.stride(0), BLOCK=block, GROUPS=groups, ROWS=rows)
    return out
