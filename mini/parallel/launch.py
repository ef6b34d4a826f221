"""Start EP/DP ranks: under torchrun, or as local processes. The one place that starts local ranks.

    torchrun --nproc-per-node N -m mini.parallel.launch generate --model tiny-v4.1 --prompt "a" --prompt "b"
    python -m mini.parallel.launch --nproc N generate ...        # same, N local processes (gloo on CPU, NCCL on GPU)

* `spawn(world, fn, *args)` runs `fn(ctx, *args)` on `world` local processes (each joined to the group by
  `groups.init`) and returns their results in rank order; tests use it with gloo on the CPU;
* `run_ranks(fn, args, nproc)`: this process as one rank under torchrun, else `spawn`;
* `run_local(world, fn, *args)`: `fn(*args)` on `world` local processes set up as torchrun sets its processes up
  (they join the group themselves), this process forwarding Ctrl-C to rank 0 (`mini serve --ep N`).
"""
from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

from mini.parallel.groups import DistContext, init, shutdown


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the rendezvous of local ranks; servers started by tests and benchmarks)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _rank_env(rank: int, world: int, port: int) -> None:
    """What torchrun sets for a process of a one-host job."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _start(world: int, target, *args):
    """`target(rank, world, port, *args)` on `world` fresh processes (spawned), not joined."""
    return mp.start_processes(target, args=(world, free_port(), *args), nprocs=world, join=False,
                              start_method="spawn")


def _worker(rank, world, port, device, results, fn, args):
    _rank_env(rank, world, port)
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
    results = mp.get_context("spawn").SimpleQueue()
    procs = _start(world, _worker, device, results, fn, args)
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


def _local_rank(rank: int, world: int, port: int, fn, args) -> None:
    os.setpgrp()  # out of the terminal's process group: Ctrl-C reaches rank 0 once, through run_local
    _rank_env(rank, world, port)
    fn(*args)


def run_local(world: int, fn, *args) -> None:
    """`fn(*args)` on `world` local processes with torchrun's environment (fn joins the group), waiting for them.
    SIGINT / SIGTERM / SIGHUP to this process become one SIGINT to rank 0, which is to stop the others (e.g. a
    server: uvicorn re-raises the signals it caught after its shutdown: one SIGINT ends the rank quietly; a second
    one, or a SIGTERM, would not). `fn` and `args` must be picklable."""
    procs = _start(world, _local_rank, fn, args)

    def stop_rank0(signum, frame):
        if procs.processes[0].is_alive():
            os.kill(procs.processes[0].pid, signal.SIGINT)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_rank0)
    while not procs.join():
        pass


# ---------------------------------------------------------------------------------------------------- CLI
def _generate_rank(ctx: DistContext, args: argparse.Namespace, with_images=None) -> list[str]:
    from mini.parallel.dp import generate, load_ep_model
    from mini.engine import LLM, SamplingParams
    model, cfg, tok = load_ep_model(args.model, ctx, getattr(torch, args.dtype))
    llm = LLM(model, config=cfg, tokenizer=tok, device=str(ctx.device), dtype=getattr(torch, args.dtype),
              num_blocks=args.num_blocks)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    prompts, images = args.prompt, None
    if with_images is not None:  # one prompt: its ids with the images' spans, [the spans] (LLM.generate's)
        ids, images = with_images(llm.engine)
        prompts = [ids]
    return [o.text for o in generate(llm, ctx, prompts, params, images)]


def generate_torchrun(args, prompt: str, num_blocks: int | None, with_images=None) -> int:
    """`mini generate` under torchrun: the prompt runs on rank 0 while the other ranks serve its MoE layers;
    rank 0 prints the text. `args`: the generate command's. `with_images(engine)`: the prompt's ids and [its image
    spans] (`--image`), made on every rank alike; an error there (a file, a model without a vision tower) is every
    rank's, printed by rank 0 (exit status 2)."""
    from mini.args import resolve_device
    device, _ = resolve_device(args)
    ctx = init(device)
    try:
        texts = _generate_rank(ctx, argparse.Namespace(**{**vars(args), "prompt": [prompt], "num_blocks": num_blocks}),
                               with_images)
    except (OSError, ValueError) as e:
        if ctx.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown(ctx)
    if ctx.rank == 0:
        print(texts[0])
    return 0


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
