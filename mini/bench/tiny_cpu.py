"""`tiny-cpu`: prefill and decode throughput of the tiny-v4.1 model on the CPU through `mini.engine.LLM`.

A few seconds in all, meant for A/B runs of code changes on any machine (`tools/bench_rev.py ... --suite
tiny-cpu`), not for absolute numbers. `--batch` prompts of `--prompt-len` random token ids are prefilled in one
step, then decoded greedily for `--decode-tokens` steps (EOS ignored). A short generation (one prefill, one decode
step) warms up, then the generation runs `--iters` times; each metric is the median over the timed iterations.
"""
from __future__ import annotations

import random
import statistics
import time

import torch

MODEL = "tiny-v4.1"


def add_args(p) -> None:
    p.add_argument("--batch", type=int, default=2, help="prompts per generation")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    p.add_argument("--decode-tokens", type=int, default=4, help="generated tokens per prompt")
    p.add_argument("--iters", type=int, default=2, help="timed generations")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")


def _generate(llm, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one greedy generation: the step(s) that produce every sequence's
    first token, then the rest."""
    from mini.engine import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    started, first = set(), time.perf_counter()
    t0 = first
    while len(started) < len(prompts):
        started |= {o.request_id for o in engine.step() if o.token_ids}
        first = time.perf_counter()
    while engine.has_work():
        engine.step()
    return first - t0, time.perf_counter() - first


def run(args) -> dict:
    from mini.engine import LLM
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    n_tokens = args.prompt_len + args.decode_tokens + 1
    llm = LLM(MODEL, device="cpu", dtype=dtype, max_num_seqs=args.batch,
              max_num_batched_tokens=args.batch * args.prompt_len, block_tokens=64,
              num_blocks=args.batch * (-(-n_tokens // 64)) + 4, enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.engine.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    _generate(llm, prompts, 1)  # warm-up: one prefill and one decode step
    times = [_generate(llm, prompts, args.decode_tokens) for _ in range(args.iters)]
    prefill = statistics.median(t for t, _ in times)
    decode = statistics.median(t for _, t in times)
    return {
        "suite": "tiny-cpu",
        "definition": {"model": MODEL, "device": "cpu", "dtype": args.dtype, "batch": args.batch,
                       "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens, "iters": args.iters,
                       "threads": args.threads},
        "metrics": {"prefill_tok_per_s": args.batch * args.prompt_len / prefill,
                    "decode_tok_per_s": args.batch * args.decode_tokens / decode,
                    "prefill_ms": 1e3 * prefill, "decode_step_ms": 1e3 * decode / args.decode_tokens},
    }
