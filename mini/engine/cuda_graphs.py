"""CUDA graphs of pure-decode steps: captured once per batch-size bucket, replayed with new inputs.

A step qualifies when every chunk is one token that samples (decode) and the sequences fit the largest bucket.
Their last tokens, positions, slots and block tables are copied into mini.model.DecodeBuffers, padded to the next
bucket, and that bucket's graph is replayed; the logits of the real rows are returned. The forward inside the
graph builds a DecodeLayout: fixed shapes, no host sync. Engram (V4.1): with the tables on the device
(Model.engram_on_device) the tokens before each decode token are copied too and the graph hashes and looks up on
the device; with the tables on the host the rows are hashed and looked up on the host, before the replay.

Capture runs at start-up, largest bucket first, each after one eager warm-up forward of the same static batch
(which compiles the kernels and makes the one-time device copies); all graphs share one memory pool. Padding rows
write only into the scratch slot and block that the runner adds past the block manager's (see ModelRunner).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from mini.engine.scheduler import ScheduledChunk


def buckets(max_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, then every 16, and max_seqs itself."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_seqs] + list(range(16, max_seqs, 16)) + [max_seqs]
    return sorted(set(sizes))


def is_decode_step(chunks: list[ScheduledChunk]) -> bool:
    return all(c.length == 1 and c.samples for c in chunks)


@dataclass
class TokenFeed:
    """Decode tokens still on the device (an overlapped step's samples, see mini.engine.llm): row b of the step
    takes `ids[rows[b]]` where rows[b] >= 0. `fetch()` waits for them, appends them to the histories on the host
    (for a forward that needs them there: eager, or Engram hashing on the host) and returns them all (a list like
    `ids`)."""
    ids: torch.Tensor
    rows: list[int]
    fetch: Callable[[], list[int]]


class DecodeGraphs:
    """One captured decode step per bucket over shared static buffers (`buffers`, a DecodeBuffers) and `cache`."""

    def __init__(self, model, cache, buffers, hasher=None):
        self.model, self.cache, self.buffers, self.hasher = model, cache, buffers, hasher
        self.sizes = buckets(buffers.max_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) <= self.sizes[-1] and is_decode_step(chunks)

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket (CUDA only: on the CPU, replay runs the static step eagerly, which tests use)."""
        if self.buffers.ids.is_cuda:
            for n in reversed(self.sizes):
                self._capture(n)

    def _capture(self, n: int) -> None:
        device = self.buffers.ids.device
        self.buffers.fill(n, [], [], [], [])
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.model.forward(self.buffers.batch(n), self.cache)  # warm-up: kernels compiled, one-time copies made
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(self.buffers.batch(n), self.cache)  # a fresh Batch: its layout is captured
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[n] = (graph, logits)

    def prepare(self, chunks: list[ScheduledChunk], history, feed: TokenFeed | None = None,
                bucket: int | None = None) -> int:
        """Copy the step's inputs into the buffers; returns the bucket (`bucket`, a larger one than the chunks need
        that EP ranks agreed on, else the smallest that holds them). `history(seq, start, end)` gives tokens
        known on the host; `feed` those of rows whose token is still on the device (copied there, on the device).
        Engram: the tokens before each decode token are known on the host (even when the decode token is fed).
        With the tables on the device they go to the buffers and nothing waits for `feed`. Otherwise the rows are
        hashed from the last tokens on the host: with a feed, its tokens are fetched only after everything else
        is copied, so that the wait for the previous step is as late as it can be."""
        n = self.bucket(len(chunks)) if bucket is None else bucket
        fed = np.array(feed.rows if feed is not None else [-1] * len(chunks), dtype=np.int64)
        tokens = [0 if r >= 0 else history(c.seq, c.start, c.end)[0] for c, r in zip(chunks, fed.tolist())]
        rows = prefix = None
        if self.hasher is not None:  # the last `lookback` tokens of each sequence, its decode token last
            k = self.hasher.lookback
            tails = np.full((len(chunks), k), -1, dtype=np.int64)  # -1: before the sequence's start
            for b, c in enumerate(chunks):  # the tokens before the decode token
                tail = history(c.seq, max(0, c.end - k), c.end - 1)
                tails[b, k - 1 - len(tail):k - 1] = tail
            tails[:, -1] = tokens
            if self.buffers.n_prefix:  # tables on the device: hashed there, with the token the buffers hold
                prefix = tails[:, :-1]
            else:
                def rows() -> torch.Tensor:  # tables on the host
                    if feed is not None:  # only now wait for the fed tokens: every other input is on its way
                        fed_rows = fed >= 0
                        tails[fed_rows, -1] = np.asarray(feed.fetch(), dtype=np.int64)[fed[fed_rows]]
                    return self.model.engram_rows(self.hasher.hash_last(tails))
        self.buffers.fill(n, tokens, [c.start for c in chunks], [c.seq.slot for c in chunks],
                          [c.seq.blocks for c in chunks], rows,
                          None if feed is None else (feed.ids, feed.rows), engram_prefix=prefix)
        return n

    def replay(self, n: int, n_real: int) -> torch.Tensor:
        """fp32 logits [n_real, vocab], a view of the graph's output: read it before the next replay."""
        if n not in self.graphs:
            return self.model.forward(self.buffers.batch(n), self.cache)[:n_real]
        graph, logits = self.graphs[n]
        graph.replay()
        return logits[:n_real]
