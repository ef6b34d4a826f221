"""The ViT's residual add and RMSNorm in one pass (mini/ops/vision.py's fast path): x + delta rounded to x's dtype
(the residual stream, as torch's bf16 add rounds it), then mini.ops.norm.rms_norm of that rounded row (fp32
statistics, eps 1e-6, result in x's dtype). `delta` None: the norm alone. One program holds BLOCK_R whole rows in
registers: at V4.1's width 1,024 a row is read once and the stream and the normed row written once, where the
torch ops (an add, then float, square, mean, rsqrt, two products and a cast) each made a pass over fp32 copies."""
import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, R, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_R: tl.constexpr, ADD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    ok = (rows < R)[:, None] & (d < D)[None, :]
    ptrs = rows.to(tl.int64)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + ptrs, mask=ok, other=0.0)
    if ADD:  # the residual stream rounded as the reference's `x + delta` rounds it, and normed from that
        x = (x.to(tl.float32) + tl.load(d_ptr + ptrs, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + ptrs, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + ptrs, (w[None, :] * (xf * inv[:, None])).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s, weight, eps)) with s = x + delta (x itself when `delta` is None), over rows [R, D]."""
    if x.dim() != 2 or (delta is not None and delta.shape != x.shape) or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, delta {None if delta is None else tuple(delta.shape)}, "
                         f"weight {tuple(weight.shape)}: want rows [R, D], delta like x, weight [D]")
    R, D = x.shape
    x = x.contiguous()
    s = x if delta is None else torch.empty_like(x)
    out = torch.empty_like(x)
    if R:
        block_d = triton.next_power_of_2(D)
        block_r = max(1, min(16, 4096 // block_d))
        _add_rms_norm_kernel[(triton.cdiv(R, block_r),)](
            x, x if delta is None else delta.contiguous(), weight, s, out, R, eps, D=D, BLOCK_D=block_d,
            BLOCK_R=block_r, ADD=delta is not None, num_warps=num_warps)
    return s, out
