"""Start EP/DP ranks: under torchrun, or as local processes.

    torchrun --nproc-per-node N -m mini.dist.launch generate --model tiny-v4.1 --prompt "a" --prompt "b"
    python -m mini.dist.launch --nproc N generate ...        # same, N local processes (gloo on CPU, NCCL on GPU)

`spawn(world, fn, *args)` runs `fn(ctx, *args)` on `world` local processes (each joined to the group by
`groups.init`) and returns their results in rank order; tests use it with gloo on the CPU.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback

import torch.multiprocessing as mp

from mini.dist.groups import DistContext, init, shutdown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, device, results, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    ctx = None
    try:
        ctx = init(device)
        results.put((rank, True, fn(ctx, *args)))
    except BaseException:  # hand the traceback to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if ctx is not None:
            shutdown(ctx)


def spawn(world: int, fn, *args, device: str | None = None) -> list:
    """fn(ctx, *args) on `world` fresh processes; returns the results in rank order. `fn` and its arguments and
    result must be picklable (a module-level function)."""
    mctx = mp.get_context("spawn")
    results = mctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(world, _free_port(), device, results, fn, args), nprocs=world,
                               join=False, start_method="spawn")
    out, errors = {}, []
    for _ in range(world):
        rank, ok, value = results.get()
        (out.__setitem__(rank, value) if ok else errors.append(f"rank {rank}:\n{value}"))
    while not procs.join():
        pass
    if errors:
        raise RuntimeError("distributed workers failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world)]
