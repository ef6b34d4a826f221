"""CUDA graphs of pure-decode steps: captured once per batch-size bucket, replayed with new inputs.

A step qualifies when every chunk is one token that samples (decode) and the sequences fit the largest bucket.
The model's static decode buffers (mini.step.StaticDecode, `StepModel.static_decode`) take the step's rows
(`DecodeRows`: positions, slots, block tables, the histories), padded to the next bucket, and that bucket's graph is
replayed; the logits of the real rows are returned. What else a row needs the model makes from the histories, in
`fill` (mini.model.static_decode).

Capture runs at start-up, largest bucket first, each after one eager warm-up forward of the same static batch
(which compiles the kernels and makes the one-time device copies); all graphs share one memory pool. Padding rows
write only into the scratch slot and block that the runner adds past the block manager's (see ModelRunner).
"""
from __future__ import annotations

import torch

from mini.engine.scheduler import ScheduledChunk
from mini.step import DecodeRows, StaticDecode, StepModel, TokenFeed


def buckets(max_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, then every 16, and max_seqs itself."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_seqs] + list(range(16, max_seqs, 16)) + [max_seqs]
    return sorted(set(sizes))


def is_decode_step(chunks: list[ScheduledChunk]) -> bool:
    return all(c.length == 1 and c.samples for c in chunks)


class DecodeGraphs:
    """One captured decode step per bucket over the model's static buffers (`static`) and `cache`."""

    def __init__(self, model: StepModel, cache, static: StaticDecode):
        self.model, self.cache, self.static = model, cache, static
        self.sizes = buckets(static.max_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) <= self.sizes[-1] and is_decode_step(chunks)

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket (CUDA only: on the CPU, replay runs the static step eagerly, which tests use)."""
        if self.static.device.type == "cuda":
            for n in reversed(self.sizes):
                self._capture(n)

    def _capture(self, n: int) -> None:
        device = self.static.device
        self.static.fill(n, DecodeRows.none())
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.model.forward(self.static.batch(n), self.cache)  # warm-up: kernels compiled, one-time copies made
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(self.static.batch(n), self.cache)  # a fresh batch: its layout is captured
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[n] = (graph, logits)

    def prepare(self, chunks: list[ScheduledChunk], history, feed: TokenFeed | None = None,
                bucket: int | None = None) -> int:
        """Copy the step's inputs into the buffers; returns the bucket (`bucket`, a larger one than the chunks need
        that EP ranks agreed on, else the smallest that holds them). `history(seq, start, end)` gives tokens
        known on the host; `feed` those of rows whose token is still on the device (taken there, on the device;
        the model fetches them only if it needs them on the host, as late as it can)."""
        n = self.bucket(len(chunks)) if bucket is None else bucket
        rows = DecodeRows([c.start for c in chunks], [c.seq.slot for c in chunks], [c.seq.blocks for c in chunks],
                          lambda b, start, end: history(chunks[b].seq, start, end), lambda b: chunks[b].seq.images)
        self.static.fill(n, rows, feed)
        return n

    def replay(self, n: int, n_real: int) -> torch.Tensor:
        """fp32 logits [n_real, vocab], a view of the graph's output: read it before the next replay."""
        if n not in self.graphs:
            return self.model.forward(self.static.batch(n), self.cache)[:n_real]
        graph, logits = self.graphs[n]
        graph.replay()
        return logits[:n_real]

    def replay_padding(self, n: int) -> None:
        """Replay bucket n with padding rows only (a data-parallel rank without tokens joins the others' step)."""
        self.static.fill(n, DecodeRows.none())
        self.replay(n, 0)
