"""RMSNorm over the last dim in one pass: mini.ops.norm.rms_norm's fast path (fp32 statistics, result in x's
dtype), optionally followed by the FP8 1×block fake quant of its consumer GEMM (`quant`, the benchmark's variant;
the op does not ask for it). The torch op is ~6 kernels per call (float, square, mean, add + rsqrt, two products),
a few microseconds each at decode, where a row is a few KB (issue 28).

Same function as the reference, in its order: inv = rsqrt(sum(x²) · (1/D) + eps) (torch's CUDA mean multiplies
the sum by 1/D; its rsqrt is the same rsqrt.approx), then weight · (x · inv) in fp32, one rounding to x's dtype.
The sum of squares is a tree over the row (torch's CUDA reduction sums in another order), so the statistic may
differ from torch's by an fp32 ulp and, rarely, an output by one rounding step of its dtype. One program holds
BLOCK_R whole rows in registers (up to MAX_D columns; wider rows run the torch op); a row's sum depends on D only,
never on how many rows a step has, so the norm is batch-invariant (the deterministic mode needs no variant).
"""
import torch
import triton
import triton.language as tl

from mini.formats.quant import fake_quant_enabled
from mini.kernels.quant import fake_quant_tile, kind_code

MAX_D = 16384  # whole rows in registers: 16 warps hold 32 values of x (and of the weight) per thread at this width
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, stride_x, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_R: tl.constexpr, QUANT: tl.constexpr, QBLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    ok = (rows < R)[:, None] & (d < D)[None, :]
    ptrs = rows.to(tl.int64)[:, None] * D + d[None, :]  # out is contiguous; x's rows may be strided
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) * (1.0 / D) + eps)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = (w[None, :] * (x * inv[:, None])).to(out_ptr.dtype.element_ty)
    if QUANT != 0:  # the reference quantizes the rounded norm output
        y = fake_quant_tile(y.to(tl.float32), BLOCK_R, BLOCK_D, QBLOCK, QUANT).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ptrs, y, mask=ok)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (else the op runs its torch code): a float x of at most MAX_D
    columns, a float weight of one value per column, both on one device."""
    D = x.shape[-1] if x.dim() else 0
    return (x.dtype in DTYPES and weight.dtype in DTYPES and 0 < D <= MAX_D and weight.shape == (D,)
            and x.device == weight.device)


def tiles(D: int) -> tuple[int, int, int]:
    """(block_d, block_r, num_warps) for rows of D columns: the whole row, up to 16 rows per ~4K values, and more
    warps for wide rows (4 up to 4,096 columns, 8 at V4.1's 5,120, 16 up to MAX_D). By D alone: batch-invariant."""
    block_d = triton.next_power_of_2(D)
    return block_d, max(1, min(16, 4096 // block_d)), min(16, max(4, block_d // 1024))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: str | None = None,
             quant_block: int = 32) -> torch.Tensor:
    """mini.ops.norm.rms_norm over the last dim of x [..., D] (fp32 statistics, result in x.dtype), optionally
    followed by the FP8 1×quant_block fake quant (quant='fp8'). `supported(x, weight)` must hold. A 2-D x whose
    rows are strided (a column slice of a stacked projection's output) is read in place; the output is contiguous."""
    if not supported(x, weight):
        raise ValueError(f"rms_norm kernel: x {tuple(x.shape)} {x.dtype} on {x.device}, weight "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}: want float rows of 1..{MAX_D} "
                         "columns and a weight of one value per column on the same device")
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x = x.reshape(-1, D)  # rows: a view where it can be
    if x.stride(-1) != 1:
        x = x.contiguous()
    R = x.shape[0]
    if not fake_quant_enabled():
        quant = None
    if quant is not None:
        assert D % quant_block == 0
    if R:
        block_d, block_r, num_warps = tiles(D)
        _rms_norm_kernel[(triton.cdiv(R, block_r),)](x, weight.contiguous(), out, R, x.stride(0), eps, D=D,
                                                     BLOCK_D=block_d, BLOCK_R=block_r, QUANT=kind_code(quant),
                                                     QBLOCK=quant_block, num_warps=num_warps)
    return out
