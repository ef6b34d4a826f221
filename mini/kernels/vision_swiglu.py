"""The ViT MLP's SwiGLU (mini/ops/vision.py's fast path): the w1 GEMM's output [R, 2I] (gate columns, then up)
-> silu(gate) * up [R, I], each rounded to the activation dtype where the reference's torch ops round it
(`F.silu(gate)`, then the product). One pass where the torch ops made two over strided halves."""
import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, R, I: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows < R)[:, None] & (cols < I)[None, :]
    src = rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
    g = tl.load(gu_ptr + src, mask=ok, other=0.0)
    u = tl.load(gu_ptr + src + I, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    out = (act.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :], out, mask=ok)


def swiglu(gu: torch.Tensor, num_warps: int = 4) -> torch.Tensor:
    """gu [R, 2I] -> silu(gu[:, :I]) * gu[:, I:], [R, I] in gu's dtype."""
    if gu.dim() != 2 or gu.shape[1] % 2:
        raise ValueError(f"swiglu: gu {tuple(gu.shape)}: want [R, 2I], gate columns then up columns")
    R, I = gu.shape[0], gu.shape[1] // 2
    gu = gu.contiguous()
    out = torch.empty(R, I, dtype=gu.dtype, device=gu.device)
    if R and I:
        block_c = min(512, triton.next_power_of_2(I))
        block_r = max(1, 2048 // block_c)
        _swiglu_kernel[(triton.cdiv(R, block_r), triton.cdiv(I, block_c))](gu, out, R, I=I, BLOCK_R=block_r,
                                                                           BLOCK_C=block_c, num_warps=num_warps)
    return out
