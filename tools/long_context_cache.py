"""long-context (mini/bench/long_context.py) with its cache checked against the compressed-KV schedule (issue 13
item 6, docs/perf/009; phase `long_context` of scripts/gpu.sh): the suite runs here with the check added after the
prefill:

    python3 tools/long_context_cache.py [long-context options] [--json FILE]

`predicted_cache_bytes` computes from the config alone (the layer schedule: which layers own compressed KV and
index keys, at which ratio; the window rings and the compressor states per sequence) what one sequence of N tokens
must hold; `written_cache_bytes` counts, after the prefill, the rows of the pools that hold values (the pools start
at zero; a written row of random-weight activations is never all zeros), so the comparison checks that the engine
stores what the schedule says and nothing more. Against it: the bytes per token of a cache that kept every layer's
full KV row (n_layers x head_dim), the ratio the compressed schedule saves.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import long_context  # noqa: E402
from mini.bench.long_context import SUITE  # noqa: E402
from mini.config import ModelConfig  # noqa: E402
from mini.testing.suites import run_as_script  # noqa: E402

add_args = long_context.add_args


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


def cache_check(cfg: ModelConfig, cache, blocks: list[int], N: int, dtype) -> tuple[dict[str, float], dict]:
    """long_context.run's study: the cache of the prefilled sequence of N tokens (slot 0, `blocks`) against the
    schedule."""
    from mini.model import KVCache
    bt = cache.block_tokens
    elem = torch.empty((), dtype=dtype).element_size()
    predicted = predicted_cache_bytes(cfg, N, elem)
    written, rows = written_cache_bytes(cache, 0, blocks)
    allocated = (len(blocks) * KVCache.bytes_per_block(cfg, bt, dtype) + KVCache.bytes_per_slot(cfg, dtype))
    expected_rows = {f"compressed_kv.{p.layer}": N // p.ratio for p in cfg.layers if p.owns_kv}
    expected_rows.update({f"index_keys.{p.layer}": N // p.ratio for p in cfg.layers if p.owns_index_keys})
    expected_rows.update({f"window.{i}": min(N, cfg.window_size) for i in range(cfg.n_layers)})
    mismatched = sorted(k for k in expected_rows if rows.get(k) != expected_rows[k])
    full_kv = cfg.n_layers * cfg.head_dim * elem  # bytes per token of a cache keeping every layer's KV row
    m = {"predicted_bytes_per_token": sum(predicted.values()) / N,
         "predicted_marginal_bytes_per_token": per_token_bytes(cfg, elem),
         "written_bytes_per_token": sum(written.values()) / N,
         "written_over_predicted": sum(written.values()) / sum(predicted.values()),
         "allocated_bytes_per_token": allocated / N,
         "full_kv_bytes_per_token": full_kv, "full_kv_over_predicted": full_kv * N / sum(predicted.values()),
         "pools_with_unexpected_rows": len(mismatched),
         **{f"predicted_mb.{k}": v / 1e6 for k, v in predicted.items()},
         **{f"written_mb.{k}": v / 1e6 for k, v in written.items()}}
    return m, {"rows": rows, "expected_rows": expected_rows, "mismatched_pools": mismatched}


def run(args) -> dict:
    return long_context.run(args, cache_check)


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__name__, SUITE, "long-context with its cache checked against the schedule", argv,
                         "tools/long_context_cache.py")


if __name__ == "__main__":
    raise SystemExit(main())
