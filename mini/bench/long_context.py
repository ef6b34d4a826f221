"""`long-context`: one long prompt (131,072 tokens by default) prefilled in chunks on one EP4/DP4 rank at real
V4.1-Flash shape: time, peak memory, and the cache's bytes per token against what the compressed-KV schedule
predicts.

The model is rank4's (mini/bench/rank4.py): all 40 layers, random weights drawn on the device, this rank's 96 of
384 experts, Engram tables capped to `--engram-rows` rows (hash ids taken modulo the rows), the MoE through rank4's
exchange emulation (`EmulatedEP`: the local experts also process (ep - 1) x the chunk's rows as synthetic remote
tokens; the communication is not run). The prompt is one sequence of random tokens, prefilled `--chunk` tokens per
step from position 0, each step a fresh Batch over the whole history (as the engine's chunked prefill builds it);
every chunk is timed by CUDA events, the whole prefill by the wall clock (batch building on the host included).
Before that (`--warmup-chunk`, default on) one chunk is prefilled into a scratch cache, untimed (`warmup_s`): the
kernels' compiles for the chunk's shapes (the first chunk took 18.3 s of 37.3 without it on the H200).

The cache: `predicted_cache_bytes` computes from the config alone (the layer schedule: which layers own compressed
KV and index keys, at which ratio; the window rings and the compressor states per sequence) what one sequence of N
tokens must hold; `written_cache_bytes` counts, after the prefill, the rows of the pools that hold values (the
pools start at zero; a written row of random-weight activations is never all zeros), so the comparison checks that
the engine stores what the schedule says and nothing more. Against it: the bytes per token of a cache that kept
every layer's full KV row (n_layers x head_dim), the ratio the compressed schedule saves.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mini.config import ModelConfig, preset

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


def predicted_cache_bytes(cfg: ModelConfig, tokens: int, elem_bytes: int) -> dict[str, int]:
    """Bytes one sequence of `tokens` tokens holds, from the layer schedule: `compressed_kv` (each KV-owning layer:
    one head_dim row per `ratio` tokens, complete groups only), `index_keys` (each key-owning layer: one
    index_head_dim row per group), `window` (a ring of min(tokens, W) rows per layer), `compressor_state` (fp32
    kv + score of the open group, per compressing layer with ratio > 1; V4's indexer compressors too)."""
    out = {"compressed_kv": 0, "index_keys": 0, "window": 0, "compressor_state": 0}
    for p in cfg.layers:
        out["window"] += min(tokens, cfg.window_size) * cfg.head_dim * elem_bytes
        if p.owns_kv:
            out["compressed_kv"] += tokens // p.ratio * cfg.head_dim * elem_bytes
            if p.ratio > 1:
                overlap = not cfg.is_v41 and p.ratio == 4  # V4's overlapping windows: 2 x rows, 2 x width
                out["compressor_state"] += 2 * (p.ratio * (1 + overlap)) * (cfg.head_dim * (1 + overlap)) * 4
        if p.owns_index_keys:
            out["index_keys"] += tokens // p.ratio * cfg.index_head_dim * elem_bytes
            if not cfg.is_v41:
                overlap = p.ratio == 4
                out["compressor_state"] += 2 * (p.ratio * (1 + overlap)) * (cfg.index_head_dim * (1 + overlap)) * 4
    return out


def per_token_bytes(cfg: ModelConfig, elem_bytes: int) -> float:
    """The bytes each further token adds: compressed KV and index keys of the owning layers (head_dim / ratio and
    index_head_dim / ratio per layer)."""
    return sum((cfg.head_dim * p.owns_kv + cfg.index_head_dim * p.owns_index_keys) * elem_bytes / p.ratio
               for p in cfg.layers if p.owns_kv or p.owns_index_keys)


@torch.no_grad()
def written_cache_bytes(cache, slot: int, blocks: list[int]) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes by kind, rows by pool) of the cache that hold values for the sequence in `slot` with `blocks`: rows
    of the paged pools with any nonzero entry, ring rows of its slot, and its compressor states (counted whole:
    they are a fixed size per sequence)."""
    idx = torch.tensor(blocks, device=cache.device)

    def rows(pool: torch.Tensor) -> int:
        return int((pool.index_select(0, idx) != 0).any(-1).sum())

    def row_bytes(pool: torch.Tensor) -> int:
        return pool.shape[-1] * pool.element_size()

    out = {"compressed_kv": 0, "index_keys": 0, "window": 0, "compressor_state": 0}
    counts = {}
    for name, pools in (("compressed_kv", cache.comp_kv), ("index_keys", cache.index_k)):
        for layer, pool in pools.items():
            n = rows(pool)
            counts[f"{name}.{layer}"] = n
            out[name] += n * row_bytes(pool)
    for layer, ring in enumerate(cache.window):
        n = int((ring[slot] != 0).any(-1).sum())
        counts[f"window.{layer}"] = n
        out["window"] += n * row_bytes(ring)
    for states in (cache.comp_state, cache.index_state):
        for kv, score in states.values():
            out["compressor_state"] += kv[slot].numel() * kv.element_size() + score[slot].numel() * score.element_size()
    return out, counts


def run(args) -> dict:
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
    elem = torch.empty((), dtype=dtype).element_size()
    predicted = predicted_cache_bytes(cfg, N, elem)
    written, rows = written_cache_bytes(cache, 0, blocks)
    allocated = (len(blocks) * KVCache.bytes_per_block(cfg, bt, dtype) + KVCache.bytes_per_slot(cfg, dtype))
    expected_rows = {f"compressed_kv.{p.layer}": N // p.ratio for p in cfg.layers if p.owns_kv}
    expected_rows.update({f"index_keys.{p.layer}": N // p.ratio for p in cfg.layers if p.owns_index_keys})
    expected_rows.update({f"window.{i}": min(N, cfg.window_size) for i in range(cfg.n_layers)})
    mismatched = sorted(k for k in expected_rows if rows.get(k) != expected_rows[k])
    full_kv = cfg.n_layers * cfg.head_dim * elem  # bytes per token of a cache keeping every layer's KV row
    m = {"prompt_tokens": N, "chunks": len(chunk_ms), "setup_s": setup_s, "warmup_s": warmup_s, "total_s": total_s,
         "tok_per_s": N / total_s, "gpu_s": sum(chunk_ms) / 1e3, "host_batch_s": sum(host_ms) / 1e3,
         "first_chunk_ms": chunk_ms[0], "last_chunk_ms": chunk_ms[-1], "median_chunk_ms": statistics.median(chunk_ms),
         "predicted_bytes_per_token": sum(predicted.values()) / N,
         "predicted_marginal_bytes_per_token": per_token_bytes(cfg, elem),
         "written_bytes_per_token": sum(written.values()) / N,
         "written_over_predicted": sum(written.values()) / sum(predicted.values()),
         "allocated_bytes_per_token": allocated / N,
         "full_kv_bytes_per_token": full_kv, "full_kv_over_predicted": full_kv * N / sum(predicted.values()),
         "pools_with_unexpected_rows": len(mismatched),
         **{f"predicted_mb.{k}": v / 1e6 for k, v in predicted.items()},
         **{f"written_mb.{k}": v / 1e6 for k, v in written.items()}}
    if cuda:
        m["built_mem_gb"] = built
        m["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        m["peak_over_built_gb"] = m["peak_mem_gb"] - built
    definition = {"preset": args.preset, "prompt_tokens": N, "chunk": args.chunk, "warmup_chunk": args.warmup_chunk,
                  "ep": args.ep, "dtype": args.dtype,
                  "block_tokens": bt, "engram_rows": args.engram_rows, "seed": args.seed, "routing": args.routing,
                  "layers": cfg.n_layers,
                  "device": torch.cuda.get_device_name() if cuda else "cpu"}
    return {"suite": SUITE, "definition": definition, "metrics": m,
            "raw": {"chunk_ms": chunk_ms, "host_ms": host_ms, "rows": rows, "expected_rows": expected_rows,
                    "mismatched_pools": mismatched}}
