"""Batch-invariant GEMMs for the deterministic mode (`mini.ops.set_deterministic`): a row of the output is computed
the same way however many rows the call has.

cuBLAS picks its kernel (tile shape, split-K, stream-K, sliced-K warps) from the problem's M, so a token's linear
layers round differently when the step holds 1, 37 or 4,096 tokens; that alone changes greedy answers under load
(docs/design.md, Determinism). `matmul` below is one Triton kernel with ONE fixed tile configuration per input
dtype: every output element is an fp32 sum over K in BLOCK_K steps, in increasing k, each step one tensor-core
dot (bf16/fp16) or an IEEE fp32 dot (fp32: what torch's fp32 GEMM computes, no TF32), then alpha, the addend and
one rounding to the output dtype. No split of K, no choice by M (M is not even specialized at compile time; K
is a compile-time constant, one build per weight width), so row r's bits depend only on row r of A and on B.

`enable()` makes it aten's CUDA implementation of mm, addmm and bmm (and their out= / out_dtype forms), so that
every GEMM of the process takes it (F.linear, @, einsum, torch.mm(..., out_dtype=)) without touching each call
site; `disable()` restores cuBLAS. Only floating inputs of one dtype (bf16, fp16, fp32) are taken; anything else
raises, naming what it got, rather than silently falling back to a batch-dependent kernel.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mini.kernels.aten_override import AtenOverride, check_out

# one tile configuration per input dtype (the point: never chosen by M). 16-bit: wgmma-sized tiles; fp32: FMA
# (IEEE) dots, whose registers allow smaller tiles
CONFIGS = {torch.bfloat16: dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4),
           torch.float16: dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4),
           torch.float32: dict(BM=64, BN=64, BK=32, num_warps=4, num_stages=2)}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(a_ptr, b_ptr, c_ptr, add_ptr, M, N,
               s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_addb, s_addm, s_addn, alpha, beta,
               K: tl.constexpr, HAS_ADD: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr,
               DOT_DTYPE: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)  # N tiles of one row tile are neighbours: the row tile stays in L2
    pid_m = tl.program_id(1)
    bat = tl.program_id(2).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    row_ok = rows < M
    col_ok = cols < N
    a_base = a_ptr + bat * s_ab + rows.to(tl.int64)[:, None] * s_am
    b_base = b_ptr + bat * s_bb + cols.to(tl.int64)[None, :] * s_bn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + kk
        k_ok = k < K
        a = tl.load(a_base + k.to(tl.int64)[None, :] * s_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + k.to(tl.int64)[:, None] * s_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=PRECISION)
    if SCALE:
        acc = acc * alpha
    ok = row_ok[:, None] & col_ok[None, :]
    if HAS_ADD:
        add_ptrs = add_ptr + bat * s_addb + rows.to(tl.int64)[:, None] * s_addm + cols.to(tl.int64)[None, :] * s_addn
        add = tl.load(add_ptrs, mask=ok, other=0.0).to(tl.float32)
        acc = acc + beta * add
    c = c_ptr + bat * s_cb + rows.to(tl.int64)[:, None] * s_cm + cols.to(tl.int64)[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=ok)


def _check(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    if a.dtype != b.dtype or a.dtype not in CONFIGS:
        raise NotImplementedError(f"deterministic mode: {op} takes bf16, fp16 or fp32 operands of one dtype, got "
                                  f"{a.dtype} x {b.dtype} (no batch-invariant kernel for that)")


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
        add: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """out[i] = alpha * a[i] @ b[i] (+ beta * add[i]) for a [B, M, K], b [B, K, N], add broadcastable to [B, M, N];
    fp32 accumulation, one rounding to out's dtype (default: a's, or `out_dtype`). Any strides."""
    _check(a, b, "bmm")
    Bt, M, K = a.shape
    N = b.shape[2]
    if b.shape[0] != Bt or b.shape[1] != K:
        raise ValueError(f"bmm: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    dtype = out_dtype or (out.dtype if out is not None else a.dtype)
    out = torch.empty(Bt, M, N, dtype=dtype, device=a.device) if out is None else out
    if out.shape != (Bt, M, N):
        raise ValueError(f"bmm: out has shape {tuple(out.shape)}, expected {(Bt, M, N)}")
    if out.numel() == 0:
        return out
    if K == 0:
        return out.copy_(torch.zeros_like(out) if add is None else (beta * add).expand(Bt, M, N))
    add_t = add.expand(Bt, M, N) if add is not None else out
    cfg = CONFIGS[a.dtype]
    fp32 = a.dtype == torch.float32
    grid = (triton.cdiv(N, cfg["BN"]), triton.cdiv(M, cfg["BM"]), Bt)
    _mm_kernel[grid](a, b, out, add_t, M, N, *a.stride(), *b.stride(), *out.stride(), *add_t.stride(),
                     float(alpha), float(beta), K=K, HAS_ADD=add is not None, SCALE=alpha != 1.0,
                     PRECISION="ieee" if fp32 else "tf32",
                     DOT_DTYPE=tl.float32 if (fp32 or _INTERPRET) else
                     (tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float16),
                     BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], num_warps=cfg["num_warps"],
                     num_stages=cfg["num_stages"])
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           add: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """The 2-D case of `bmm`: a [M, K] @ b [K, N] (+ beta * add, broadcastable to [M, N])."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"matmul: expected 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    M, N = a.shape[0], b.shape[1]
    o = None if out is None else out.unsqueeze(0)
    r = bmm(a.unsqueeze(0), b.unsqueeze(0), o, out_dtype, None if add is None else add.expand(M, N).unsqueeze(0),
            alpha, beta)
    return r[0] if out is None else out


# ---------------------------------------------------------------------------------------------- aten overrides


def _mm(a, b):
    return matmul(a, b)


def _mm_out(a, b, *, out):
    check_out(out, (a.shape[0], b.shape[1]))
    return matmul(a, b, out=out)


def _mm_dtype(a, b, out_dtype):
    return matmul(a, b, out_dtype=out_dtype)


def _addmm(add, a, b, *, beta=1, alpha=1):
    return matmul(a, b, add=add if beta != 0 else None, alpha=alpha, beta=beta, out_dtype=a.dtype)


def _bmm(a, b):
    return bmm(a, b)


def _bmm_out(a, b, *, out):
    check_out(out, (a.shape[0], a.shape[1], b.shape[2]))
    return bmm(a, b, out=out)


_OVERRIDE = AtenOverride("CUDA", {
    "mm": _mm,
    "mm.out": _mm_out,
    "addmm": _addmm,
    "bmm": _bmm,
    "bmm.out": _bmm_out,
    "mm.dtype": _mm_dtype,
})
enable, disable, enabled = _OVERRIDE.enable, _OVERRIDE.disable, _OVERRIDE.enabled
