"""out = a + b and the greedy pick argmax(out) per row, fp32 rows, in one pass over the rows (mini.ops.greedy's fast
path: DSpark's Markov chain adds each position's bias to its base logits and picks, five times a draft step).

The torch form is an add (reading a and b, writing out) and torch.argmax reading out again: at V4.1's 129,280
columns the argmax of one row took 27 us on the H200 (one reduction block a row), 40 us for 64 rows
(tools/draft_census.py, docs/perf/027). Here a first kernel over (row, BLOCK-column chunk) programs adds, stores out,
and keeps each chunk's best column; a second, one program a row, picks the best chunk. "Best" is torch.argmax's
rule: the largest value, NaN above everything, the first column among equals (-0.0 equals +0.0). Each value is
turned into an int32 key ordered as the values (the bits of a non-negative float; the magnitude bits flipped for a
negative one; -0.0 as +0.0; every NaN the largest key), so both steps are integer maxima with ties to the lower
index: the result is exact, whatever the chunking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns per program of the first kernel
NAN_KEY = tl.constexpr(0x7FFFFFFF)  # every NaN's key: above every number's


@triton.jit
def _value_key(v):
    """int32 keys ordered as the fp32 values v (the module docstring's rule)."""
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 -> +0.0 (they are equal)
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(v != v, NAN_KEY, key)


@triton.jit
def _add_chunk_best_kernel(a_ptr, b_ptr, out_ptr, key_ptr, col_ptr, N, stride_a, stride_b, stride_out,
                           BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    v = tl.load(a_ptr + row * stride_a + cols, mask=ok, other=0.0) + tl.load(b_ptr + row * stride_b + cols, mask=ok,
                                                                            other=0.0)
    tl.store(out_ptr + row * stride_out + cols, v, mask=ok)
    key = tl.where(ok, _value_key(v), -NAN_KEY - 1)
    best = tl.max(key, axis=0)
    col = tl.min(tl.where(key == best, cols, N), axis=0)  # the first column holding the chunk's best key
    tl.store(key_ptr + row * tl.num_programs(1) + chunk, best)
    tl.store(col_ptr + row * tl.num_programs(1) + chunk, col)


@triton.jit
def _best_chunk_kernel(key_ptr, col_ptr, ids_ptr, n_chunks, CB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CB)
    ok = c < n_chunks
    key = tl.load(key_ptr + row * n_chunks + c, mask=ok, other=-NAN_KEY - 1)
    col = tl.load(col_ptr + row * n_chunks + c, mask=ok, other=0)
    best = tl.max(key, axis=0)
    tl.store(ids_ptr + row, tl.min(tl.where(ok & (key == best), col, NAN_KEY), axis=0).to(tl.int64))


def supported(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """fp32 [R, N] tensors, rows of unit column stride, on one device, N within int32 columns."""
    return (all(t.dtype == torch.float32 and t.dim() == 2 and t.stride(-1) == 1 for t in (a, b, out))
            and a.shape == b.shape == out.shape and a.shape[1] > 0 and a.shape[1] < 2**31 - BLOCK)


def add_argmax(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a + b (fp32 [R, N], any row strides) and int64 [R] the first column of each row's largest value of
    out (NaN largest), as torch.add(a, b, out=out).argmax(-1)."""
    if not supported(a, b, out):
        raise ValueError(f"add_argmax: fp32 [R, N] rows of unit column stride expected, got "
                         f"{[(t.dtype, tuple(t.shape), t.stride()) for t in (a, b, out)]}")
    R, N = a.shape
    n_chunks = triton.cdiv(N, BLOCK)
    keys = torch.empty(R, n_chunks, dtype=torch.int32, device=a.device)
    cols = torch.empty(R, n_chunks, dtype=torch.int32, device=a.device)
    ids = torch.empty(R, dtype=torch.int64, device=a.device)
    if R:
        _add_chunk_best_kernel[(R, n_chunks)](a, b, out, keys, cols, N, a.stride(0), b.stride(0), out.stride(0),
                                              BLOCK=BLOCK, num_warps=8)
        _best_chunk_kernel[(R,)](keys, cols, ids, n_chunks, CB=triton.next_power_of_2(n_chunks))
    return ids
