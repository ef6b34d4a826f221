"""RoPE with its producer and consumer fused: optional RMSNorm in front (kv_norm / k_norm), the interleaved rotation
of the last `rope_dim` channels (mini/ops/rope.py `apply_rope`, inverse = conjugate), and an optional fake quant of
the rotated row (mini/formats/quant.py): FP8 1×32 ue8m0 (V4.1 window KV), FP4 1×32 ue8m0 (index q / k), FP4 1×16
e4m3 (V4.1 compressed KV). Each stage rounds to the activation dtype where the reference's separate ops do.

The quant blocks never straddle the nope/rope boundary (rope_dim and the nope width are multiples of the block), so
the two parts are quantized as separate register tiles. A program handles BLOCK_R rows of x viewed as [rows, d];
the RoPE table row of a row is row // heads.
"""
import torch
import triton
import triton.language as tl

from mini.formats.quant import fake_quant_enabled
from mini.kernels.quant import fake_quant_tile, kind_code


@triton.jit
def _rope_quant_kernel(
    x_ptr, table_ptr, norm_w_ptr, out_ptr, R, heads, stride_n, stride_h, eps, sin_sign,
    D: tl.constexpr, RD: tl.constexpr, NOPE_P: tl.constexpr, BLOCK_R: tl.constexpr,
    NORM: tl.constexpr, QUANT: tl.constexpr, QBLOCK: tl.constexpr,
):
    NOPE: tl.constexpr = D - RD
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    base = rows.to(tl.int64)[:, None] * D  # out is contiguous; x's rows may be a strided view (a stacked GEMM's)
    at = ((rows // heads).to(tl.int64) * stride_n + (rows % heads).to(tl.int64) * stride_h)[:, None]
    c = tl.arange(0, NOPE_P)
    c_ok = row_ok[:, None] & (c < NOPE)[None, :]
    cr = NOPE + tl.arange(0, RD)
    nope = tl.load(x_ptr + at + c[None, :], mask=c_ok, other=0.0)
    tail = tl.load(x_ptr + at + cr[None, :], mask=row_ok[:, None], other=0.0)
    if NORM:
        nf = nope.to(tl.float32)
        tf = tail.to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(nf * nf, axis=1) + tl.sum(tf * tf, axis=1)) / D + eps)
        w_n = tl.load(norm_w_ptr + c, mask=c < NOPE, other=0.0).to(tl.float32)
        w_t = tl.load(norm_w_ptr + cr).to(tl.float32)
        nope = (w_n[None, :] * (nf * inv[:, None])).to(nope.dtype)
        tail = (w_t[None, :] * (tf * inv[:, None])).to(tail.dtype)

    a, b = tl.split(tl.reshape(tail.to(tl.float32), [BLOCK_R, RD // 2, 2]))
    i = tl.arange(0, RD // 2)
    trow = (rows // heads).to(tl.int64)[:, None] * RD + 2 * i[None, :]
    cos = tl.load(table_ptr + trow, mask=row_ok[:, None], other=1.0)
    sin = tl.load(table_ptr + trow + 1, mask=row_ok[:, None], other=0.0) * sin_sign
    rot = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), [BLOCK_R, RD]).to(tail.dtype)

    nope = fake_quant_tile(nope.to(tl.float32), BLOCK_R, NOPE_P, QBLOCK, QUANT)
    rot = fake_quant_tile(rot.to(tl.float32), BLOCK_R, RD, QBLOCK, QUANT)
    tl.store(out_ptr + base + c[None, :], nope.to(out_ptr.dtype.element_ty), mask=c_ok)
    tl.store(out_ptr + base + cr[None, :], rot.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def supported(d: int, rope_dim: int, quant: str | None, quant_block: int) -> bool:
    """Whether the kernel can run this shape: the RoPE tail is a tile dimension (a power of two, its pairs too), and
    quant blocks must not straddle the nope/rope boundary (the tiny presets' 64-wide KV with a 16-wide RoPE tail
    and 1x32 blocks cannot); a vector of RoPE alone (V4's tiny index heads) rotates, but its empty nope tile
    cannot be quantized."""
    if rope_dim < 2 or rope_dim & (rope_dim - 1):
        return False
    return quant is None or (rope_dim % quant_block == 0 and d > rope_dim and (d - rope_dim) % quant_block == 0)


def rope_quant(x: torch.Tensor, table: torch.Tensor, inverse: bool = False, norm_weight: torch.Tensor | None = None,
               eps: float = 0.0, quant: str | None = None, quant_block: int = 32, block_r: int = 16,
               num_warps: int = 4) -> torch.Tensor:
    """x [n, d] or [n, heads, d], table complex64 [n, rope_dim // 2] -> fake_quant(apply_rope(rms_norm(x)))
    in x.dtype, contiguous; quant in (None, 'fp8', 'fp4_ue8m0', 'fp4_e4m3'). x is read in place when its last dim
    is contiguous (a column slice of a stacked projection's output), else copied first."""
    D = x.shape[-1]
    RD = 2 * table.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    assert x.shape[0] == table.shape[0]
    if not fake_quant_enabled():
        quant = None
    if not supported(D, RD, quant, quant_block):
        raise ValueError(f"rope_quant: width {D} with RoPE {RD} and {quant} blocks of {quant_block} is not a shape "
                         "the kernel takes (supported())")
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = x.numel() // D
    if R == 0:
        return out
    tab = torch.view_as_real(table.to(torch.complex64)).contiguous()  # [n, RD/2, 2]: cos, sin
    _rope_quant_kernel[(triton.cdiv(R, block_r),)](
        x, tab, norm_weight if norm_weight is not None else x, out, R, heads, x.stride(0),
        x.stride(1) if x.dim() == 3 else 0, eps, -1.0 if inverse else 1.0,
        D=D, RD=RD, NOPE_P=triton.next_power_of_2(max(D - RD, 1)), BLOCK_R=block_r, NORM=norm_weight is not None,
        QUANT=kind_code(quant), QBLOCK=quant_block, num_warps=num_warps)
    return out
