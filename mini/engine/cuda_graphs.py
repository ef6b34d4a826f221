"""CUDA graphs of decode and verify steps: captured once per bucket, replayed with new inputs.

A step qualifies when every chunk samples and is its sequence's next token plus, in a speculative verify step, a
draft (`ScheduledChunk.drafts` trailing tokens), the sequences fit the largest bucket and the longest chunk the
widest graph. A bucket is (n sequences, width rows each): n from `buckets(max_seqs)`, width from 1 (decode) to the
model's `StaticDecode.max_rows` (1 + K for `--spec-tokens K`; 1 without speculation). The model's static buffers
(mini.step.StaticDecode, `StepModel.static_decode`) take the step's rows (`DecodeRows`: positions, slots, block
tables, the histories, the drafts), padded to the bucket's n sequences and each sequence to its width, and that
bucket's graph is replayed; the logits of the real rows are returned, in chunk order (1 + drafts per chunk). What
else a row needs the model makes from the histories, in `fill` (mini.model.static_decode); what the forward leaves
for after it (a verify step's draft rows, for `commit_drafts`) it hands over in `replayed`.

Each bucket is captured once per span (`spans`): a step replays the graph of the shortest span its sequences end
within (`StaticDecode.batch(n, width, span)`), since the model's per-sequence work over positions in a static step
follows the span it is built for, not the sequences' length: at V4.1-Flash width, one emulated EP8 rank on an
H100, a B = 64 step at 4K context took 25.2 ms with buffers spanning its 4K, 30.1 with 128K and 61.1 with 1M; one
graph per span took it from 61.9 to 26.0 ms at a 1M max_model_len (docs/perf/041). Decode graphs of one n share
the first-captured one's logits (the others copy into it), so spans add no logits memory.

Capture runs at start-up, the largest bucket (rows) first, each after one eager warm-up forward of the same static
batch (which compiles the kernels and makes the one-time device copies); all graphs share one memory pool. Verify
widths per bucket stop where the engine's verify-row budget (`spec_max_rows`, speculative.py's draft-length rule)
leaves the fewest sequences of the bucket no longer draft (`bucket_widths`: with 384 rows and K = 5, 55 verify
graphs at 256 sequences instead of 100, the widest 80 x 5); a step outside them runs eagerly. Verify graphs copy
their logits into one output that all of them share (the largest verify bucket's rows x vocab, fp32), and the
model keeps their draft rows in tensors of its buffers' own, so K + 1 widths add no rows per graph beyond the pool
(the largest step's working memory). Padding rows write only into the scratch slot and block that the runner adds
past the block manager's (see ModelRunner).

A drafter with a draft step over fixed buffers (mini.step.StaticDraft, `Drafter.static_draft`: DSpark's) gets
graphs of it in the same pool, captured after the steps' graphs: its write of a verify step's committed rows per
bucket (n, width > 1) the step graphs have, its draft per n whose bucket has a verify width (the load rule's bound:
past it no sequence drafts); `draft` replays them after a step's acceptance (eagerly where a graph is missing, and
on the CPU). The draft is skipped where no sequence wants one. A decode step (width 1) commits every row, so its
write needs no acceptance: it is part of the decode step's own forward (`_forward`, so its graph), and a step after
which nobody drafts (speculation's plain step) is one replay with no host fill. Without a drafter the decode graphs
hold the forward alone.
"""
from __future__ import annotations

import torch

from mini.engine.scheduler import ScheduledChunk
from mini.step import Commit, DecodeRows, Drafter, StaticDecode, StepModel, TokenFeed


def buckets(max_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, then every 16, and max_seqs itself."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_seqs] + list(range(16, max_seqs, 16)) + [max_seqs]
    return sorted(set(sizes))


SPAN_BASE, SPAN_GROWTH = 4096, 4  # the shortest span, and each next one's factor


def spans(max_len: int) -> list[int]:
    """Sequence spans that get graphs: 4,096, 16,384, 65,536, ... below max_len, then max_len (at V4.1's 1M, five).
    A step's span is at most 4x its longest sequence (or 4,096), so its per-span work stays near the context's."""
    out, span = [], SPAN_BASE
    while span < max_len:
        out.append(span)
        span *= SPAN_GROWTH
    return out + [max_len]


def out_of_memory_hint(n: int, width: int, span: int) -> str:
    """What to change when a graph's capture runs out of memory: its working memory is not in the cache's budget,
    and the longest span's, widest buckets need the most (docs/perf/042: a 1M span's verify graphs)."""
    return (f"capturing the static step of {n} sequences x {width} rows over {span} positions ran out of GPU memory "
            "(the graphs' working memory is not in the cache's budget; the longest span's widest steps need the "
            "most): lower --max-model-len, --spec-max-rows (verify steps), --max-num-seqs or "
            "--gpu-memory-utilization, or run with --enforce-eager")


def is_decode_step(chunks: list[ScheduledChunk]) -> bool:
    return all(c.length == 1 and c.samples for c in chunks)


def is_verify_step(chunks: list[ScheduledChunk]) -> bool:
    """Every chunk its sequence's next token and a draft (none: a decode chunk), sampling."""
    return all(c.length == 1 + c.drafts and c.samples for c in chunks)


class DecodeGraphs:
    """One captured decode or verify step per bucket (n, width) and span over the model's static buffers
    (`static`) and `cache`. `sizes`, `widths` and `spans` are the buckets' n, widths and spans (a benchmark may
    narrow them before capture)."""

    def __init__(self, model: StepModel, cache, static: StaticDecode, verify_rows: int | None = None,
                 drafter: Drafter | None = None):
        """`verify_rows`: the most rows a verify step holds (the engine's `spec_max_rows`, its draft-length rule's
        budget; None: any): bucket n gets only the widths a step of the fewest sequences it takes can reach.
        `drafter`: the engine's (None: none), whose static draft step, if it has one, gets graphs too."""
        self.model, self.cache, self.static, self.verify_rows = model, cache, static, verify_rows
        self.drafter = drafter
        self.draft_step = drafter.static_draft(static, cache) if drafter is not None else None
        self.write_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # its write after a verify, (n, width)
        self.propose_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # its draft, by n
        # static draft steps run (replayed, or eagerly: the CPU, a bucket without a graph); not a decode step's
        # write, which its own forward makes
        self.draft_steps = 0
        self.draft_replays = 0  # replays of the draft step's graphs (write and draft each count)
        self.sizes = buckets(static.max_seqs)
        self.widths = list(range(1, static.max_rows + 1))
        self.spans = spans(static.max_len)
        # decode steps (width 1) by (n, span), verify steps by (n, width, span)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.decode_logits: dict[int, torch.Tensor] = {}  # by n: the output every decode graph of n writes
        self.span: int | None = None  # the last prepared step's span
        self.pool = None
        self.verify_logits: torch.Tensor | None = None  # every verify graph's logits (rows of its step first)
        self.real_rows: torch.Tensor | None = None  # the last prepared verify step's real rows (device)

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) <= self.sizes[-1] and is_verify_step(chunks) and self.width(chunks) is not None

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def bucket_widths(self, n: int) -> list[int]:
        """The widths bucket n is captured at: 1 (decode), and the verify widths up to what `verify_rows` leaves
        each of the fewest sequences the bucket takes (one more than the bucket below)."""
        fewest = max((s for s in self.sizes if s < n), default=0) + 1
        top = self.widths[-1] if self.verify_rows is None else max(1, self.verify_rows // fewest)
        return [w for w in self.widths if w <= top or w == 1]

    def span_for(self, end: int) -> int:
        """The shortest span that holds sequences ending at position `end` (exclusive)."""
        return next((s for s in self.spans if s >= end), self.spans[-1])

    def width(self, chunks: list[ScheduledChunk]) -> int | None:
        """The width of the graph a verify step replays: the narrowest of its bucket's that holds its longest
        chunk (None: none does; the step runs eagerly)."""
        rows = max((c.length for c in chunks), default=1)
        return next((w for w in self.bucket_widths(self.bucket(max(len(chunks), 1))) if w >= rows), None)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket (CUDA only: on the CPU, replay runs the static step eagerly, which tests use)."""
        if self.static.device.type == "cuda":
            steps = sorted(((n, w) for n in self.sizes for w in self.bucket_widths(n)),
                           key=lambda b: (b[0] * b[1], b[1]), reverse=True)
            for n, width in steps:
                for span in sorted(self.spans, reverse=True):
                    try:
                        self._capture(n, width, span)
                    except torch.OutOfMemoryError as e:
                        raise torch.OutOfMemoryError(out_of_memory_hint(n, width, span)) from e
            if self.draft_step is not None:  # after the steps' graphs: it reads the features their forwards keep
                for n, width in ((n, w) for n, w in steps if w > 1):  # (a decode graph writes its own rows)
                    self.write_graphs[(n, width)] = self._capture_draft(n, lambda: self.draft_step.write(n, width))
                for n in sorted((n for n in self.sizes if self.bucket_widths(n)[-1] > 1), reverse=True):
                    self.propose_graphs[n] = self._capture_draft(n, lambda: self.draft_step.propose(n))

    def _capture(self, n: int, width: int, span: int) -> None:
        device = self.static.device
        self.static.fill(n, DecodeRows.none(), width=width)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # warm-up: kernels compiled, one-time copies made (the model's kept-row tensors among them)
            warm = self._forward(n, width, span)
            if width > 1 and self.verify_logits is None:  # (the first verify bucket captured is the largest)
                self.verify_logits = torch.empty(n * width, warm.shape[-1], dtype=warm.dtype, device=device)
        torch.cuda.current_stream(device).wait_stream(stream)
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(n, width, span)  # a fresh batch: layout captured
            if width > 1:  # into the output every verify graph shares (its own is pool memory, freed after)
                logits = self.verify_logits[:n * width].copy_(logits)
            elif n in self.decode_logits:  # into the first decode graph of n's output
                logits = self.decode_logits[n].copy_(logits)
        if self.pool is None:
            self.pool = graph.pool()
        if width == 1:
            self.graphs[(n, span)] = (graph, self.decode_logits.setdefault(n, logits))
        else:
            self.verify_graphs[(n, width, span)] = (graph, logits)

    def _forward(self, n: int, width: int, span: int | None = None) -> torch.Tensor:
        """The step of bucket (n, width) over the static buffers, as captured (and run where no graph is). With a
        drafter's static step, a decode step (width 1) also writes its rows into the drafter's state: every row
        of a decode step is committed, so that write waits for no acceptance, and a step after which nobody
        drafts then needs no draft step at all (`draft`)."""
        logits = self.model.forward(self.static.batch(n, width, span), self.cache)
        if width == 1 and self.draft_step is not None:
            self.draft_step.write_decode(n)
        return logits

    def _capture_draft(self, n: int, run) -> torch.cuda.CUDAGraph:
        """A graph of the draft step's `run` over n padding sequences (they write only the scratch slot), after an
        eager warm-up; into the steps' pool."""
        device = self.static.device
        self.draft_step.fill(n, [])
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        return graph

    def draft(self, n: int, width: int, commits: list[Commit]) -> list[list[int]]:
        """The drafter's drafts after a static step of bucket (n, width) whose chunks committed `commits` (in its
        sequence order): the draft step's graphs replayed (run eagerly where none was captured). A decode step's
        rows are in the drafter's state already (`_forward`)."""
        step = self.draft_step
        wanted = any(c.anchor is not None and c.max_draft > 0 for c in commits)
        if width == 1 and not wanted:
            return [[] for _ in commits]  # (a plain step, or past the load rule's budget: nothing to run)
        self.draft_steps += 1
        step.fill(n, commits)
        if width > 1:  # a verify step's accepted rows: known only now
            self._replay_draft(self.write_graphs.get((n, width)), lambda: step.write(n, width))
        if not wanted:
            return [[] for _ in commits]
        self._replay_draft(self.propose_graphs.get(n), lambda: step.propose(n))
        return step.drafts(commits)

    def _replay_draft(self, graph: torch.cuda.CUDAGraph | None, run) -> None:
        if graph is None:
            run()
        else:
            graph.replay()
            self.draft_replays += 1

    def prepare(self, chunks: list[ScheduledChunk], history, feed: TokenFeed | None = None,
                bucket: int | None = None, width: int = 1) -> int:
        """Copy the step's inputs into the buffers; returns the bucket (`bucket`, a larger one than the chunks need
        that EP ranks agreed on, else the smallest that holds them) and keeps the span its sequences end within
        (`replay` takes it). `width`: the rows per sequence (`self.width(chunks)` for a verify step).
        `history(seq, start, end)` gives tokens known on the host; `feed` those of rows whose token is still on the
        device (taken there, on the device; the model fetches them only if it needs them on the host, as late as it
        can)."""
        n = self.bucket(len(chunks)) if bucket is None else bucket
        drafts = [c.seq.draft[:c.drafts] for c in chunks] if width > 1 else []
        rows = DecodeRows([c.start for c in chunks], [c.seq.slot for c in chunks], [c.seq.blocks for c in chunks],
                          lambda b, start, end: history(chunks[b].seq, start, end), lambda b: chunks[b].seq.images,
                          drafts)
        self.static.fill(n, rows, feed, width)
        self.span = self.span_for(max((c.start + c.length for c in chunks), default=1))
        if width > 1:
            real = [b * width + i for b, c in enumerate(chunks) for i in range(1 + c.drafts)]
            self.real_rows = torch.tensor(real, device=self.static.device)
        return n

    def replay(self, n: int, n_real: int, width: int = 1, span: int | None = None) -> torch.Tensor:
        """fp32 logits of the real rows, a view of the graph's output (width 1: [n_real, vocab]; a verify step:
        the rows `prepare` marked, 1 + drafts per chunk in chunk order, or every row of the first n_real
        sequences when it was filled otherwise): read it before the next replay. `span`: the graph's (None: the
        one `prepare` kept, else the longest)."""
        span = span or self.span or self.spans[-1]
        self.span = None
        captured = self.graphs.get((n, span)) if width == 1 else self.verify_graphs.get((n, width, span))
        if captured is None:
            logits = self._forward(n, width, span)
        else:
            graph, logits = captured
            graph.replay()
        self.static.replayed(self.cache)
        if width == 1:
            return logits[:n_real]
        rows, self.real_rows = self.real_rows, None
        return logits[:n_real * width] if rows is None else logits.index_select(0, rows)

    def replay_padding(self, n: int) -> None:
        """Replay bucket n with padding rows only (a data-parallel rank without tokens joins the others' step)."""
        self.static.fill(n, DecodeRows.none())
        self.replay(n, 0, span=self.spans[0])
