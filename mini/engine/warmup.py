"""Warm-up before serving: run the step shapes the first requests will use, so that their kernels are compiled
(Triton JIT, cuBLAS handles, allocator pools) before the server says it is ready, not during the first burst.

Decode graphs are captured when the engine is built (mini.engine.cuda_graphs); this adds what they do not cover:
prefill steps at the full token budget (one long prompt, in budget-sized chunks, the second over cached context),
steps of many prompts at once (lengths 1, 2, 4, ... up to half the budget), mixed prefill + decode steps, and eager decode at shrinking batch sizes
(requests of different lengths finish one after another), greedy and sampled. The prompts are random token ids
from a fixed seed; every request runs to its end, so the engine is left empty, and its counters (steps, tokens,
prefix-cache hits) are reset. Their blocks stay in the prefix cache like any finished request's.
"""
from __future__ import annotations

import random
import time

from mini.engine.block_manager import PrefixCacheStats
from mini.engine.llm import EngineStats, LLMEngine
from mini.engine.sequence import SamplingParams
from mini.engine.warmup_trace import from_env as trace_from_env


def warm_up(engine: LLMEngine, seed: int = 0) -> float:
    """Run the warm-up requests to their end on `engine` (not yet shared with another thread); returns seconds."""
    t0 = time.perf_counter()
    trace = trace_from_env(engine)  # MINI_WARMUP_TRACE: what compiles now and what still compiles when serving
    if trace is not None:
        engine.trace, trace.phase = trace, "warmup"
    o = engine.options
    rng = random.Random(seed)
    budget, n_seqs, context = o.max_num_batched_tokens, o.max_num_seqs, engine.max_model_len
    vocab = engine.config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(min(16, vocab - 1), vocab) for _ in range(max(1, min(n, context - 9)))]

    # every request brings its seed: the engine's own generator (seeds of requests without one) stays untouched,
    # so a warmed server draws the same seeds as a cold one
    requests = [(prompt(2 * budget), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, seed=0))]
    # a burst: prefill steps of many chunks of every power-of-two length up to half the budget (kernels specialize
    # on sizes), then decode at shrinking batch sizes
    lengths = [min(2 ** (i % budget.bit_length()), max(1, budget // 2)) for i in range(n_seqs)]
    for i, n in enumerate(lengths):
        sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=2 + i % 8, ignore_eos=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=2 + i % 8, ignore_eos=True, seed=i)
        requests.append((prompt(n), sampled if i % 2 else greedy))
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"warmup-{i}", ids, params)
    while engine.has_work():
        engine.step()
    engine.stats = EngineStats()
    engine.blocks.stats = PrefixCacheStats()
    seconds = time.perf_counter() - t0
    if trace is not None:
        trace.emit("warmup_done", s=round(seconds, 3))
        trace.phase = "serve"
    return seconds
