"""An index source's top-k group ids in one pass (mini.ops.indexer.top_groups_ordered's fast path, issue 28):
per row of bf16 scores, the k largest by value with ties to the newer (higher) column, their columns in ascending
order with the -inf and NaN ones dropped, then -1s, and how many are valid. The torch form runs the order keys,
torch.topk (a radix select, ~21 us a call at decode on the H200), a gather, a where, a sort (~27 us) and three
small kernels; this kernel is one launch per step.

One program owns one row, held whole in registers (up to MAX_COLS columns):
1. the int32 order keys of mini/kernels/order_keys.py (value bits above the column: unique, ordered as the values,
   ties to the higher column; -0.0 ties +0.0, every NaN above +inf, as torch's bf16 add on CUDA makes them);
2. the k-th largest key, bit by bit from the top (32 counts of keys >= a candidate): with unique keys exactly k
   keys are >= it, the set torch.topk over the same keys returns;
3. the selected columns whose score is a number above -inf, written in column order by a prefix count of the
   selection (already the ascending order the sort gave), then -1s up to k.
The set and order equal the torch form's by construction (tests/kernels/test_top_ids.py compares them bit for bit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COLS = 16384  # a row in registers: 32 keys a thread at 16 warps


def supported(scores: torch.Tensor, k: int) -> bool:
    """bf16 rows of 1 to MAX_COLS columns and 1 <= k <= columns; others take the torch form."""
    return scores.dtype == torch.bfloat16 and scores.dim() == 2 and 0 < scores.shape[-1] <= MAX_COLS \
        and 0 < k <= scores.shape[-1]


@triton.jit
def _top_ids_kernel(x_ptr, ids_ptr, count_ptr, N, K, stride_x, stride_ids, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    bits = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0).to(tl.int32)  # int16 bits, sign-extended
    is_nan = ((bits & 0x7F80) == 0x7F80) & ((bits & 0x7F) != 0)
    valid = ok & (bits != -128) & ~is_nan  # -128: the bits of -inf
    bits = tl.where(bits == -32768, 0, bits)  # -0.0 -> +0.0
    bits = tl.where(is_nan, 0x7FFF, bits)
    key = ((bits ^ ((bits >> 15) & 0x7FFF)) << 16) | cols
    # unsigned order = signed order with the sign bit flipped; columns past N never count
    ukey = tl.where(ok, (key ^ -2147483648).to(tl.uint32, bitcast=True), 0)
    kth = tl.zeros([], dtype=tl.uint32)
    one = tl.full([], 1, tl.uint32)
    for b in tl.static_range(32):
        cand = kth | (one << (31 - b))
        n_at_least = tl.sum((ok & (ukey >= cand)).to(tl.int32), axis=0)
        kth = tl.where(n_at_least >= K, cand, kth)
    keep = ok & (ukey >= kth) & valid
    at = tl.cumsum(keep.to(tl.int32), axis=0) - 1  # each kept column's place: column order
    tl.store(ids_ptr + row * stride_ids + at, cols.to(tl.int64), mask=keep)
    n_kept = tl.sum(keep.to(tl.int32), axis=0)
    j = tl.arange(0, BLOCK_K)
    tl.store(ids_ptr + row * stride_ids + j, tl.full([BLOCK_K], -1, tl.int64), mask=(j >= n_kept) & (j < K))
    tl.store(count_ptr + row, n_kept)


def top_ids(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [T, k] ids, int32 [T] counts) for bf16 scores [T, N] (`supported`): the k largest of each row (ties
    to the higher column), the valid ones (above -inf, not NaN) first in ascending column order, then -1s."""
    if not supported(scores, k):
        raise ValueError(f"top_ids: bf16 [T, N] scores with 1 <= k <= N <= {MAX_COLS} expected, got "
                         f"{scores.dtype} {tuple(scores.shape)} and k = {k}")
    T, N = scores.shape
    rows = scores if scores.stride(-1) == 1 else scores.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    count = torch.empty(T, dtype=torch.int32, device=scores.device)
    if T:
        block_n = triton.next_power_of_2(N)
        _top_ids_kernel[(T,)](rows.view(torch.int16), ids, count, N, k, rows.stride(0), ids.stride(0),
                              BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k),
                              num_warps=4 if block_n <= 2048 else 8 if block_n <= 8192 else 16)
    return ids, count
