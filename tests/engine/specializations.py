"""Which Triton kernel specializations an engine's steps need, found on the CPU without running a kernel.

Triton compiles a kernel once per specialization: its constexpr values, launch options, argument dtypes, the
alignment of each pointer (16 bytes or not) and each integer argument's class (equal to 1, divisible by 16, or
other), except arguments marked do_not_specialize. `record()` (under TRITON_INTERPRET=1, with the fast ops
backend on CPU tensors) replaces the interpreter's launch by one that only notes that key and returns: the host
code around the kernels runs as on the GPU (shapes, integer arguments and views come from the batch's metadata,
never from kernel outputs), so a step's keys are found in milliseconds, while its outputs are garbage (read only
by sampling). Steps that replay a CUDA graph on the GPU (pure decode, up to max_num_seqs sequences) compile
nothing when served: `Recorder.attach` leaves them out.

Run as a script (what tests/engine/test_warmup.py does, in a subprocess with TRITON_INTERPRET=1): warm up a
tiny-v4.1 engine part by part (mini.engine.warmup.plan), then serve bursts of varied shapes with arrivals spread
over steps as HTTP requests come in, and print one JSON line: for each burst, the keys no warm-up part compiled,
and those that only the parts after --first-parts compiled. With --real-width, also the builds that follow each
eager step's token count at V4.1-Flash's own width (`real_width_keys`), which tiny-v4.1's dimensions never reach.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

from mini.engine.cuda_graphs import is_decode_step


def _int_class(v: int) -> str:
    return "1" if v == 1 else "D" if v % 16 == 0 else ""


@functools.cache
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)  # a tenth of a burst's time when taken at each of its ~30,000 launches


def spec_key(fn, args, kwargs) -> tuple:
    """The key Triton's CUDA backend compiles `fn` (an InterpretedFunction) under for this launch: (name, launch
    options, per parameter its constexpr value or type with specialization)."""
    sig = _signature(fn.fn)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in sig.parameters}  # num_warps, num_stages, ...
    bound = sig.bind_partial(*args, **kwargs)
    dns = set(fn.kwargs.get("do_not_specialize") or ())
    dns_align = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    parts = []
    for i, (name, p) in enumerate(sig.parameters.items()):
        v = bound.arguments.get(name, p.default)
        if "constexpr" in str(p.annotation):
            parts.append((name, repr(getattr(v, "value", v))))
        elif isinstance(v, bool):
            parts.append((name, "i1"))
        elif isinstance(v, int):
            cls = "" if (name in dns or i in dns) else _int_class(v)
            parts.append((name, ("i32" if -2**31 <= v < 2**31 else "i64") + cls))
        elif isinstance(v, float):
            parts.append((name, "fp32"))
        elif v is None:
            parts.append((name, "None"))
        elif isinstance(v, torch.Tensor):
            aligned = "" if (name in dns_align or i in dns_align) else ("D" if v.data_ptr() % 16 == 0 else "")
            parts.append((name, f"*{v.dtype}{aligned}"))
        else:
            parts.append((name, repr(v)))
    return fn.fn.__name__, tuple(sorted(options.items())), tuple(parts)


class Recorder:
    """The keys of the launches made while `bucket` is set (None: not noted), per bucket; and the token count of
    each step that runs eagerly (`step_tokens`, per bucket)."""

    def __init__(self):
        self.keys: dict[str, set] = {}
        self.step_tokens: dict[str, list[int]] = {}
        self.bucket: str | None = None
        self.graph_step = False  # the step being run replays a decode graph on the GPU

    def note(self, key) -> None:
        if self.bucket is not None and not self.graph_step:
            self.keys.setdefault(self.bucket, set()).add(key)

    def attach(self, engine) -> None:
        """Leave out the steps of `engine` that would replay a decode graph on the GPU."""
        schedule, limit = engine.scheduler.schedule, engine.options.max_num_seqs

        def scheduled(*a, **kw):
            plan = schedule(*a, **kw)
            self.graph_step = bool(plan.chunks) and is_decode_step(plan.chunks) and len(plan.chunks) <= limit
            if plan.chunks and not self.graph_step and self.bucket is not None:
                self.step_tokens.setdefault(self.bucket, []).append(plan.num_tokens)
            return plan
        engine.scheduler.schedule = scheduled


def real_width_keys(rec: Recorder, token_counts) -> dict[int, frozenset]:
    """Per step token count T: the keys of the launches whose build follows T through V4.1-Flash's own dimensions,
    which tiny-v4.1's never reach: the mHC site input at D = 5,120 (its split-K tiles by T; tiny's D = 64 keeps one
    tiling) and the routing plan of 384 experts, top-6, on one GPU and on one EP4 rank (its block of pairs by T).
    They are called as the model calls them (mini.ops.mhc.pre_norm, plan_routes as mini.ops.moe does, with and
    without the row tiles), on zero inputs: the recorder runs no kernel."""
    from mini.config import V41_FLASH as c
    from mini.kernels.mxfp4_grouped_gemm import BLOCK_M
    from mini.kernels.moe_route import plan_routes
    from mini.ops import mhc
    hc, D, nm, k = c.hc_mult, c.dim, c.hc_mix, c.n_activated_experts
    fn, scale, base = torch.zeros(nm, hc * D), torch.zeros(3), torch.zeros(nm)
    norm_weight = torch.ones(D, dtype=torch.bfloat16)
    opts = dict(hc_mult=hc, iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, norm_eps=c.norm_eps)
    bucket, graph_step = rec.bucket, rec.graph_step
    rec.bucket, rec.graph_step, out = "real-width", False, {}
    try:
        for T in sorted(set(token_counts)):
            rec.keys.pop("real-width", None)
            h = torch.zeros(T, hc, D, dtype=torch.bfloat16)
            for pre_in in (torch.ones(T, hc), None):  # V4.1's delayed pre; a site's own pre
                mhc.pre_norm(h, fn, scale, base, norm_weight, pre_in, **opts)
            ids, weights = torch.zeros(T, k, dtype=torch.int64), torch.zeros(T, k)
            for experts in (range(c.n_routed_experts), range(c.n_routed_experts // 4)):
                for tiles in (True, False):
                    plan_routes(ids, weights, experts, BLOCK_M, tiles=tiles)
            out[T] = frozenset(rec.keys.pop("real-width", set()))
    finally:
        rec.bucket, rec.graph_step = bucket, graph_step
    return out


def record() -> Recorder:
    """Replace the interpreter's kernel launches (process-wide) by notes into the returned Recorder. The dense
    projections the fast path leaves to torch (F.linear: above the GEMV's rows, the head) return zeros of their
    output's shape instead of computing: their values are garbage here anyway (their inputs come from kernels that
    did not run) and no host decision reads them (requests end at max_tokens, ignore_eos, greedy), while their CPU
    GEMMs at a 2,048-token step were half of a burst's time."""
    from triton.runtime.interpreter import InterpretedFunction
    rec = Recorder()

    def run(self, *args, grid, warmup, **kwargs):
        rec.note(spec_key(self, args, dict(kwargs)))
    InterpretedFunction.run = run
    real_linear = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        if x.dtype != weight.dtype or x.shape[-1] != weight.shape[-1]:
            return real_linear(x, weight, bias)  # its error
        return x.new_zeros(*x.shape[:-1], weight.shape[0])
    torch.nn.functional.linear = linear
    return rec


# ---------------------------------------------------------------------- the script
def serve_burst(engine, tag: str, lengths: list[int], outputs: list[int], arrivals: list[int], seed: int) -> None:
    """Requests of these prompt lengths and output lengths, `arrivals[i]` of them added before step i (the rest
    after the last), greedy; steps until the engine is empty."""
    import random

    from mini.engine.sequence import SamplingParams
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    pending = [([rng.randrange(16, vocab) for _ in range(n)], m) for n, m in zip(lengths, outputs)]
    pending.reverse()

    def add(k: int) -> None:
        for _ in range(min(k, len(pending))):
            ids, m = pending.pop()
            engine.add_request(f"{tag}-{len(pending)}", ids, SamplingParams(temperature=0.0, max_tokens=m,
                                                                           ignore_eos=True))
    for k in arrivals:
        add(k)
        if engine.has_work():
            engine.step()
    add(len(pending))
    while engine.has_work():
        engine.step()


def bursts(budget: int, max_seqs: int, block_tokens: int, context: int, n_random: int) -> dict:
    """name -> (prompt lengths, output lengths, arrivals per step): the goodput benchmark's burst as it may come
    in, a skewed one, and `n_random` drawn from fixed seeds."""
    import random
    n, bt = max_seqs, block_tokens
    out = {
        "goodput-trickle": ([bt] * n, [bt // 2] * n, [1, 3, 10, 20, 30]),
        "goodput-at-once": ([bt] * n, [bt // 2] * n, [n]),
        "goodput-by-2": ([bt] * n, [8] * n, [2] * (n // 2)),
    }
    r = random.Random(1)
    out["skewed"] = ([r.randint(25, budget) for _ in range(n // 2)], [r.randint(1, 32) for _ in range(n // 2)],
                     [4] * (n // 8))
    for seed in range(n_random):
        r = random.Random(seed)
        k = r.randint(1, 2 * n)
        kind = r.choice(["fixed", "small", "large", "mixed"])
        if kind == "fixed":
            lengths = [r.randint(1, 4 * bt)] * k
        elif kind == "small":
            lengths = [r.randint(1, bt) for _ in range(k)]
        elif kind == "large":
            lengths = [r.randint(bt, 2 * budget) for _ in range(k)]
        else:
            lengths = [r.randint(1, 2 * budget) for _ in range(k)]
        outputs = [r.randint(1, 2 * bt) for _ in range(k)]
        lengths = [min(m, context - 2 * bt - 1) for m in lengths]
        out[f"random-{seed}-{kind}"] = (lengths, outputs, [r.randint(0, max(1, k // 3)) for _ in range(2 * k)])
    return out


def main() -> None:
    import argparse
    import json
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=2400)
    p.add_argument("--random", type=int, default=2, help="random bursts besides the fixed ones")
    p.add_argument("--first-parts", type=int, default=1, help="warm-up parts counted as the first")
    p.add_argument("--real-width", action="store_true",
                   help="also compare the V4.1-width builds that follow each eager step's token count")
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    import mini.ops
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    rec = record()
    from mini.engine import build_engine
    from mini.engine.warmup import plan, warm_up
    engine = build_engine("tiny-v4.1", device="cpu", dtype=torch.bfloat16, num_blocks=a.num_blocks,
                          block_tokens=a.block_tokens, max_num_seqs=a.max_seqs, max_num_batched_tokens=a.budget)
    rec.attach(engine)
    names = list(plan(a.budget, a.max_seqs, a.block_tokens, engine.max_model_len))
    rec.bucket = "first"
    warm_up(engine, parts=names[:a.first_parts])
    rec.bucket = "rest"
    warm_up(engine, parts=names[a.first_parts:])
    first, every = rec.keys.get("first", set()), rec.keys.get("first", set()) | rec.keys.get("rest", set())
    result = {"parts": names, "first_parts": names[:a.first_parts], "warmup_keys": len(every), "bursts": {}}
    for i, (tag, (lengths, outputs, arrivals)) in enumerate(
            bursts(a.budget, a.max_seqs, a.block_tokens, engine.max_model_len, a.random).items()):
        rec.bucket = tag
        serve_burst(engine, tag, lengths, outputs, arrivals, seed=i)
        keys = rec.keys.get(tag, set())
        result["bursts"][tag] = {"keys": len(keys), "missing": sorted(repr(k) for k in keys - every),
                                 "missing_after_first_parts": sorted(repr(k[0]) for k in keys - first)}
    if a.real_width:
        tokens = rec.step_tokens
        warm_tokens = tokens.get("first", []) + tokens.get("rest", [])
        real = real_width_keys(rec, [t for ts in tokens.values() for t in ts])
        warm = set().union(*(real[t] for t in warm_tokens))
        result["real_width"] = {"warmup_keys": len(warm), "warmup_kernels": sorted({k[0] for k in warm}),
                                "bursts": {tag: sorted(repr(k) for t in tokens.get(tag, []) for k in real[t] - warm)
                                           for tag in result["bursts"]}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
