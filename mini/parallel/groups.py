"""Process groups for expert parallelism (EP) with data-parallel (DP) attention.

One process per GPU (or per CPU worker in tests). Every rank holds the whole attention and the shared experts,
runs its own requests, and holds routed experts [r*E/N, (r+1)*E/N) (`mini.checkpoint.expert_range`); the MoE
exchange (`mini.parallel.exchange`) is the only place ranks talk to each other.

`init()` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): NCCL on CUDA,
gloo on CPU. Without WORLD_SIZE (or with 1) it returns a single-rank context and starts no process group.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) is off on the machines we use (see the device notes): NCCL, torch's symmetric memory and
# NVSHMEM each have their own switch. They must be set before the first communicator is created.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    device: torch.device
    backend: str | None  # "nccl" | "gloo"; None for a single rank without a process group

    @property
    def multi(self) -> bool:
        return self.world > 1


def init(device: str | None = None, timeout_s: float = 600.0) -> DistContext:
    """Join the process group described by the torchrun environment. `device`: "cuda" or "cpu" (default: CUDA
    when available); on CUDA each rank takes GPU LOCAL_RANK."""
    os.environ.update(MULTICAST_OFF)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(kind, local_rank) if kind == "cuda" else torch.device(kind)
    if kind == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        return DistContext(0, 1, dev, None)
    backend = "nccl" if kind == "cuda" else "gloo"
    if not dist.is_initialized():
        kw = {"device_id": dev} if kind == "cuda" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kw)
    return DistContext(dist.get_rank(), dist.get_world_size(), dev, backend)


def shutdown(ctx: DistContext) -> None:
    if ctx.backend is not None and dist.is_initialized():
        dist.destroy_process_group()
