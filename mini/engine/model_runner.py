"""Runs one scheduled step on the model: builds the flat batch for all chunks at once, keeps the cache pools.

Pool sizing: `num_blocks` if given; else on CUDA from free memory (`gpu_memory_utilization` of the device's
total, minus what is already used), on CPU from a 1 GiB budget. The state pools get `max_num_seqs` slots for
running sequences plus `num_snapshots` spare slots for prefix-cache snapshots (see block_manager).

With `cuda_graphs` (when: mini.engine.llm.use_cuda_graphs) pure-decode steps replay CUDA graphs captured per
batch-size bucket at start-up (mini.engine.cuda_graphs); prefill and mixed steps run eagerly. The cache then gets
one scratch slot and one scratch block past those the block manager hands out, for the padding rows to write into.
The graphs' memory pool is taken after the cache is sized, from what gpu_memory_utilization leaves.

`timing = True` records each step's host time (input preparation, the forward call: launches or one replay) and
its GPU span (CUDA events around the forward) in `last_timing`, for the decode-host benchmark.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mini.engine.block_manager import SlotCopy
from mini.engine.cuda_graphs import DecodeGraphs, TokenFeed
from mini.engine.sampler import to_device
from mini.engine.scheduler import ScheduledChunk


@dataclass
class CacheShape:
    n_blocks: int
    block_tokens: int
    n_seq_slots: int
    n_snapshots: int

    @property
    def n_slots(self) -> int:
        return self.n_seq_slots + self.n_snapshots


CPU_CACHE_BYTES = 1 << 30  # default pool budget on CPU, where free memory says little about what to use


def size_cache(cache_cls, config, device, dtype, block_tokens: int, max_num_seqs: int, num_snapshots: int,
               num_blocks: int | None, gpu_memory_utilization: float, max_model_len: int) -> CacheShape:
    """How many blocks fit. Explicit `num_blocks` wins. Otherwise the budget (CUDA: what is free beyond
    `1 - gpu_memory_utilization` of the device; CPU: 1 GiB) goes to the slots and then to blocks, up to what
    `max_num_seqs` sequences of `max_model_len` tokens can use."""
    n_slots = max_num_seqs + num_snapshots
    if num_blocks is None:
        if torch.device(device).type == "cuda":
            free, total = torch.cuda.mem_get_info(torch.device(device))
            budget = free - (1.0 - gpu_memory_utilization) * total
        else:
            budget = CPU_CACHE_BYTES
        per_block = cache_cls.bytes_per_block(config, block_tokens, dtype)
        per_slot = cache_cls.bytes_per_slot(config, dtype)
        num_blocks = int((budget - n_slots * per_slot) // per_block)
        num_blocks = min(num_blocks, max_num_seqs * -(-max_model_len // block_tokens))
        if num_blocks < 1:
            raise RuntimeError(f"no memory left for the cache: {budget / 2**30:.2f} GiB budget, "
                               f"{n_slots} slots need {n_slots * per_slot / 2**30:.2f} GiB; raise "
                               "gpu_memory_utilization (CUDA), give num_blocks, or lower max_num_seqs / num_snapshots")
    return CacheShape(num_blocks, block_tokens, max_num_seqs, num_snapshots)


@dataclass
class ForwardTiming:
    prepare_s: float  # host: chunks -> device inputs (Batch.build, or the graph's buffers)
    forward_s: float  # host: the forward call (eager launches, or one graph replay)
    graph: bool
    events: tuple | None  # CUDA events around the forward (None on CPU)

    def gpu_s(self) -> float | None:
        """The forward's GPU span; waits for it to finish."""
        if self.events is None:
            return None
        start, end = self.events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class ModelRunner:
    def __init__(self, model, config, shape: CacheShape, device, dtype, batch_cls, cache_cls, seq_chunk_cls,
                 cuda_graphs: bool = False, max_model_len: int | None = None):
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.shape = shape
        self.batch_cls = batch_cls
        self.seq_chunk_cls = seq_chunk_cls
        scratch = int(cuda_graphs)
        self.cache = cache_cls(config, n_slots=shape.n_slots + scratch, n_blocks=shape.n_blocks + scratch,
                               block_tokens=shape.block_tokens, device=device, dtype=dtype)
        self.hasher = getattr(model, "hasher", None)
        self.timing, self.last_timing = False, None
        self.graphs = None
        if cuda_graphs:
            from mini.model import DecodeBuffers
            engram_shape, engram_lookback = None, 0
            if self.hasher is not None and getattr(model, "engram_on_device", False):
                engram_lookback = self.hasher.lookback  # hashed and looked up on the device, inside the graph
            elif self.hasher is not None:
                engram_shape = (*self.hasher.primes.shape, config.engram_head_dim)  # rows looked up on the host
            buffers = DecodeBuffers(shape.n_seq_slots, max_model_len or config.max_position_embeddings,
                                    shape.block_tokens, pad_slot=shape.n_slots, pad_block=shape.n_blocks,
                                    device=self.device, engram_shape=engram_shape, engram_dtype=dtype,
                                    engram_lookback=engram_lookback)
            self.graphs = DecodeGraphs(model, self.cache, buffers, self.hasher)
            self.graphs.capture_all()

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], feed: TokenFeed | None = None) -> torch.Tensor:
        """Forward one step. Returns fp32 logits, one row per chunk that `samples`, in chunk order. `feed`: tokens
        still on the device; a static decode step takes them there, the eager forward fetches them first."""
        t0 = time.perf_counter()
        graph = self.graphs is not None and self.graphs.fits(chunks)
        if feed is not None and not graph:
            feed.fetch()
            feed = None
        if graph:
            n = self.graphs.prepare(chunks, _history, feed)
        else:
            seq_chunks = [self.seq_chunk_cls(tokens=_history(c.seq, 0, c.end), start=c.start, slot=c.seq.slot,
                                             blocks=c.seq.blocks, want_logits=c.samples) for c in chunks]
            batch = self.batch_cls.build(seq_chunks, self.config, self.device, hasher=self.hasher)
        t1 = time.perf_counter()
        events = None
        if self.timing and self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        logits = self.graphs.replay(n, len(chunks)) if graph else self.model.forward(batch, self.cache).float()
        if events is not None:
            events[1].record()
        if self.timing:
            self.last_timing = ForwardTiming(t1 - t0, time.perf_counter() - t1, graph, events)
        return logits

    @torch.inference_mode()
    def copy_slots(self, copies: list[SlotCopy]) -> None:
        """Copy per-sequence state rows between slots (prefix-cache snapshot / restore)."""
        if not copies:
            return
        if hasattr(self.cache, "copy_slot"):
            for c in copies:
                self.cache.copy_slot(c.src, c.dst)
            return
        src = to_device(torch.tensor([c.src for c in copies]), self.device)
        dst = to_device(torch.tensor([c.dst for c in copies]), self.device)
        for pool in _slot_pools(self.cache):
            pool.index_copy_(0, dst, pool.index_select(0, src))


def _history(seq, start: int, end: int) -> list[int]:
    """Tokens start..end-1 of the sequence's history (prompt + output), without copying the rest."""
    prompt, n_prompt = seq.prompt_token_ids, len(seq.prompt_token_ids)
    if end <= n_prompt:
        return prompt[start:end]
    if start >= n_prompt:
        return seq.output_token_ids[start - n_prompt:end - n_prompt]
    return prompt[start:] + seq.output_token_ids[:end - n_prompt]


def _slot_pools(cache) -> list[torch.Tensor]:
    """The per-slot tensors of mini.model.KVCache (window rings, compressor states): every row of dim 0 is a slot.
    Paged pools (comp_kv, index_k) are indexed by block and are not copied."""
    pools = list(cache.window)
    for states in (cache.comp_state, cache.index_state):
        for kv_and_score in states.values():
            pools += list(kv_and_score)
    return pools
