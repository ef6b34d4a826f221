"""`long-context`: one long prompt (131,072 tokens by default) prefilled in chunks on one EP4/DP4 rank at real
V4.1-Flash shape: time and peak memory.

The model is rank4's (mini/bench/rank4.py): all 40 layers, random weights drawn on the device, this rank's 96 of
384 experts, Engram tables capped to `--engram-rows` rows (hash ids taken modulo the rows), the MoE through rank4's
exchange emulation (`EmulatedEP`: the local experts also process (ep - 1) x the chunk's rows as synthetic remote
tokens; the communication is not run). The prompt is one sequence of random tokens, prefilled `--chunk` tokens per
step from position 0, each step a fresh Batch over the whole history (as the engine's chunked prefill builds it);
every chunk is timed by CUDA events, the whole prefill by the wall clock (batch building on the host included).
Before that (`--warmup-chunk`, default on) one chunk is prefilled into a scratch cache, untimed (`warmup_s`): the
kernels' compiles for the chunk's shapes (the first chunk took 18.3 s of 37.3 without it on the H200).
The cache's bytes per token against what the compressed-KV schedule predicts: tools/long_context_cache.py, which
runs this suite with that check added.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mini.config import preset

SUITE = "long-context"


def add_args(p) -> None:
    from mini.testing.rank_model import add_emulated_rank_args
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--prompt-tokens", type=int, default=131072)
    p.add_argument("--chunk", type=int, default=4096, help="prompt tokens per prefill step")
    p.add_argument("--ep", type=int, default=4, help="EP ranks emulated (this is rank 0)")
    add_emulated_rank_args(p)
    p.add_argument("--warmup-chunk", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill one chunk into a scratch cache first (kernel compiles, Humming JIT), not timed")


def run(args, study=None) -> dict:
    """The suite; `study(cfg, cache, blocks, N, dtype)` (tools/long_context_cache.py) adds its metrics and raw entries
    after the prefill."""
    from mini.testing.suites import SuiteError, timed_call
    from mini.testing.rank_model import emulated_rank, hasher_of
    from mini.model import Batch, KVCache
    from mini.model.batch import SeqChunk
    if args.prompt_tokens < 1 or args.chunk < 1:
        raise SuiteError(f"{SUITE}: --prompt-tokens and --chunk must be positive")
    cuda = args.device.startswith("cuda")
    cfg = preset(args.preset)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.prompt_tokens > cfg.max_position_embeddings:
        raise SuiteError(f"{SUITE}: {args.prompt_tokens} tokens exceed the model's {cfg.max_position_embeddings}")
    cfg, exchange, model, setup_s = emulated_rank(args)
    N, bt = args.prompt_tokens, args.block_tokens
    blocks = list(range(-(-N // bt)))
    cache = KVCache(cfg, 1, len(blocks), bt, device, dtype)
    hasher = hasher_of(cfg)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(3, cfg.vocab_size, (N,), generator=g).tolist()
    warmup_s = 0.0
    if args.warmup_chunk:  # the first chunk's shapes compiled outside the timed prefill (18 s on the H200)
        w0 = time.perf_counter()
        n = min(args.chunk, N)
        scratch = KVCache(cfg, 1, -(-n // bt), bt, device, dtype)
        batch = Batch.build([SeqChunk(tokens[:n], 0, 0, list(range(-(-n // bt))))], cfg, device, hasher)
        if batch.engram is not None and args.engram_rows:
            batch.engram.data = batch.engram.data % args.engram_rows
        model.forward(batch, scratch)
        if cuda:
            torch.cuda.synchronize()
        del scratch, batch
        warmup_s = time.perf_counter() - w0
    if cuda:
        torch.cuda.synchronize()
        built = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    chunk_ms, host_ms = [], []
    t0 = time.perf_counter()
    for start in range(0, N, args.chunk):
        end = min(start + args.chunk, N)
        h0 = time.perf_counter()
        batch = Batch.build([SeqChunk(tokens[:end], start, 0, blocks)], cfg, device, hasher)
        if batch.engram is not None and args.engram_rows:
            batch.engram.data = batch.engram.data % args.engram_rows  # hash ids -> the capped tables' rows
        host_ms.append(1e3 * (time.perf_counter() - h0))
        logits, ms = timed_call(lambda: model.forward(batch, cache), cuda)
        chunk_ms.append(ms)
        if not bool(torch.isfinite(logits).all()):
            raise SuiteError(f"{SUITE}: non-finite logits after the chunk at {start}")
    total_s = time.perf_counter() - t0
    m = {"prompt_tokens": N, "chunks": len(chunk_ms), "setup_s": setup_s, "warmup_s": warmup_s, "total_s": total_s,
         "tok_per_s": N / total_s, "gpu_s": sum(chunk_ms) / 1e3, "host_batch_s": sum(host_ms) / 1e3,
         "first_chunk_ms": chunk_ms[0], "last_chunk_ms": chunk_ms[-1], "median_chunk_ms": statistics.median(chunk_ms)}
    raw = {"chunk_ms": chunk_ms, "host_ms": host_ms}
    if study is not None:
        more, more_raw = study(cfg, cache, blocks, N, dtype)
        m.update(more)
        raw.update(more_raw)
    if cuda:
        m["built_mem_gb"] = built
        m["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        m["peak_over_built_gb"] = m["peak_mem_gb"] - built
    definition = {"preset": args.preset, "prompt_tokens": N, "chunk": args.chunk, "warmup_chunk": args.warmup_chunk,
                  "ep": args.ep, "dtype": args.dtype,
                  "block_tokens": bt, "engram_rows": args.engram_rows, "seed": args.seed, "routing": args.routing,
                  "layers": cfg.n_layers,
                  "device": torch.cuda.get_device_name() if cuda else "cpu"}
    return {"suite": SUITE, "definition": definition, "metrics": m, "raw": raw}
