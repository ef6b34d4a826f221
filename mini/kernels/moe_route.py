"""Group a step's (token, slot) pairs by the local expert they were routed to, for the grouped GEMMs.

Sorted row r is one (token, slot) pair; rows of local expert i are contiguous, in increasing (token, slot) order
(a stable sort, so the layout is deterministic), and pairs routed to experts held elsewhere sort after all local
ones, also in (token, slot) order; `expert_offset` gives that layout as offsets (the "grouped contiguous" form
library GEMMs take). The grouped GEMMs work in tiles of `block_m` rows that never straddle two experts;
`tile_expert`, `tile_start`, `tile_end` say which rows a tile covers (tile_expert = -1: nothing to do).

Everything is computed on the device without reading a count back to the host: tensors are sized for the worst
case (T * min(k, E_local) rows, one partial tile per expert), so the plan can be captured in a CUDA graph.

`plan_routes` is a counting sort in Triton kernels (on CUDA, or on CPU tensors under Triton's interpreter). Up to
`ONE_PROGRAM_MAX_PAIRS` pairs (decode steps up to 42 tokens at k = 6) it is one program, one launch
(`_plan_one_kernel`); beyond, three kernels over blocks of pairs (`pick_block`: about four blocks an SM, 64 to
`BLOCK` pairs):
1. count: per block, a histogram over the buckets 0..E-1 (local experts) and E (elsewhere);
2. scan (one program): per bucket, the exclusive prefix over the blocks; the buckets' starts (`expert_offset`);
   the row tiles;
3. place: per block again, each pair's row = its bucket's start + the earlier blocks' count + its rank in the
   block (a cumulative sum over one-hot rows, which keeps the flat order: the sort is stable).
The one program does the same three steps for its single block (no earlier blocks), beyond 128 pairs in steps of
256 pairs at 8 warps (`WIDE_STEP`) where its buckets allow. The loops over pairs stop at
the last pair: a 6-pair step walks one SUB-pair step, not a block of masked ones (at 20098de the count and place
kernels walked all 1,024: 30 and 50 us per layer at B = 1 on the H200).
The kernels take their sizes (pairs, rows, blocks, tiles) unspecialized: one build per expert layout serves every
step size, the one program two (up to 128 pairs and beyond). Triton would otherwise build one per size being 1, a
multiple of 16 or neither, and a served step of more than 1,024 pairs whose class no warm-up step had would compile
while serving.
Integer arithmetic only, so the plan is bit-identical to `plan_routes_torch` (torch sort + searchsorted), the
reference the tests compare it to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mini.kernels.device_info import sm_count


@dataclass
class RoutePlan:
    token: torch.Tensor  # [R] int32: the token of each sorted row (R = rows allotted; rows past the local ones unused)
    weight: torch.Tensor  # [R] fp32: the routing weight of each sorted row
    slot_row: torch.Tensor  # [T, k] int32: the sorted row of each (token, slot); >= n_local rows for remote experts
    # the row tiles (empty when planned with tiles=False)
    tile_expert: torch.Tensor  # [n_tiles] int32: local expert index of each row tile, -1 = empty tile
    tile_start: torch.Tensor  # [n_tiles] int32: first sorted row of the tile
    tile_end: torch.Tensor  # [n_tiles] int32: end of the tile's expert's rows (tile = start..min(end, start+BM))
    expert_offset: torch.Tensor  # [E+1] int32: first sorted row of each local expert; the last = local row count
    block_m: int
    n_rows: int  # R: rows the GEMM outputs must have


def max_rows(n_tokens: int, k: int, n_local: int) -> int:
    """The most sorted rows a step can have: each token routes to at most min(k, E_local) local experts."""
    return n_tokens * min(k, n_local)


def plan_routes_torch(ids: torch.Tensor, weights: torch.Tensor, experts: range, block_m: int = 128,
                      tiles: bool = True) -> RoutePlan:
    """`plan_routes` in torch ops (a stable radix sort + searchsorted): the reference for the kernels, and what
    runs on CPU tensors outside the interpreter."""
    T, k = ids.shape
    E = len(experts)
    dev = ids.device
    flat = ids.reshape(-1)
    local = (flat >= experts.start) & (flat < experts.stop)
    key = torch.where(local, flat - experts.start, torch.full_like(flat, E)).to(torch.int32)  # 4-byte radix sort
    sorted_key, order = torch.sort(key, stable=True)  # sorted row -> flat (token, slot) index
    # rows of experts 0..i end where the sorted keys pass i
    row_end = torch.searchsorted(sorted_key, torch.arange(E, dtype=torch.int32, device=dev), right=True)
    expert_offset = torch.cat([row_end.new_zeros(1), row_end]).to(torch.int32)

    n_rows = max_rows(T, k, E)
    order_local = order[:n_rows]
    token = torch.div(order_local, k, rounding_mode="floor").to(torch.int32)
    weight = weights.reshape(-1).float()[order_local]
    slot_row = torch.empty(T * k, dtype=torch.int32, device=dev)
    slot_row[order] = torch.arange(T * k, dtype=torch.int32, device=dev)
    plan = RoutePlan(token=token, weight=weight, slot_row=slot_row.view(T, k), tile_expert=expert_offset[:0],
                     tile_start=expert_offset[:0], tile_end=expert_offset[:0], expert_offset=expert_offset,
                     block_m=block_m, n_rows=n_rows)
    if not tiles:
        return plan

    counts = torch.diff(row_end, prepend=row_end.new_zeros(1))
    n_tiles_of = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    tile_end_of_expert = torch.cumsum(n_tiles_of, 0)  # inclusive: tiles of experts 0..i
    n_tiles = -(-n_rows // block_m) + E
    t = torch.arange(n_tiles, dtype=torch.int64, device=dev)
    e = torch.searchsorted(tile_end_of_expert, t, right=True)  # expert whose tiles cover tile t (E: none)
    ec = e.clamp(max=E - 1)
    first_tile = tile_end_of_expert[ec] - n_tiles_of[ec]
    plan.tile_expert = torch.where(e < E, ec, -1).to(torch.int32)
    plan.tile_start = (row_end[ec] - counts[ec] + (t - first_tile) * block_m).to(torch.int32)
    plan.tile_end = row_end[ec].to(torch.int32)
    return plan


BLOCK = 1024  # flat (token, slot) pairs per program of the count and place kernels, at most (a power of two)
# Up to this many pairs the plan is one program (`_plan_one_kernel`): its loops walk the pairs SUB at a time, so
# past a few steps the three kernels over small blocks (many programs, one or two steps each) take less time.
# On the H200 in rank4 decode (one emulated EP4 rank: 4 x B tokens reach this rank's plan) one program took
# 22 us per layer at 384 pairs (B = 16), and the three kernels over 1,024-pair blocks 112 us at 1,536 (B = 64):
# 2 programs of 16 serial steps each.
ONE_PROGRAM_MAX_PAIRS = 256
# Beyond WIDE_STEP_MIN_PAIRS the one program walks its pairs in steps of WIDE_STEP (8 warps) where it has at most
# WIDE_STEP_MAX_BUCKETS buckets (a [256, 128] one-hot tile; 384 local experts' 512 buckets keep SUB): at EP4's 96
# local experts on the H100 (docs/perf/035) a B = 1 verify step's 144 pairs took 13.9 us in three 64-pair steps and
# 10.3 in one 256-pair step (128 pairs at 8 warps: 20.5; 256 at 16 warps: 21.4); at 96 pairs, two default steps
# (9.8 us) beat one 128-pair step (11.4).
WIDE_STEP, WIDE_STEP_WARPS, WIDE_STEP_MIN_PAIRS, WIDE_STEP_MAX_BUCKETS = 256, 8, 128, 128


@triton.jit
def _bucket(ids_ptr, i, ok, start, E: tl.constexpr):
    """Bucket of flat pairs i: the local expert index, E for an expert held elsewhere, -1 past the end."""
    e = tl.load(ids_ptr + i, mask=ok, other=0) - start
    return tl.where(ok, tl.where((e >= 0) & (e < E), e, E), -1).to(tl.int32)


@triton.jit
def _histogram(ids_ptr, lo, hi, start, E: tl.constexpr, SUB: tl.constexpr, EB: tl.constexpr):
    """Pairs lo..hi-1 per bucket [EB], in SUB-pair steps that stop at hi: a decode step's 6 pairs take one step,
    not a whole block's worth of masked ones."""
    buckets = tl.arange(0, EB)
    hist = tl.zeros([EB], dtype=tl.int32)
    # while loops: Triton's interpreter cannot take a run-time bound in range()
    s = lo
    while s < hi:
        i = s + tl.arange(0, SUB)
        key = _bucket(ids_ptr, i, i < hi, start, E)
        hist += tl.sum((key[:, None] == buckets[None, :]).to(tl.int32), axis=0)
        s += SUB
    return hist


@triton.jit
def _place(ids_ptr, weights_ptr, token_ptr, weight_ptr, slot_row_ptr, lo, hi, nxt, R, start, E: tl.constexpr,
           K: tl.constexpr, SUB: tl.constexpr, EB: tl.constexpr):
    """Rows of pairs lo..hi-1: pair i of bucket e takes row nxt[e] + (its rank among the bucket's pairs from lo);
    a cumulative sum over one-hot rows keeps the flat order, so the sort is stable."""
    buckets = tl.arange(0, EB)
    s = lo
    while s < hi:
        i = s + tl.arange(0, SUB)
        ok = i < hi
        one_hot = (_bucket(ids_ptr, i, ok, start, E)[:, None] == buckets[None, :]).to(tl.int32)
        rank = tl.cumsum(one_hot, axis=0) - 1 + nxt[None, :]  # stable: earlier pairs of a bucket get lower rows
        row = tl.sum(one_hot * rank, axis=1)
        nxt += tl.sum(one_hot, axis=0)
        tl.store(slot_row_ptr + i, row, mask=ok)
        kept = ok & (row < R)
        tl.store(token_ptr + row, i // K, mask=kept)
        tl.store(weight_ptr + row, tl.load(weights_ptr + i, mask=kept, other=0.0), mask=kept)
        s += SUB


@triton.jit
def _offsets_and_tiles(total, offset_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, n_tiles, E: tl.constexpr,
                       EB: tl.constexpr, TILE_M: tl.constexpr, TB: tl.constexpr):
    """From the buckets' totals: their first rows (stored as `expert_offset`, returned) and the row tiles: TILE_M
    rows per local expert, then empty ones (-1)."""
    buckets = tl.arange(0, EB)
    first_row = tl.cumsum(total, axis=0) - total  # of each bucket; bucket E (elsewhere) starts at the local count
    tl.store(offset_ptr + buckets, first_row, mask=buckets <= E)
    if TILE_M > 0:
        is_local = buckets < E
        n_tiles_of = tl.where(is_local, (total + TILE_M - 1) // TILE_M, 0)
        tiles_through = tl.cumsum(n_tiles_of, axis=0)  # tiles of experts 0..e
        first_tile = tiles_through - n_tiles_of
        row_end = first_row + total
        # the counter starts from a tensor: a bound of 1 arrives as a compile-time constant (Triton specializes
        # integer arguments equal to 1)
        t0 = tl.program_id(0) * 0
        while t0 < n_tiles:
            t = t0 + tl.arange(0, TB)
            e = tl.sum(((tiles_through[None, :] <= t[:, None]) & is_local[None, :]).to(tl.int32), axis=1)
            ec = tl.minimum(e, E - 1)  # the tiles past the last expert's repeat its numbers, as the torch plan does
            of_ec = buckets[None, :] == ec[:, None]
            ft = tl.sum(tl.where(of_ec, first_tile[None, :], 0), axis=1)
            start_row = tl.sum(tl.where(of_ec, first_row[None, :], 0), axis=1)
            end_row = tl.sum(tl.where(of_ec, row_end[None, :], 0), axis=1)
            ok = t < n_tiles
            tl.store(tile_expert_ptr + t, tl.where(e < E, ec, -1), mask=ok)
            tl.store(tile_start_ptr + t, start_row + (t - ft) * TILE_M, mask=ok)
            tl.store(tile_end_ptr + t, end_row, mask=ok)
            t0 += TB
    return first_row


@triton.jit(do_not_specialize=["N"])
def _count_kernel(ids_ptr, counts_ptr, N, start, E: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                  EB: tl.constexpr):
    lo = tl.program_id(0) * BLOCK
    hist = _histogram(ids_ptr, lo, tl.minimum(lo + BLOCK, N), start, E, SUB, EB)
    tl.store(counts_ptr + tl.program_id(0) * EB + tl.arange(0, EB), hist)


@triton.jit(do_not_specialize=["n_blocks", "n_tiles"])
def _scan_kernel(counts_ptr, base_ptr, offset_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, n_blocks, n_tiles,
                 E: tl.constexpr, EB: tl.constexpr, NBB: tl.constexpr, TILE_M: tl.constexpr, TB: tl.constexpr):
    buckets = tl.arange(0, EB)
    total = tl.zeros([EB], dtype=tl.int32)
    b0 = tl.program_id(0) * 0
    while b0 < n_blocks:  # base[b, e] = pairs of bucket e in blocks before b
        b = b0 + tl.arange(0, NBB)
        at = b[:, None] * EB + buckets[None, :]
        c = tl.load(counts_ptr + at, mask=(b < n_blocks)[:, None], other=0)
        tl.store(base_ptr + at, tl.cumsum(c, axis=0) - c + total[None, :], mask=(b < n_blocks)[:, None])
        total += tl.sum(c, axis=0)
        b0 += NBB
    _offsets_and_tiles(total, offset_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, n_tiles, E, EB, TILE_M, TB)


@triton.jit(do_not_specialize=["N", "R"])
def _place_kernel(ids_ptr, weights_ptr, base_ptr, offset_ptr, token_ptr, weight_ptr, slot_row_ptr, N, R, start,
                  E: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, EB: tl.constexpr):
    buckets = tl.arange(0, EB)
    # the next free row of each bucket
    nxt = (tl.load(base_ptr + tl.program_id(0) * EB + buckets)
           + tl.load(offset_ptr + buckets, mask=buckets <= E, other=0))
    lo = tl.program_id(0) * BLOCK
    _place(ids_ptr, weights_ptr, token_ptr, weight_ptr, slot_row_ptr, lo, tl.minimum(lo + BLOCK, N), nxt, R, start,
           E, K, SUB, EB)


@triton.jit(do_not_specialize=["N", "R", "n_tiles"])
def _plan_one_kernel(ids_ptr, weights_ptr, offset_ptr, token_ptr, weight_ptr, slot_row_ptr, tile_expert_ptr,
                     tile_start_ptr, tile_end_ptr, N, R, n_tiles, start, E: tl.constexpr, K: tl.constexpr,
                     SUB: tl.constexpr, EB: tl.constexpr, TILE_M: tl.constexpr, TB: tl.constexpr):
    """The three kernels' work for one block of pairs (N <= BLOCK) in one program: the histogram, the offsets and
    tiles, the rows. A decode step's plan is one launch."""
    lo = tl.program_id(0) * 0
    total = _histogram(ids_ptr, lo, N, start, E, SUB, EB)
    first_row = _offsets_and_tiles(total, offset_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, n_tiles, E, EB,
                                   TILE_M, TB)
    _place(ids_ptr, weights_ptr, token_ptr, weight_ptr, slot_row_ptr, lo, N, first_row, R, start, E, K, SUB, EB)


def launch_sizes(n_local: int, interpreted: bool = False) -> tuple[int, int, int]:
    """(EB buckets: local experts, elsewhere, padding to a power of two; SUB pairs per step of the count and place
    kernels, whose [SUB, EB] one-hot tiles live in registers; STEP blocks / tiles per step of the scan kernel)."""
    EB = max(16, triton.next_power_of_2(n_local + 1))
    SUB = max(16, min(64, 8192 // EB))
    if interpreted:  # Triton's interpreter costs per operation: fewer, larger steps
        SUB *= 4
    return EB, SUB, max(1, 4096 // EB)


# Programs per SM the count and place kernels aim at: each SUB-pair step of a program costs ~3.5 us of latency (a
# load, a one-hot reduction or cumsum), so several short programs an SM beat one long one; more blocks lengthen the
# single-program scan over their counts (tools/route_combine_study.py, docs/perf/039).
PLAN_PROGRAMS_PER_SM = 4


def pick_block(n_pairs: int, sub: int, n_sms: int) -> int:
    """Pairs per program of the count and place kernels: about PLAN_PROGRAMS_PER_SM programs an SM (each walking
    few SUB-pair steps), a power of two within SUB..BLOCK: decode steps get one-step programs, prefill's ~100K pairs
    few-step ones."""
    per_program = triton.next_power_of_2(max(1, -(-n_pairs // (n_sms * PLAN_PROGRAMS_PER_SM))))
    return max(sub, min(BLOCK, per_program))


def plan_routes(ids: torch.Tensor, weights: torch.Tensor, experts: range, block_m: int = 128,
                tiles: bool = True, block: int | None = None, one_program: bool | None = None,
                one_program_step: tuple[int, int] | None = None) -> RoutePlan:
    """ids int [T, k] global expert ids, weights fp32 [T, k] -> RoutePlan for the experts in `experts`.
    tiles=False leaves the row tiles out (tile_* empty): GEMMs that take `expert_offset` do not need them.
    `block`: pairs per program of the count and place kernels (None: `pick_block`); `one_program`: the whole plan
    in one program (`_plan_one_kernel`), None = up to ONE_PROGRAM_MAX_PAIRS pairs; `one_program_step`: (pairs per
    step, warps) of that program (None: WIDE_STEP at 8 warps beyond WIDE_STEP_MIN_PAIRS where the buckets allow,
    else `launch_sizes`' SUB at 4 warps). The plan is the same for any of them."""
    if not (ids.is_cuda or triton.knobs.runtime.interpret):
        return plan_routes_torch(ids, weights, experts, block_m, tiles)
    T, k = ids.shape
    E, N, dev = len(experts), ids.numel(), ids.device
    n_rows = max_rows(T, k, E)
    n_tiles = -(-n_rows // block_m) + E if tiles else 0
    EB, SUB, STEP = launch_sizes(E, interpreted=not ids.is_cuda)
    if block is None:
        block = pick_block(N, SUB, sm_count(dev))
    SUB = min(SUB, block)
    i32 = dict(dtype=torch.int32, device=dev)
    expert_offset = torch.empty(E + 1, **i32)
    token, slot_row = torch.empty(n_rows, **i32), torch.empty(T, k, **i32)
    weight = torch.empty(n_rows, dtype=torch.float32, device=dev)
    tile_expert, tile_start, tile_end = (torch.empty(n_tiles, **i32) for _ in range(3))
    ids, weights = ids.contiguous(), weights.float().contiguous()
    tile_m = block_m if tiles else 0
    if one_program is None:
        one_program = N <= ONE_PROGRAM_MAX_PAIRS  # the smallest decode steps: one launch instead of three
    if one_program:
        wide = N > WIDE_STEP_MIN_PAIRS and EB <= WIDE_STEP_MAX_BUCKETS
        sub, warps = one_program_step or ((WIDE_STEP, WIDE_STEP_WARPS) if wide else (SUB, 4))
        _plan_one_kernel[(1,)](ids, weights, expert_offset, token, weight, slot_row, tile_expert, tile_start,
                               tile_end, N, n_rows, n_tiles, experts.start, E=E, K=k, SUB=sub, EB=EB, TILE_M=tile_m,
                               TB=STEP, num_warps=warps)
    else:
        n_blocks = triton.cdiv(N, block)
        counts, base = torch.empty(n_blocks, EB, **i32), torch.empty(n_blocks, EB, **i32)
        _count_kernel[(n_blocks,)](ids, counts, N, experts.start, E=E, BLOCK=block, SUB=SUB, EB=EB)
        _scan_kernel[(1,)](counts, base, expert_offset, tile_expert, tile_start, tile_end, n_blocks, n_tiles,
                           E=E, EB=EB, NBB=STEP, TILE_M=tile_m, TB=STEP)
        _place_kernel[(n_blocks,)](ids, weights, base, expert_offset, token, weight, slot_row, N, n_rows,
                                   experts.start, E=E, K=k, BLOCK=block, SUB=SUB, EB=EB)
    return RoutePlan(token=token, weight=weight, slot_row=slot_row, tile_expert=tile_expert, tile_start=tile_start,
                     tile_end=tile_end, expert_offset=expert_offset, block_m=block_m, n_rows=n_rows)
