"""An index source's top-k group ids in one pass (mini.ops.indexer.top_groups_ordered's fast path, issue 28):
per row of bf16 scores, the k largest by value with ties to the newer (higher) column, their columns in ascending
order with the -inf and NaN ones dropped, then -1s, and how many are valid. The torch form runs the order keys,
torch.topk (a radix select, ~21 us a call at decode on the H200), a gather, a where, a sort (~27 us) and three
small kernels; this kernel is one launch per step.

One program owns one row and walks it in BLOCK-column chunks, the first held in registers (a decode step at 4K
context has 1,024 groups: one chunk); no constexpr or specialized integer follows the step's shape, so one build
serves every step (the warm-up compiles it once: tests/engine/test_warm_start.py):
1. the int32 order keys of mini/kernels/order_keys.py (value bits above the column: unique, ordered as the values,
   ties to the higher column; -0.0 ties +0.0, every NaN above +inf, as torch's bf16 add on CUDA makes them);
2. the k-th largest key, from the top `radix` bits a pass (one histogram a pass of the keys on the prefix found so
   far by their next digit; RADIX_BITS) or one bit a pass (32 counts): with unique keys exactly k keys are >= it,
   the set torch.topk over the same keys returns;
3. the selected columns whose score is a number above -inf, written in column order by a prefix count of the
   selection (already the ascending order the sort gave), then -1s up to k.
The set and order equal the torch form's by construction (tests/kernels/test_top_ids.py compares them bit for bit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mini.kernels.order_keys import is_nan_bits, order_key

MAX_COLS = 1 << 16  # the column fits the key's low 16 bits
BLOCK = 1024
# Which build the op (mini.ops.indexer.top_groups_ordered) runs, by the row's columns (`build_for`):
# - Without each row's visible columns, up to one 1,024-column chunk (a 4K context's groups at ratio 4): wider rows
#   re-read each further chunk once per key bit, slower than the torch form (docs/perf/020: [1, 8192] 120 us
#   against 92; [1, 1024] 8.4 against 70).
# - Given them (`n_visible`: the columns past them are -inf, as the index scores make them), the kernel reads only
#   those, 4,096 a chunk, once a pass: its time follows the context, not the step's span (the engine's spans are
#   4K, 16K, 64K, ... positions: mini.engine.cuda_graphs.spans). V4.1's index sources at ratios 2 and 1 see a 4K
#   context in the 16K span as 8,192 and 16,384 columns, of which ~2,049 and ~4,097 are visible. At decode and
#   verify rows (<= WIDE_MAX_ROWS) the 4,096-column build takes every width up to the 16K span's 16,384 columns (one
#   build for every decode-sized step, so the warm-up's steps compile the one that served steps take:
#   tests/engine/test_warm_start.py; below 1,025 columns the 1,024-column build measured 8.4 against 16.9 us alone,
#   unrolled). On an H100 (docs/perf/054) at 16,384 columns with 8,193 / 16,384 visible it ran 44.8 / 63.9 us at
#   one row against the torch form's 118 / 121, 90 / 113 at 256 rows against 207; the 64K span's 32,768 columns
#   it would walk in up to 8 chunks, where one row's 5 (16,385 visible) already took 88 against the torch form's
#   100.5 us: that span stays with the torch form. Prefill-sized steps take the 1,024-column build up to 4,096
#   columns (at [4096, 1024] it ran 58.6 us against the wide build's 260 and the torch form's 425, docs/perf/023).
# Measured inside a B = 1 verify step on an H100 (docs/perf/049): the torch form's top-k and sort 24 + 26 us a
# call, eight calls a step; the 1,024-column build bounded to 1,025 columns 33 us, its search then one bit a pass
# (32 passes of a count across the program's warps).
FASTER_MAX_COLS = BLOCK
BOUNDED_MAX_COLS = 4 * BLOCK
WIDE_MAX_COLS = 16384
WIDE_MAX_ROWS = 256
# 4,096-column chunks on 8 warps. Per call on the H200 (docs/perf/023, CUDA graphs, k = 512, its bisection then
# unrolled), us, BLOCK / WIDE_BLOCK / the torch form: [1, 1024] 8.2 / 16.9 / 69.3, [1, 2048] 28.8 / 17.1 / 68.4,
# [1, 4096] 59.2 / 17.6 / 78.2, [1, 8192] 120 / 59.6 / 92.4, [64, 4096] 59.9 / 18.3 / 92.4. The op taking it
# unbounded for 1,025-8,192 columns made the B = 1 step slower (report 023; report 049 traced it: 95 us a call in
# the step, its unrolled code fetched cold, see the bisection's loop below).
WIDE_BLOCK = 4096
WARPS = {BLOCK: 4, WIDE_BLOCK: 8}  # each build's warps
# The k-th key's search (`top_ids(radix=)`): 0 decides one bit a pass by a count across the program's warps (32
# passes); 1-8 that many bits a pass by one histogram of 2^(radix + 1) bins (32 / radix passes at most, fewer where
# exactly k keys are at or above the prefix). 4 bits a pass, bounded by the visible columns in the 1,024-column
# build, on an H100 (docs/perf/053, us): [1, 4096] with 1,025 visible 20.4 -> 7.9, 6 rows 20.3 -> 15.0, 384 rows
# 33.6 -> 25.2, [1, 16384] with 8,193 visible 112 -> 61; 2 and 8 bits a pass beat the bisection at one row and at
# 8,193 columns, not at 6-384 rows of 1,025; 1 bit lost from 6 rows on.
RADIX_BITS = 4
RADIXES = (0, 1, 2, 4, 8)


def build_for(T: int, N: int, bounded: bool) -> int | None:
    """The chunk (BLOCK or WIDE_BLOCK) with which the op runs the kernel on [T, N] scores, given (`bounded`) or not
    each row's visible columns; None: the torch form."""
    if bounded and T <= WIDE_MAX_ROWS:
        return WIDE_BLOCK if N <= WIDE_MAX_COLS else None
    if N <= (BOUNDED_MAX_COLS if bounded else FASTER_MAX_COLS):
        return BLOCK
    return None


def supported(scores: torch.Tensor, k: int) -> bool:
    """bf16 rows of 1 to MAX_COLS columns and 1 <= k <= columns; others take the torch form."""
    return scores.dtype == torch.bfloat16 and scores.dim() == 2 and 0 < scores.shape[-1] <= MAX_COLS \
        and 0 < k <= scores.shape[-1]


@triton.jit
def _unsigned_keys(x_row, cols, N):
    """(keys, valid) of the columns `cols` of one row: the order keys with the sign bit flipped (unsigned order =
    the keys' signed order; a column past N gets 0, below every key), and whether the score is a number > -inf."""
    return _unsigned_keys_where(x_row, cols, cols < N)


@triton.jit
def _unsigned_keys_where(x_row, cols, ok):
    """`_unsigned_keys` of the columns where `ok` (the others: key 0, not valid)."""
    bits = tl.load(x_row + cols, mask=ok, other=0).to(tl.int32)  # int16 bits, sign-extended
    valid = ok & (bits != -128) & ~is_nan_bits(bits)  # -128: the bits of -inf
    key = order_key(bits, cols)
    return tl.where(ok, (key ^ -2147483648).to(tl.uint32, bitcast=True), 0), valid


@triton.jit
def _digit_histogram(keys, ok, kth, shift, RADIX: tl.constexpr, NB: tl.constexpr):
    """[2 NB] int32 counts of the `ok` keys: bin d < NB those on kth's prefix (the bits above shift + RADIX) with
    digit d (the RADIX bits from `shift` up), bin NB those above the prefix (the others empty)."""
    high, kth_high = (keys >> shift) >> RADIX, (kth >> shift) >> RADIX  # (two shifts: never one of 32 bits)
    above = high > kth_high
    b = tl.where(above, NB, (keys >> shift) & (NB - 1)).to(tl.int32)
    return tl.histogram(b, 2 * NB, mask=ok & (above | (high == kth_high)))


@triton.jit
def _kth_key_bisect(first, x_row, cols, N, K, BLOCK: tl.constexpr):
    """The k-th largest key one bit a pass: the largest candidate with >= K keys at or above it (32 counts across
    the program's warps). A loop, not unrolled: unrolled bodies are code fetched cold in a model step
    (docs/perf/049)."""
    kth = tl.zeros([], dtype=tl.uint32)
    one = tl.full([], 1, tl.uint32)
    for b in range(32):
        cand = kth | (one << (31 - b))
        n_at_least = tl.sum((first >= cand).to(tl.int32), axis=0)
        c0 = tl.zeros([], tl.int32) + BLOCK
        while c0 < N:  # (while, not range(BLOCK, N, BLOCK): Triton 3.6's interpreter cannot take the latter)
            keys, _ = _unsigned_keys(x_row, c0 + cols, N)
            n_at_least += tl.sum((keys >= cand).to(tl.int32), axis=0)
            c0 += BLOCK
        kth = tl.where(n_at_least >= K, cand, kth)
    return kth


@triton.jit
def _kth_key_radix(first, x_row, cols, N, K, BLOCK: tl.constexpr, RADIX: tl.constexpr):
    """The k-th largest key RADIX bits a pass from the top: each pass counts, by one histogram, the keys above the
    prefix found so far and those on it by their next digit; the digit taken is the largest with >= K keys at or
    above it. A pass ends the search early where the keys at or above the prefix (its lower bits 0) are already
    exactly K. A loop, as the bisection."""
    NB: tl.constexpr = 1 << RADIX
    ok = cols < N
    bins = tl.arange(0, 2 * NB)
    kth = tl.zeros([], dtype=tl.uint32)
    shift = tl.full([], 32, tl.uint32)
    n_kth = K + 1
    while (shift > 0) & (n_kth > K):
        shift -= RADIX
        hist = _digit_histogram(first, ok, kth, shift, RADIX, NB)
        c0 = tl.zeros([], tl.int32) + BLOCK
        while c0 < N:  # (while, not range(BLOCK, N, BLOCK): Triton 3.6's interpreter cannot take the latter)
            keys, _ = _unsigned_keys(x_row, c0 + cols, N)
            hist += _digit_histogram(keys, c0 + cols < N, kth, shift, RADIX, NB)
            c0 += BLOCK
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys at or above each bin
        digit = tl.maximum(tl.sum(((at_least >= K) & (bins < NB)).to(tl.int32), axis=0) - 1, 0)
        kth = kth | (digit.to(tl.uint32) << shift)
        n_kth = tl.sum(tl.where(bins == digit, at_least, 0), axis=0)
    return kth


@triton.jit(do_not_specialize=["N", "K", "stride_x", "stride_ids"])
def _top_ids_kernel(x_ptr, ids_ptr, count_ptr, n_visible_ptr, N, K, stride_x, stride_ids, BLOCK: tl.constexpr,
                    BOUNDED: tl.constexpr, RADIX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if BOUNDED:  # the columns past the row's visible ones are -inf: never valid, below every visible key
        N = tl.minimum(tl.load(n_visible_ptr + row).to(tl.int32), N)
    x_row = x_ptr + row * stride_x
    ids_row = ids_ptr + row * stride_ids
    cols = tl.arange(0, BLOCK)
    first, first_valid = _unsigned_keys(x_row, cols, N)
    if RADIX == 0:
        kth = _kth_key_bisect(first, x_row, cols, N, K, BLOCK)
    else:
        kth = _kth_key_radix(first, x_row, cols, N, K, BLOCK, RADIX)
    keep = (first >= kth) & first_valid
    tl.store(ids_row + tl.cumsum(keep.to(tl.int32), axis=0) - 1, cols.to(tl.int64), mask=keep)
    n_kept = tl.sum(keep.to(tl.int32), axis=0)
    c0 = tl.zeros([], tl.int32) + BLOCK
    while c0 < N:  # each kept column's place: column order
        keys, valid = _unsigned_keys(x_row, c0 + cols, N)
        keep = (keys >= kth) & valid
        tl.store(ids_row + n_kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1, (c0 + cols).to(tl.int64), mask=keep)
        n_kept += tl.sum(keep.to(tl.int32), axis=0)
        c0 += BLOCK
    j0 = tl.zeros([], tl.int32)
    while j0 < K:
        j = j0 + cols
        tl.store(ids_row + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= n_kept) & (j < K))
        j0 += BLOCK
    tl.store(count_ptr + row, n_kept)


# Split (a candidate, `top_ids(split=True)`, not yet timed; the op does not take it): a row of several chunks
# split across programs, so no program walks more than one chunk a pass. Each (row, chunk) program keeps its
# chunk's k largest keys (every visible column where it has k or fewer) and writes their columns in ascending
# order; one program a row then ranks those n_chunks * k candidates (MERGE_MAX at most) again, with their order
# keys from the scores. The row's k largest are among its chunks' k largest, so the ids are the one-program
# build's. Meant for the rows the one-program build walks in many chunks (the 64K span's 32,768-65,536 columns:
# one row of 16,385 visible took 88 us there in 5 chunks a pass, docs/perf/054).
MERGE_MAX = 8192


def merge_warps(block: int) -> int:
    """The merge's warps for `block` candidates a row: 16 from 4,096 on (at 4,096 8 warps spilled 120 bytes a
    thread under Triton 3.6, 16 take 114 registers, 110 at 8,192, no spill; Triton 3.9 spills 32 bytes at 8,192:
    tests/kernels/sm90_build.py)."""
    return 16 if block >= 4096 else 4


@triton.jit(do_not_specialize=["N", "K", "stride_x"])
def _chunk_candidates_kernel(x_ptr, cand_ptr, n_visible_ptr, N, K, stride_x, CHUNK: tl.constexpr,
                             RADIX: tl.constexpr):
    """Program (row, chunk): the chunk's k largest keys' columns (all its visible columns where it has <= k), in
    ascending order, then -1s, into cand[row, chunk, :K]."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    n_row = tl.minimum(tl.load(n_visible_ptr + row).to(tl.int32), N)
    c0 = chunk * CHUNK
    n_here = tl.minimum(tl.maximum(n_row - c0, 0), CHUNK)
    cols = tl.arange(0, CHUNK)
    # order keys on the chunk's own columns: the order within the chunk is the global one's
    keys, _ = _unsigned_keys(x_ptr + row * stride_x + c0, cols, n_here)
    kth = tl.zeros([], dtype=tl.uint32)
    if n_here > K:
        kth = _kth_key_radix(keys, x_ptr + row * stride_x + c0, cols, n_here, K, CHUNK, RADIX)
    keep = (keys >= kth) & (cols < n_here)
    out = cand_ptr + (row * tl.num_programs(1) + chunk) * K
    tl.store(out + tl.cumsum(keep.to(tl.int32), axis=0) - 1, c0 + cols, mask=keep)
    n_kept = tl.sum(keep.to(tl.int32), axis=0)
    tl.store(out + cols, tl.full([CHUNK], -1, tl.int32), mask=(cols >= n_kept) & (cols < K))


@triton.jit(do_not_specialize=["N_CAND", "K", "stride_x", "stride_ids"])
def _merge_candidates_kernel(x_ptr, cand_ptr, ids_ptr, count_ptr, N_CAND, K, stride_x, stride_ids,
                             BLOCK: tl.constexpr, RADIX: tl.constexpr):
    """Program (row): the k largest of the row's candidate columns (their order keys taken again from the scores),
    the valid ones' columns in ascending order (the candidates' own order), then -1s, and their count."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    j = tl.arange(0, BLOCK)
    col = tl.load(cand_ptr + row * N_CAND + j, mask=j < N_CAND, other=-1)
    keys, valid = _unsigned_keys_where(x_row, col, col >= 0)
    kth = _kth_key_radix(keys, x_row, j, N_CAND, K, BLOCK, RADIX)
    keep = (keys >= kth) & valid
    ids_row = ids_ptr + row * stride_ids
    tl.store(ids_row + tl.cumsum(keep.to(tl.int32), axis=0) - 1, col.to(tl.int64), mask=keep)
    n_kept = tl.sum(keep.to(tl.int32), axis=0)
    tl.store(ids_row + j, tl.full([BLOCK], -1, tl.int64), mask=(j >= n_kept) & (j < K))
    tl.store(count_ptr + row, n_kept)


def top_ids(scores: torch.Tensor, k: int, block: int = BLOCK, n_visible: torch.Tensor | None = None,
            radix: int = RADIX_BITS, split: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [T, k] ids, int32 [T] counts) for bf16 scores [T, N] (`supported`): the k largest of each row (ties
    to the higher column), the valid ones (above -inf, not NaN) first in ascending column order, then -1s.
    `block`: the chunk of columns a program holds at once (BLOCK or WIDE_BLOCK: `build_for`); the same ids.
    `n_visible` ([T] integers): each row's columns from there on are -inf (the caller's promise; a NaN there would
    have been ranked above +inf by the torch form), and the kernel reads only the columns before. `radix`: the k-th
    key's search (RADIX_BITS' comment: 1, 2, 4 or 8 bits a pass by histograms, 0 one bit by counts); the same ids.
    `split` (with `n_visible`, a radix search): the row in `block`-column chunks across programs, then one program
    a row ranking their candidates (the Split comment above; `block` there any power of two from k to WIDE_BLOCK,
    so that tests can split small rows)."""
    if not supported(scores, k):
        raise ValueError(f"top_ids: bf16 [T, N] scores with 1 <= k <= N <= {MAX_COLS} expected, got "
                         f"{scores.dtype} {tuple(scores.shape)} and k = {k}")
    if radix not in RADIXES:
        raise ValueError(f"top_ids: radix {radix} is not one of {RADIXES}")
    T, N = scores.shape
    if split:
        if n_visible is None or radix == 0 or block & (block - 1) or not k <= block <= WIDE_BLOCK \
                or triton.cdiv(N, block) * k > MERGE_MAX:
            raise ValueError(f"top_ids: split takes n_visible, a radix search, a power-of-two block from k to "
                             f"{WIDE_BLOCK} and at most {MERGE_MAX} candidates a row; got "
                             f"n_visible {'given' if n_visible is not None else 'None'}, radix {radix}, block "
                             f"{block}, {triton.cdiv(N, block)} chunks of k = {k}")
    elif block not in WARPS:
        raise ValueError(f"top_ids: block {block} is neither BLOCK ({BLOCK}) nor WIDE_BLOCK ({WIDE_BLOCK})")
    if n_visible is not None and (n_visible.shape != (T,) or n_visible.device != scores.device
                                  or n_visible.is_floating_point()):
        raise ValueError(f"top_ids: n_visible must be [T] = [{T}] integers on {scores.device}, got "
                         f"{n_visible.dtype} {tuple(n_visible.shape)} on {n_visible.device}")
    rows = scores if scores.stride(-1) == 1 else scores.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    count = torch.empty(T, dtype=torch.int32, device=scores.device)
    if T and split:
        chunks = triton.cdiv(N, block)
        cand = torch.empty(T, chunks, k, dtype=torch.int32, device=scores.device)
        _chunk_candidates_kernel[(T, chunks)](rows.view(torch.int16), cand, n_visible.contiguous(), N, k,
                                              rows.stride(0), CHUNK=block, RADIX=radix, num_warps=WARPS.get(block, 4))
        merge = triton.next_power_of_2(chunks * k)
        _merge_candidates_kernel[(T,)](rows.view(torch.int16), cand, ids, count, chunks * k, k, rows.stride(0),
                                       ids.stride(0), BLOCK=merge, RADIX=radix, num_warps=merge_warps(merge))
    elif T:
        bound = count if n_visible is None else n_visible.contiguous()  # (the kernel reads row r's at offset r)
        _top_ids_kernel[(T,)](rows.view(torch.int16), ids, count, bound, N, k,
                              rows.stride(0), ids.stride(0), BLOCK=block, BOUNDED=n_visible is not None, RADIX=radix,
                              num_warps=WARPS[block])
    return ids, count
