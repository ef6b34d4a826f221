"""Runs one scheduled step on the model: builds the flat batch for all chunks at once, keeps the cache pools.

Pool sizing: `num_blocks` if given; else on CUDA from free memory (`gpu_memory_utilization` of the device's
total, minus what is already used), on CPU from a 1 GiB budget. The state pools get `max_num_seqs` slots for
running sequences plus `num_snapshots` spare slots for prefix-cache snapshots (see block_manager).

With CUDA graphs (`use_cuda_graphs`) pure-decode steps, and speculative verify steps (each sequence's token and a
draft), replay CUDA graphs captured per bucket (sequences, rows per sequence) at start-up
(mini.engine.cuda_graphs); prefill and mixed steps run eagerly. The cache then gets
one scratch slot and one scratch block past those the block manager hands out, for the padding rows to write into.
The graphs' memory pool is taken after the cache is sized, from what gpu_memory_utilization leaves. A speculating
engine's drafter follows a static step with its own draft step on graphs where it has one (`draft`); a decode
step's graph writes the step's rows into the drafter's state itself.

The model and its cache are reached only through the contract in mini.step (`StepModel`, `StepCache`,
`StaticDecode`): mini.model's Model, mini.parallel.dp.DPModel and the tests' fake models all fit it. The runner also
owns the ops backends: it resolves and logs them once at start-up (mini.ops.backends).

`timing = True` records each step's host time (input preparation, the forward call: launches or one replay) and
its GPU span (CUDA events around the forward) in `last_timing`, for the decode-host benchmark.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mini.engine.block_manager import SlotCopy
from mini.engine.cuda_graphs import DecodeGraphs
from mini.engine.sampler import to_device
from mini.engine.scheduler import ScheduledChunk
from mini.ops.backends import resolve as resolve_backends
from mini.step import Commit, Drafter, SeqChunk, StepCache, StepModel, TokenFeed


def use_cuda_graphs(model: StepModel, device, dtype: torch.dtype, enforce_eager: bool) -> bool:
    """Decode steps replay CUDA graphs on CUDA with the fast ops backend in bf16, unless enforce_eager: the
    reference ops have data-dependent shapes (the MoE's per-expert token lists), and a model that exchanges token
    counts with other ranks must agree on a bucket first (`StepModel.capturable`, `agree_step`)."""
    return (torch.device(device).type == "cuda" and resolve_backends().ops == "fast" and dtype == torch.bfloat16
            and model.capturable and not enforce_eager)


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


def size_cache(model: StepModel, device, dtype, block_tokens: int, max_num_seqs: int, num_snapshots: int,
               num_blocks: int | None, gpu_memory_utilization: float, max_model_len: int) -> CacheShape:
    """How many blocks fit. Explicit `num_blocks` wins. Otherwise the budget (CUDA: what is free beyond
    `1 - gpu_memory_utilization` of the device; CPU: 1 GiB) goes to the slots and then to blocks, up to what
    `max_num_seqs` sequences of `max_model_len` tokens can use."""
    n_slots = max_num_seqs + num_snapshots
    if num_blocks is None:
        if torch.device(device).type == "cuda":
            # blocks our own caching allocator holds but no tensor uses (the load's temporaries) count as free
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(torch.device(device))
            budget = free - (1.0 - gpu_memory_utilization) * total
        else:
            budget = CPU_CACHE_BYTES
        per_block, per_slot = model.cache_bytes(block_tokens, dtype)
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
    def __init__(self, model: StepModel, config, shape: CacheShape, device, dtype, enforce_eager: bool = False,
                 max_model_len: int | None = None, max_rows: int = 1, verify_rows: int | None = None,
                 drafter: Drafter | None = None):
        """`max_rows`: the most rows a sequence's chunk of a static step holds (1 + K under speculation: verify
        steps replay graphs of up to that width; 1: decode steps only); `verify_rows`: the most rows a verify step
        holds (the draft-length rule's budget; None: any), which bounds the verify graphs captured; `drafter`: the
        speculating engine's, whose static draft step (if any) gets graphs beside the steps'."""
        self.backends = resolve_backends()  # logged once
        cuda_graphs = use_cuda_graphs(model, device, dtype, enforce_eager)
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.shape = shape
        scratch = int(cuda_graphs)
        self.cache: StepCache = model.new_cache(shape.n_slots + scratch, shape.n_blocks + scratch, shape.block_tokens,
                                                device, dtype)
        self.timing, self.last_timing = False, None
        self.graphs = None
        self.last_static: tuple[int, int] | None = None  # the last step's graph bucket (n, width); None: eager
        if cuda_graphs:
            static = model.static_decode(shape.n_seq_slots, max_model_len or config.max_position_embeddings,
                                         shape.block_tokens, pad_slot=shape.n_slots, pad_block=shape.n_blocks,
                                         device=self.device, dtype=dtype, max_rows=max_rows)
            self.graphs = DecodeGraphs(model, self.cache, static, verify_rows, drafter)
            self.graphs.capture_all()

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], feed: TokenFeed | None = None) -> torch.Tensor:
        """Forward one step. Returns fp32 logits, one row per chunk that `samples` (1 + drafts for a verify chunk),
        in chunk order. `feed`: tokens
        still on the device; a static decode step takes them there, the eager forward fetches them first."""
        t0 = time.perf_counter()
        graph = self.graphs is not None and self.graphs.fits(chunks)
        n = self.graphs.bucket(len(chunks)) if graph else None
        width = self.graphs.width(chunks) if graph else 1  # 1 + the most drafts: a verify step's graph
        n = self.model.agree_step(sum(c.length for c in chunks), n)  # EP: every rank the same bucket (or eager)
        graph = n is not None
        self.last_static = (n, width) if graph else None
        if feed is not None and (not graph or width > 1):
            feed.fetch()
            feed = None
        if graph:
            n = self.graphs.prepare(chunks, _history, feed, bucket=n, width=width)
        else:
            seq_chunks = [SeqChunk(tokens=_history(c.seq, 0, c.end - c.drafts) + c.seq.draft[:c.drafts],
                                   start=c.start, slot=c.seq.slot, blocks=c.seq.blocks, want_logits=c.samples,
                                   drafts=c.drafts,
                                   images=[s for s in c.seq.images if s.start < c.end]) for c in chunks]
            batch = self.model.build_batch(seq_chunks, self.device)
        t1 = time.perf_counter()
        events = None
        if self.timing and self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        logits = self.graphs.replay(n, len(chunks), width) if graph else self.model.forward(batch, self.cache).float()
        if events is not None:
            events[1].record()
        if self.timing:
            self.last_timing = ForwardTiming(t1 - t0, time.perf_counter() - t1, graph, events)
        return logits

    @torch.inference_mode()
    def draft(self, drafter: Drafter, commits: list[Commit]) -> list[list[int]]:
        """`drafter`'s drafts after the last step, which committed `commits`: its static draft step on the graphs
        when that step was static and the graphs were built with this drafter's one (after a decode step without
        drafts wanted: nothing, the step's graph took its rows in), else `drafter.propose`."""
        g = self.graphs
        if self.last_static is not None and g.draft_step is not None and g.drafter is drafter:
            return g.draft(*self.last_static, commits)
        return drafter.propose(self.cache, commits)

    @torch.inference_mode()
    def copy_slots(self, copies: list[SlotCopy]) -> None:
        """Copy per-sequence state rows between slots (prefix-cache snapshot / restore)."""
        if not copies:
            return
        src = to_device(torch.tensor([c.src for c in copies]), self.device)
        dst = to_device(torch.tensor([c.dst for c in copies]), self.device)
        self.cache.copy_slots(src, dst)


def _history(seq, start: int, end: int) -> list[int]:
    """Tokens start..end-1 of the sequence's history (prompt + output), without copying the rest."""
    prompt, n_prompt = seq.prompt_token_ids, len(seq.prompt_token_ids)
    if end <= n_prompt:
        return prompt[start:end]
    if start >= n_prompt:
        return seq.output_token_ids[start - n_prompt:end - n_prompt]
    return prompt[start:] + seq.output_token_ids[:end - n_prompt]
