"""Warm-up before serving: run the step shapes the first requests will use, so that their kernels are compiled
(Triton JIT, cuBLAS handles, allocator pools) before the server says it is ready, not during the first burst.

Decode graphs are captured when the engine is built (mini.engine.cuda_graphs); the warm-up covers the steps they
do not: prefill and mixed steps, which run eagerly. Triton compiles a kernel once per *specialization*: besides
its constexprs (block sizes, often picked from the step's sizes) an integer argument is specialized on being 1,
a multiple of 16, or neither, and a pointer on its 16-byte alignment. The integers a step passes come from its
shape: tokens in the step, sequences, the longest block table (a sequence of one block gives a stride of 1), the
compressed entries visible, rows per expert. So the warm-up runs, through the real scheduler, parts (`plan`)
whose steps take each of these through its classes:

* "budget+powers": one prompt of twice the token budget (budget-sized chunks, the second over cached context),
  with max_num_seqs prompts of every power-of-two length up to half the budget (kernels that size blocks by the
  step), then decode at shrinking batch sizes, greedy and sampled;
* "alone-L": one prompt by itself, L = 2^k and 2^k + 1 up to the budget (a multiple of 16 or not; up to a block,
  one block: block-table stride 1);
* "trickle": prompts arriving a few per step while the earlier ones decode, as a burst of HTTP requests comes
  in: mixed steps of decodes and prefills with the sequences still within one block, then crossing into a second;
* "decode-buckets": decode steps at every CUDA-graph bucket's batch size (a graph's first replay uploads it).

tests/engine/test_warmup.py checks, without a GPU, that the kernel specializations of served bursts of varied
shapes are ones the warm-up compiled (tests/engine/specializations.py). The prompts are random token ids from a
fixed seed; every request runs to its end, so the engine is left empty, and its counters (steps, tokens,
prefix-cache hits) are reset. Their blocks stay in the prefix cache like any finished request's.
"""
from __future__ import annotations

import gc
import random
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from mini.engine.cuda_graphs import buckets
from mini.engine.llm import LLMEngine
from mini.engine.sequence import SamplingParams
from mini.engine.warmup_trace import from_env as trace_from_env


@dataclass(frozen=True)
class WarmupRequest:
    length: int  # prompt tokens
    max_tokens: int
    sampled: bool = False  # temperature 1, top-p 0.9 (else greedy)


# a part: arrival groups; group i is added before the part's step i, then the part steps until the engine is empty
Part = list[list[WarmupRequest]]


def plan(budget: int, max_seqs: int, block_tokens: int, context: int) -> dict[str, Part]:
    """The warm-up's parts, in order, for a token budget per step, max_num_seqs, block size and context (prompt
    lengths are capped so that every request fits the context)."""
    def fit(n: int) -> int:
        return max(1, min(n, context - 9))

    def req(n: int, max_tokens: int, sampled: bool = False) -> WarmupRequest:
        return WarmupRequest(fit(n), min(max_tokens, context - fit(n)), sampled)

    lengths = [min(2 ** (i % budget.bit_length()), max(1, budget // 2)) for i in range(max_seqs)]
    parts: dict[str, Part] = {"budget+powers": [[req(2 * budget, 2)] + [
        req(n, 2 + i % 8, sampled=bool(i % 2)) for i, n in enumerate(lengths)]]}
    # one prompt alone of each length 2^k and 2^k + 1 up to the budget: steps of exactly that many tokens, so that
    # each power-of-two range of step sizes (kernels pick tiles by it, at a real model's width more than at a tiny
    # one's: docs/serving.md) is built with the size a multiple of 16 and not (up to a block: a block-table stride 1)
    alone = {block_tokens // 2 + 1} | {m for k in range(1, budget.bit_length()) for m in (2 ** k, 2 ** k + 1)}
    for n in sorted(m for m in alone if 1 < m <= budget):
        parts[f"alone-{fit(n)}"] = [[req(n, 3)]]
    # arrivals 1, 1, 2, 3, 5, 8, ... per step up to max_num_seqs, each request decoding past the last arrival; half
    # the prompts fill their block exactly (their first token opens a second), the others stay within one
    sizes, a, b = [], 1, 1
    while sum(sizes) < max_seqs:
        sizes.append(min(a, max_seqs - sum(sizes)))
        a, b = b, a + b
    shapes = (block_tokens, block_tokens // 2 + 1)
    trickle, i = [], 0
    for size in sizes:
        trickle.append([req(shapes[(i + j) % 2], len(sizes) + 2 + (i + j) % 4) for j in range(size)])
        i += size
    parts["trickle"] = trickle
    # decode at every CUDA-graph bucket (each graph's first replay uploads it): one-token prompts, the group of
    # bucket j (its size less the next's) ending after j + 2 tokens, so that decode step j + 2 runs bucket j's size
    sizes = sorted(buckets(max_seqs), reverse=True) + [0]
    parts["decode-buckets"] = [[req(1, j + 2) for j in range(len(sizes) - 1) for _ in range(sizes[j] - sizes[j + 1])]]
    return parts


def freeze_heap() -> float:
    """Collect, then take every object alive now (the modules, the model, the engine: what start-up made) out of
    the garbage collector's walks (gc.freeze); returns seconds. A full collection while serving then walks only
    what serving made: on the H200 one over start-up's objects paused the server for 0.19 s, at the start of the
    goodput benchmark's second burst (MINI_WARMUP_TRACE). For a process that serves until it ends (`mini serve`):
    objects frozen here that later become garbage in a reference cycle are never freed."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0


class Stepper(Protocol):
    """Who steps the engine during the warm-up: the engine itself, or every rank of a lock step together
    (mini.parallel.dp.LockStepEngine)."""

    def step(self) -> object: ...

    def has_work(self) -> bool: ...


def warm_up(engine: LLMEngine, seed: int = 0, parts: Iterable[str] | None = None,
            stepper: Stepper | None = None) -> float:
    """Run the warm-up requests to their end on `engine` (not yet shared with another thread); returns seconds,
    also recorded on the engine (`LLMEngine.warmed_up`, which resets its counters). `parts`: only these parts of
    `plan` (tests). `stepper`: steps the engine (default: the engine itself).

    It runs in a thread of its own that ends with it: torch keeps per-thread library handles (cuBLAS, cuBLASLt
    and their workspaces) in pools that a thread's handles return to when it exits, so the engine's thread,
    started after, takes these instead of creating its own during the first burst."""
    done: dict = {}

    def run() -> None:
        try:
            device = engine.runner.device
            if device.type == "cuda" and device.index is not None:  # a new thread starts on the default device
                torch.cuda.set_device(device)
            done["s"] = _warm_up(engine, seed, parts, stepper)
        except BaseException as e:  # raised again in the caller's thread
            done["error"] = e
    thread = threading.Thread(target=run, name="mini-warmup")
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["s"]


def _warm_up(engine: LLMEngine, seed: int, parts: Iterable[str] | None, stepper: Stepper | None) -> float:
    t0 = time.perf_counter()
    trace = trace_from_env(engine)  # MINI_WARMUP_TRACE: what compiles now and what still compiles when serving
    if trace is not None:
        engine.trace = trace
    stepper = stepper or engine  # after the trace wraps engine.step
    o = engine.options
    vocab = engine.config.vocab_size
    n = 0
    for name, groups in plan(o.max_num_batched_tokens, o.max_num_seqs, o.block_tokens, engine.max_model_len).items():
        if parts is not None and name not in parts:
            continue
        rng = random.Random(f"{seed}:{name}")  # the part's prompts, whatever ran before it
        if trace is not None:
            trace.phase = f"warmup:{name}"
        for group in groups:
            for r in group:
                # every request brings its seed: the engine's own generator (seeds of requests without one) stays
                # untouched, so a warmed server draws the same seeds as a cold one
                params = SamplingParams(temperature=1.0 if r.sampled else 0.0, top_p=0.9 if r.sampled else 1.0,
                                        seed=n, max_tokens=r.max_tokens, ignore_eos=True)
                engine.add_request(f"warmup-{n}", [rng.randrange(min(16, vocab - 1), vocab)
                                                   for _ in range(r.length)], params)
                n += 1
            stepper.step()
        while stepper.has_work():
            stepper.step()
    seconds = time.perf_counter() - t0
    engine.warmed_up(seconds)
    if trace is not None:
        trace.emit("warmup_done", s=round(seconds, 3))
        trace.phase = "serve"
    return seconds
