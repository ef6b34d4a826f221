"""Runs one scheduled step on the model: builds the flat batch for all chunks at once, keeps the cache pools.

Pool sizing: `num_blocks` if given; else on CUDA from free memory (`gpu_memory_utilization` of the device's
total, minus what is already used), on CPU from a 1 GiB budget. The state pools get `max_num_seqs` slots for
running sequences plus `num_snapshots` spare slots for prefix-cache snapshots (see block_manager).

Decode with CUDA graphs slots in at `_forward`: a pure-decode step of batch size `B` would pad to the next
captured bucket and replay; everything else (prefill, mixed steps) runs eagerly. Capture needs the model's Batch
to live in static buffers, which the model does not offer yet, so every step runs eagerly for now.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mini.engine.block_manager import SlotCopy
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


class ModelRunner:
    def __init__(self, model, config, shape: CacheShape, device, dtype, batch_cls, cache_cls, seq_chunk_cls):
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.shape = shape
        self.batch_cls = batch_cls
        self.seq_chunk_cls = seq_chunk_cls
        self.cache = cache_cls(config, n_slots=shape.n_slots, n_blocks=shape.n_blocks,
                               block_tokens=shape.block_tokens, device=device, dtype=dtype)
        self.hasher = getattr(model, "hasher", None)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Forward one step. Returns fp32 logits, one row per chunk that `samples`, in chunk order."""
        seq_chunks = [self.seq_chunk_cls(tokens=_history(c.seq, c.end), start=c.start, slot=c.seq.slot,
                                         blocks=c.seq.blocks, want_logits=c.samples) for c in chunks]
        batch = self.batch_cls.build(seq_chunks, self.config, self.device, hasher=self.hasher)
        return self._forward(batch)

    def _forward(self, batch) -> torch.Tensor:
        return self.model.forward(batch, self.cache).float()

    @torch.inference_mode()
    def copy_slots(self, copies: list[SlotCopy]) -> None:
        """Copy per-sequence state rows between slots (prefix-cache snapshot / restore)."""
        if not copies:
            return
        if hasattr(self.cache, "copy_slot"):
            for c in copies:
                self.cache.copy_slot(c.src, c.dst)
            return
        src = torch.tensor([c.src for c in copies], device=self.device)
        dst = torch.tensor([c.dst for c in copies], device=self.device)
        for pool in _slot_pools(self.cache):
            pool.index_copy_(0, dst, pool.index_select(0, src))


def _history(seq, end: int) -> list[int]:
    """The sequence's first `end` tokens (one list copy, not two)."""
    n_prompt = len(seq.prompt_token_ids)
    if end <= n_prompt:
        return seq.prompt_token_ids[:end]
    return seq.prompt_token_ids + seq.output_token_ids[:end - n_prompt]


def _slot_pools(cache) -> list[torch.Tensor]:
    """The per-slot tensors of mini.model.KVCache (window rings, compressor states): every row of dim 0 is a slot.
    Paged pools (comp_kv, index_k) are indexed by block and are not copied."""
    pools = list(cache.window)
    for states in (cache.comp_state, cache.index_state):
        for kv_and_score in states.values():
            pools += list(kv_and_score)
    return pools
