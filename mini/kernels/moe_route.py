"""Group a step's (token, slot) pairs by the local expert they were routed to, for the grouped GEMMs.

Sorted row r is one (token, slot) pair; rows of local expert i are contiguous, in increasing (token, slot) order
(a stable sort, so the layout is deterministic), and pairs routed to experts held elsewhere sort after all local
ones; `expert_offset` gives that layout as offsets (the "grouped contiguous" form library GEMMs take). The
grouped GEMMs work in tiles of `block_m` rows that never straddle two experts; `tile_expert`, `tile_start`,
`tile_end` say which rows a tile covers (tile_expert = -1: nothing to do).

Everything is computed on the device without reading a count back to the host: tensors are sized for the worst
case (T * min(k, E_local) rows, one partial tile per expert), so the plan can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


def plan_routes(ids: torch.Tensor, weights: torch.Tensor, experts: range, block_m: int = 128,
                tiles: bool = True) -> RoutePlan:
    """ids int [T, k] global expert ids, weights fp32 [T, k] -> RoutePlan for the experts in `experts`.
    tiles=False leaves the row tiles out (tile_* empty): GEMMs that take `expert_offset` do not need them."""
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
