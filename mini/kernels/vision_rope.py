"""The ViT's qkv split with its 2D RoPE (mini/ops/vision.py's fast path): the qkv GEMM's output [N, 3C] (q, k, v
side by side, each `heads` heads of hd) -> q, k, v as one [3, N, heads, hd] tensor, q and k rotated on the way
(rotate-half pairs x_i, x_{i + hd/2} by the row's angles: (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, rounded once
to the activation dtype, as mini.ops.vision.rotate), v copied. One pass over qkv where the torch ops made a dozen
(a float copy, chunks, four products, two sums, a cat and a cast, each for q and for k).

Built without FMA contraction (`enable_fp_fusion=False`): each product is rounded to fp32 before the sum, as the
reference's separate torch ops round it, so the rotated q and k are the reference's bits."""
import torch
import triton
import triton.language as tl


@triton.jit
def _split_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, N, HEADS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr):
    # a program: BLOCK_R rows; its tile's column p is pair p % HALF of head p // HALF, over the 2 * HEADS heads of
    # q then k (they are adjacent in qkv), then v's HEADS heads copied as pairs too
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = rows.to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    head, j = p // HALF, p % HALF
    C: tl.constexpr = HEADS * 2 * HALF
    row_ok = rows < N
    qk_ok = row_ok[:, None] & (p < 2 * HEADS * HALF)[None, :]
    src = r64[:, None] * (3 * C) + (head * 2 * HALF + j)[None, :]  # x1 of the pair; x2 is HALF on
    x1 = tl.load(qkv_ptr + src, mask=qk_ok, other=0.0)
    x2 = tl.load(qkv_ptr + src + HALF, mask=qk_ok, other=0.0)
    angle = r64[:, None] * HALF + j[None, :]
    cos = tl.load(cos_ptr + angle, mask=qk_ok, other=1.0)
    sin = tl.load(sin_ptr + angle, mask=qk_ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # q at [0, N, ...], k at [1, N, ...]: head h of q / k is head (h % HEADS) of block h // HEADS
    dst = ((head // HEADS).to(tl.int64) * N)[None, :] * C + r64[:, None] * C \
        + ((head % HEADS) * 2 * HALF + j)[None, :]
    tl.store(out_ptr + dst, (a * cos - b * sin).to(x1.dtype), mask=qk_ok)
    tl.store(out_ptr + dst + HALF, (b * cos + a * sin).to(x1.dtype), mask=qk_ok)
    v_ok = row_ok[:, None] & (p < HEADS * HALF)[None, :]
    vsrc = r64[:, None] * (3 * C) + 2 * C + (head * 2 * HALF + j)[None, :]
    vdst = (r64 + 2 * N)[:, None] * C + (head * 2 * HALF + j)[None, :]
    tl.store(out_ptr + vdst, tl.load(qkv_ptr + vsrc, mask=v_ok), mask=v_ok)
    tl.store(out_ptr + vdst + HALF, tl.load(qkv_ptr + vsrc + HALF, mask=v_ok), mask=v_ok)


def split_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
               num_warps: int = 4) -> torch.Tensor:
    """qkv [N, 3 * heads * hd], cos and sin fp32 [N, hd / 2] (each row's angles) -> [3, N, heads, hd]: q and k
    rotated, v as it is."""
    N, width = qkv.shape
    half = cos.shape[-1]
    if width != 3 * heads * 2 * half or cos.shape != (N, half) or sin.shape != (N, half):
        raise ValueError(f"split_rope: qkv {tuple(qkv.shape)} with {heads} heads, cos {tuple(cos.shape)}, sin "
                         f"{tuple(sin.shape)}: want qkv [N, 3 * heads * hd] and angle tables [N, hd / 2]")
    qkv = qkv.contiguous()
    out = torch.empty(3, N, heads, 2 * half, dtype=qkv.dtype, device=qkv.device)
    if N:
        block_p = triton.next_power_of_2(2 * heads * half)
        block_r = max(1, min(16, 2048 // block_p))
        _split_rope_kernel[(triton.cdiv(N, block_r),)](
            qkv, cos.float().contiguous(), sin.float().contiguous(), out, N, HEADS=heads, HALF=half,
            BLOCK_P=block_p, BLOCK_R=block_r, num_warps=num_warps, enable_fp_fusion=False)
    return out
