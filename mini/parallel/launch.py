"""Start EP/DP ranks: under torchrun, or as local processes.

    torchrun --nproc-per-node N -m mini.parallel.launch generate --model tiny-v4.1 --prompt "a" --prompt "b"
    python -m mini.parallel.launch --nproc N generate ...        # same, N local processes (gloo on CPU, NCCL on GPU)

`spawn(world, fn, *args)` runs `fn(ctx, *args)` on `world` local processes (each joined to the group by
`groups.init`) and returns their results in rank order; tests use it with gloo on the CPU.
"""
from __future__ import annotations

import argparse
import io
import os
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

from mini.parallel.groups import DistContext, init, shutdown


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
        if ctx.device.type == "cpu":  # the ranks share the host's cores; oversubscribed BLAS threads crawl
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        buf = io.BytesIO()  # tensors travel as bytes: torch's shared-memory handles die with this process
        torch.save(fn(ctx, *args), buf)
        results.put((rank, True, buf.getvalue()))
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
        if ok:
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
    while not procs.join():
        pass
    if errors:
        raise RuntimeError("distributed workers failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world)]


def run_ranks(fn, args, nproc: int | None, device: str | None = None) -> tuple[int, object]:
    """fn(ctx, args) on every rank. Under torchrun (or with nproc 1) this process is one rank; otherwise `nproc`
    local processes are spawned. Returns (this process's rank, its result) — rank 0's result when spawning."""
    if "WORLD_SIZE" in os.environ:
        if nproc is not None:
            raise ValueError("--nproc is for local runs; under torchrun use --nproc-per-node")
    elif (nproc or 1) > 1:
        return 0, spawn(nproc, fn, args, device=device)[0]
    ctx = init(device)
    try:
        return ctx.rank, fn(ctx, args)
    finally:
        shutdown(ctx)


# ---------------------------------------------------------------------------------------------------- CLI
def _generate_rank(ctx: DistContext, args: argparse.Namespace) -> list[str]:
    from mini.parallel.dp import generate, load_ep_model
    from mini.engine import LLM, SamplingParams
    model, cfg, tok = load_ep_model(args.model, ctx, getattr(torch, args.dtype))
    llm = LLM(model, config=cfg, tokenizer=tok, device=str(ctx.device), dtype=getattr(torch, args.dtype),
              num_blocks=args.num_blocks)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    return [o.text for o in generate(llm, ctx, args.prompt, params)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mini.parallel.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes to start (default 1; under torchrun each process is one rank)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate for several prompts, spread over the DP ranks")
    g.add_argument("--model", required=True, help="checkpoint directory or preset")
    g.add_argument("--prompt", action="append", required=True, help="repeat for more prompts")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks per rank (required on CPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        rank, texts = run_ranks(_generate_rank, args, args.nproc, args.device)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if rank != 0:
        return 0
    for prompt, text in zip(args.prompt, texts):
        print(f"{prompt!r} -> {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
