"""Batch-invariant CPU GEMMs for the deterministic mode (`mini.ops.set_deterministic`): the CPU twin of
mini/kernels/batch_invariant.py, for the reference backend.

CPU BLAS (MKL / oneDNN) picks its kernel and blocking by the problem's M: a row of an fp32 product rounds
differently when the call has 1, 2 or 64 rows (measured on torch 2.13 + MKL 2024.2: rows of M = 1..10 differ from
the same rows in an M = 64 product at K = 256). On a model that fake-quantizes activations to FP8, one such ulp
now and then flips an FP8 rounding (a 2^-10 step in an expert's output), which travels down the sequence through
the caches and can change a greedy token: issue 18's `test_one_token_prompt_batched_equals_alone` (a decode step
of 1 row vs 2 rows, 3.6e-7 apart at layer 0's mHC projection, 1e-3 after layer 1's MoE, another 3rd token).

`enable()` makes aten's CPU mm / addmm / bmm (and mm.out / bmm.out) compute every output row by its own
matrix-vector product over a fresh (aligned) copy of the row: row r's bits then depend only on row r and the
other operand, never on how many rows share the call. Slower than one GEMM (one BLAS call per row), which is why
only the deterministic mode takes it; `disable()` restores torch's kernels.
"""
from __future__ import annotations


import torch

from mini.kernels.aten_override import AtenOverride, check_out



def _rows_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: torch.Tensor | None = None,
               alpha=1, beta=1) -> torch.Tensor:
    """out[i] = alpha * a[i] @ b (+ beta * add[i]) for a [M, K], b [K, N], add broadcastable to [M, N]: one gemv
    per row, each on a fresh contiguous copy (BLAS may take another path for another alignment)."""
    M, N = a.shape[0], b.shape[1]
    bt = b.t().contiguous().clone()  # [N, K], fresh: the same layout and alignment whatever the caller's b
    add = None if add is None or beta == 0 else add.expand(M, N)
    for i in range(M):
        row = a[i].clone(memory_format=torch.contiguous_format)
        if add is None:
            r = torch.mv(bt, row)
            if alpha != 1:
                r = r * alpha
        else:
            r = torch.addmv(add[i].clone(memory_format=torch.contiguous_format), bt, row, beta=beta, alpha=alpha)
        out[i].copy_(r)
    return out


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _rows_into(a.new_empty(a.shape[0], b.shape[1]), a, b)


def _mm_out(a, b, *, out):
    check_out(out, (a.shape[0], b.shape[1]))
    return _rows_into(out, a, b)


def _mm_dtype(a, b, out_dtype):
    return _rows_into(a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype), a.to(out_dtype), b.to(out_dtype))


def _addmm(add, a, b, *, beta=1, alpha=1):
    return _rows_into(a.new_empty(a.shape[0], b.shape[1]), a, b, add, alpha, beta)


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2]) if out is None else out
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise RuntimeError(f"bmm: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    for i in range(a.shape[0]):
        _rows_into(out[i], a[i], b[i])
    return out


def _bmm_out(a, b, *, out):
    check_out(out, (a.shape[0], a.shape[1], b.shape[2]))
    return bmm(a, b, out)


# ---------------------------------------------------------------------------------------------- elementwise
# aten's CPU loops run 2 SIMD vectors at a time and the leftover elements (numel mod 2 vectors) through the scalar
# formula, which rounds differently for sigmoid, silu and softplus (measured; exp, log, tanh, sqrt agree): a row
# of a [T, 16] tensor takes the scalar path at T = 1 and the vector path at T = 2. Computed over a zero-padded
# copy in pieces of PIECE elements (a multiple of every 2-vector width, under aten's parallel grain of 32,768, so
# one thread and no leftover), every element takes the vector path.
PIECE = 1 << 14
PAD = 128


def _vectorized(out_op):
    def run(x: torch.Tensor, *args):
        flat = x.reshape(-1)
        n = flat.numel()
        padded = flat.new_zeros(-(-n // PAD) * PAD)
        padded[:n] = flat
        res = torch.empty_like(padded)
        for lo in range(0, padded.numel(), PIECE):
            out_op(padded[lo:lo + PIECE], *args, out=res[lo:lo + PIECE])
        return res[:n].view(x.shape)
    return run


_sigmoid = _vectorized(torch.ops.aten.sigmoid.out)
_silu = _vectorized(torch.ops.aten.silu.out)
_softplus_any = _vectorized(torch.ops.aten.softplus.out)


def _softplus(x, beta=1, threshold=20):
    return _softplus_any(x, beta, threshold)


_OVERRIDE = AtenOverride("CPU", {
    "mm": mm,
    "mm.out": _mm_out,
    "addmm": _addmm,
    "bmm": bmm,
    "bmm.out": _bmm_out,
    "mm.dtype": _mm_dtype,
    "sigmoid": _sigmoid,
    "silu": _silu,
    "softplus": _softplus,
})
enable, disable, enabled = _OVERRIDE.enable, _OVERRIDE.disable, _OVERRIDE.enabled
