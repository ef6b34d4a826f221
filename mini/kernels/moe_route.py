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
    tile_expert: torch.Tensor  # [n_tiles] int32: local expert index of each row tile, -1 = empty tile
    tile_start: torch.Tensor  # [n_tiles] int32: first sorted row of the tile
    tile_end: torch.Tensor  # [n_tiles] int32: end of the tile's expert's rows (tile = start..min(end, start+BM))
    expert_offset: torch.Tensor  # [E+1] int32: first sorted row of each local expert; the last = local row count
    block_m: int
    n_rows: int  # R: rows the GEMM outputs must have


def max_rows(n_tokens: int, k: int, n_local: int) -> int:
    """The most sorted rows a step can have: each token routes to at most min(k, E_local) local experts."""
    return n_tokens * min(k, n_local)


def plan_routes(ids: torch.Tensor, weights: torch.Tensor, experts: range, block_m: int = 128) -> RoutePlan:
    """ids int [T, k] global expert ids, weights fp32 [T, k] -> RoutePlan for the experts in `experts`."""
    T, k = ids.shape
    E = len(experts)
    dev = ids.device
    flat = ids.reshape(-1)
    local = (flat >= experts.start) & (flat < experts.stop)
    key = torch.where(local, flat - experts.start, torch.full_like(flat, E)).to(torch.int32)  # 4-byte radix sort
    order = torch.sort(key, stable=True).indices  # sorted row -> flat (token, slot) index
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key.long(), torch.ones_like(flat))[:E]

    n_rows = max_rows(T, k, E)
    order_local = order[:n_rows]
    token = torch.div(order_local, k, rounding_mode="floor").to(torch.int32)
    weight = weights.reshape(-1).float()[order_local]
    slot_row = torch.empty(T * k, dtype=torch.int32, device=dev)
    slot_row[order] = torch.arange(T * k, dtype=torch.int32, device=dev)

    tiles = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    tile_end_of_expert = torch.cumsum(tiles, 0)  # inclusive: tiles of experts 0..i
    row_end = torch.cumsum(counts, 0)
    row_start = row_end - counts
    n_tiles = -(-n_rows // block_m) + E
    t = torch.arange(n_tiles, dtype=torch.int64, device=dev)
    e = torch.searchsorted(tile_end_of_expert, t, right=True)  # expert whose tiles cover tile t (E: none)
    valid = e < E
    ec = e.clamp(max=E - 1)
    first_tile = tile_end_of_expert[ec] - tiles[ec]
    start = row_start[ec] + (t - first_tile) * block_m
    return RoutePlan(token=token, weight=weight, slot_row=slot_row.view(T, k),
                     tile_expert=torch.where(valid, ec, -1).to(torch.int32),
                     tile_start=start.to(torch.int32), tile_end=row_end[ec].to(torch.int32),
                     expert_offset=torch.cat([row_end.new_zeros(1), row_end]).to(torch.int32),
                     block_m=block_m, n_rows=n_rows)
