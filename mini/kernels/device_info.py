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
