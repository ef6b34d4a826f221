"""What kernels ask of the GPU they run on: its SM count, which sizes split-K and persistent grids (one place, cached
per device). A CPU tensor (the Triton interpreter) answers the H200's count, so a CPU test sees the choices the H200
would make."""
from __future__ import annotations

import torch

H200_SMS = 132
_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


# Programs an SM for a grid over rows whose count lives on the device (see `looped_row_programs`): 16 of 4 warps
# fill an SM's 64 warp slots, so the grid is one wave.
LOOPED_PROGRAMS_PER_SM = 16


def looped_row_programs(row_tiles: int, col_tiles: int, device: torch.device) -> int:
    """Programs along the rows of a grid whose row count lives on the device (the routed experts' gathered rows,
    no host sync): a plan's capacity is tokens x top-k, of which one rank's experts hold ~1 / EP, so a program per
    capacity tile leaves most programs returning at once (~88% at a B = 64 x 6 verify step on one emulated EP8
    rank, docs/perf/037). Instead: at most one wave in all, each program looping over row tiles up to the count."""
    return max(1, min(row_tiles, sm_count(device) * LOOPED_PROGRAMS_PER_SM // max(col_tiles, 1)))
