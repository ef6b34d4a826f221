"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step has a token budget (`max_num_batched_tokens`). Running decodes go first (one token each), then prefill
chunks of running sequences, then new admissions, oldest first; a prefill longer than what is left of the budget
is chunked. When a sequence needs a block and none is free, the most recently admitted running sequence is
preempted by recompute: its cache is released and it goes back to the front of the queue with its whole history
(prompt + output so far) as the new prompt.

With prefix caching on, a prefill chunk that does not finish the history ends on a block boundary, so that the
state at that boundary can be snapshotted (see block_manager), and a chunk also ends where the sequence's blocks
stop matching the prefix cache (`Sequence.split_at`). `snapshot_prompt_end` additionally splits every prompt's
last chunk at its last block boundary: one extra step before the first token, so that even a prompt's first
repeat hits.

Deterministic mode (`SchedulerConfig.chunk_tokens` > 0, EngineOptions.deterministic): a prompt's chunk boundaries
depend on the prompt alone, never on what else is queued or on the budget left in a step: chunk j covers tokens
[j·C, (j+1)·C) of the history (C = chunk_tokens), and a chunk is scheduled whole or not at all in a step (the
sequences after it wait too, oldest first). C is at most the budget less one decode token per sequence, so the
oldest prefill always fits next to the decodes: every step makes progress.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mini.engine.block_manager import BlockManager, SlotCopy
from mini.engine.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    snapshot_prompt_end: bool = False
    chunk_tokens: int = 0  # > 0: deterministic chunks of this many tokens (see the module doc)

    @staticmethod
    def deterministic_chunk(max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """The deterministic mode's chunk length: what the budget leaves beside one decode token per sequence."""
        c = max_num_batched_tokens - max_num_seqs
        if c < 1:
            raise ValueError(f"deterministic mode: --max-num-batched-tokens ({max_num_batched_tokens}) must exceed "
                             f"--max-num-seqs ({max_num_seqs}), so that a prompt chunk fits beside the decodes")
        return c


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # = seq.num_computed when scheduled
    length: int
    is_decode: bool = False
    drafts: int = 0  # a verify chunk (speculative decoding): its last `drafts` tokens are seq.draft's first

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the history: its last logits give the next token."""
        return self.end - self.drafts == self.seq.num_tokens


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk]
    restores: list[SlotCopy]  # snapshot -> slot copies to do before the forward
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self._prefilling = False
        self._span_limit = config.max_num_batched_tokens  # a longer span may go over the budget (_whole_spans)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence, release: bool = True) -> None:
        """Take a finished or aborted sequence out, running or waiting (a sequence preempted while its last token
        was in flight finishes in the queue). `release=False`: the caller returns its slot and blocks later,
        because a step still in flight on the device writes them."""
        if seq in self.running:
            self.running.remove(seq)
            if release:
                self.blocks.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # ------------------------------------------------------------------ the step plan
    def schedule(self, budget: int | None = None, prefill_cap: int | None = None) -> StepPlan:
        """The next step's chunks within `budget` tokens (None: `max_num_batched_tokens`). `prefill_cap`: the budget
        was cut to the decodes plus this many prompt tokens (EP ranks' lock step, mini.parallel.balance), a cut
        that may last: an image span longer than it is prefilled whole anyway (see _whole_spans)."""
        budget = self.config.max_num_batched_tokens if budget is None else budget
        self._prefilling = False  # a prefill chunk is planned (see _whole_spans)
        self._span_limit = self.config.max_num_batched_tokens if prefill_cap is None else \
            min(prefill_cap, self.config.max_num_batched_tokens)
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        # decodes first: they are cheap and every step without them adds to the inter-token latency
        for seq in [s for s in self.running if not s.in_prefill]:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted while making room for an earlier one
                continue
            if seq.length_capped:  # its token in flight is its last (overlapped steps): no decode after it
                continue
            k = min(len(seq.draft), budget - 1)  # speculative decoding: verify the draft in the same chunk
            if not self._make_room(seq, seq.num_tokens + k, preempted):
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed, 1 + k, is_decode=True, drafts=k))
            budget -= 1 + k
        for seq in [s for s in self.running if s.in_prefill]:
            if budget <= 0:  # (below 0 after an image span longer than the budget)
                break
            if seq.status is not Status.RUNNING:
                continue
            n = self._chunk_len(seq, budget)
            if n == 0:  # deterministic mode: its whole chunk does not fit; it and those after it wait
                break
            if not self._make_room(seq, seq.num_computed + n, preempted):
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            self._prefilling = True
        restores: list[SlotCopy] = []
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs \
                and self.blocks.has_free_slot():
            seq = self.waiting[0]
            restore = self.blocks.admit(seq)
            n = self._chunk_len(seq, budget)
            if n == 0 or not self.blocks.grow(seq, seq.num_computed + n):
                self.blocks.release(seq)  # no room now; cached blocks stay cached
                seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.num_cached_prefix = seq.num_computed
            self.blocks.stats.queries += seq.num_tokens
            self.blocks.stats.hits += seq.num_computed
            self.running.append(seq)
            if restore is not None:
                restores.append(restore)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            self._prefilling = True
        # a sequence preempted to make room for a later one may already have had a chunk planned
        chunks = [c for c in chunks if c.seq.status is Status.RUNNING]
        return StepPlan(chunks, restores, preempted)

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        c = self.config.chunk_tokens
        if c > 0:  # deterministic: the chunk up to the next multiple of c, whole or not at all (0)
            n = min(seq.num_tokens, (seq.num_computed // c + 1) * c) - seq.num_computed
            return self._whole_spans(seq, n, budget)
        n = min(seq.num_pending, budget)
        bt = self.blocks.block_tokens
        if self.blocks.prefix_caching:
            end = seq.num_computed + n
            if seq.num_computed < seq.split_at < end:
                aligned = seq.split_at
            elif end < seq.num_tokens:
                aligned = end // bt * bt  # a chunk that stops early stops on a boundary
            elif self.config.snapshot_prompt_end or seq.params.share_prompt:
                aligned = (seq.num_tokens - 1) // bt * bt  # the prompt's last full-block boundary
            else:
                aligned = end
            if aligned > seq.num_computed:
                n = aligned - seq.num_computed
        return self._whole_spans(seq, n, budget)

    def _whole_spans(self, seq: Sequence, n: int, budget: int) -> int:
        """`n` moved so that the chunk ends outside every image span (the official code prefills a span in one
        forward): back to the start of the span it would cut, or, for a chunk starting at (or, after a prefix hit,
        in) the span, on to its end. A chunk past `budget` waits (0) unless it can never fit (a span longer than
        the step budget, or than a prefill cap) and is the step's first prefill chunk: then it goes over the
        budget, beside the decodes only."""
        start = seq.num_computed
        for span in seq.images:
            if span.start < start + n < span.end:
                n = (span.start if span.start > start else span.end) - start
                break
        if n <= budget:
            return n
        return n if n > self._span_limit and not self._prefilling else 0

    def _make_room(self, seq: Sequence, upto: int, preempted: list[Sequence]) -> bool:
        """Grow `seq` to cover `upto` tokens, preempting the newest running sequences if needed.
        False if `seq` itself had to be preempted. (A lone sequence always fits: the engine caps every
        sequence's length at the cache capacity.)"""
        while not self.blocks.grow(seq, upto):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
