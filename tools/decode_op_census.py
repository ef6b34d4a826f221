"""Which torch ops a fast-path decode step launches besides our Triton kernels, per layer (issue 28: at B = 1 a
rank4 decode step on the H200 runs ~93 kernels per layer, ~62 of them small ones of no named part, docs/perf/015;
each costs ~1.4 us plus a gap in a graph replay). Runs one static decode step of one emulated EP4 rank of a small
preset on the CPU with the fast backend under Triton's interpreter and counts the aten ops it dispatches (views and
allocations left out; each other op is a kernel on CUDA), outside the interpreter's own bookkeeping:

    TRITON_INTERPRET=1 python tools/decode_op_census.py [--preset tiny-v4.1] [--batch 1] [--where]
"""
from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# ops that launch nothing on CUDA: views, metadata, allocation
NO_KERNEL = {"view", "_unsafe_view", "reshape", "select", "slice", "as_strided", "expand", "unsqueeze", "squeeze",
             "t", "permute", "transpose", "detach", "alias", "split", "split_with_sizes", "unbind", "chunk", "narrow",
             "_reshape_alias", "lift_fresh", "view_as_real", "view_as_complex", "unflatten", "flatten", "diagonal",
             "movedim", "expand_as", "view_as", "sym_size", "empty", "empty_like", "empty_strided", "new_empty",
             "new_empty_strided", "resolve_conj", "resolve_neg", "set_"}


class Census(TorchDispatchMode):
    """Counts the aten ops dispatched outside Triton's interpreter (which uses torch for its own bookkeeping)."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()  # (op, innermost mini/ line)
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name in NO_KERNEL or _returns_input(name, args, out):
            return out
        stack = traceback.extract_stack(limit=40)
        if not any("triton" in f.filename for f in stack):
            self.ops[name] += 1
            if self.where:
                self.sites[name, _site(stack)] += 1
        return out


def _site(stack) -> str:
    """The innermost line in mini/, and the innermost in mini/model or mini/ops above it when that is another."""
    mine = [f for f in reversed(stack) if "/mini/" in f.filename]
    if not mine:
        return "?"
    inner = mine[0]
    caller = next((f for f in mine if "/mini/model/" in f.filename or "/mini/ops/" in f.filename), inner)
    where = f"{inner.filename.split('/mini/')[-1]}:{inner.lineno} {inner.line}"
    return where if caller is inner else f"{where}  <- {caller.filename.split('/mini/')[-1]}:{caller.lineno}"


def _returns_input(name: str, args: tuple, out) -> bool:
    """A .to / .contiguous that was already so returns its input and launches nothing."""
    return (name in ("to", "contiguous") and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor)
            and out.data_ptr() == args[0].data_ptr())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-v4.1")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rope-dim", type=int, default=None,
                   help="the preset with this RoPE tail (tiny-v4.1's 16 with 1x32 quant blocks sends the fused "
                        "norm/RoPE/quant kernel to its torch fallback; V4.1-Flash's shapes take the kernel: try 32)")
    p.add_argument("--where", action="store_true", help="also print each op's call sites (innermost mini/ line)")
    args = p.parse_args(argv)
    import mini.ops
    from mini.bench import rank4_decode as rd
    from mini.checkpoint import expert_range
    from mini.config import preset
    from mini.testing.emulated_ep import EmulatedEP
    from mini.testing.rank_model import rank_model
    cfg = preset(args.preset)
    if args.rope_dim is not None:
        cfg = cfg.replace(rope_head_dim=args.rope_dim, index_head_dim=max(cfg.index_head_dim, 2 * args.rope_dim))
    mini.ops.set_backend("fast", interpret_on_cpu=True)  # needs TRITON_INTERPRET=1 (it says so)
    ex = EmulatedEP(4, 0, "uniform", expert_range(cfg, 0, 4))
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    model = rank_model(cfg, cpu, dtype, 0, expert_range(cfg, 0, 4), None, ex)
    run = rd.DecodeRun(model, cfg, ex, args.batch, 40, 5, 16, cpu, dtype, 0)
    run.fill()
    run.replay()  # warm-up: first-call work (lazy buffers) is not a step's
    run.fill()
    census = Census(args.where)
    with census:
        run.replay()
    n = len(cfg.layers)
    total = sum(census.ops.values())
    print(f"{args.preset} B={args.batch}: {total} torch ops per decode step besides the Triton kernels, "
          f"{total / n:.1f} per layer ({n} layers)")
    for name, count in census.ops.most_common():
        print(f"{count:6d} {count / n:6.1f}/layer  {name}")
    if args.where:
        print("\ncall sites, most ops first:")
        for (name, site), count in census.sites.most_common():
            print(f"{count:6d} {count / n:6.1f}/layer  {name:22s} {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
