"""The engine↔model contract: what a step is made of, and what the engine asks of a model.

Both sides import this module and nothing else of each other: `mini/engine/` steps any `StepModel` (mini.model's
`Model`, mini.parallel's `DPModel`, the tests' fake models) and names nothing of what is inside it; the model
knows nothing of sequences, schedulers or CUDA graphs. What a model needs beyond token ids (V4.1's Engram hashes
and table rows, for one) it makes itself, from the histories the engine hands it here.

A step, as the engine runs it:

1. eager (any mix of prefill chunks and decodes): one `SeqChunk` per sequence -> `model.build_batch(chunks,
   device)` -> `model.forward(batch, cache)`;
2. static decode (every sequence one token, or a verify step: its token and a draft; CUDA graphs on the GPU):
   `model.static_decode(...)` once at start-up gives fixed device buffers (`StaticDecode`); the engine captures
   `model.forward(static.batch(n, width, span), cache)` per bucket of n sequences of `width` rows that end within
   `span` positions, and before each replay fills the buffers from the step's `DecodeRows` and, with overlapped
   steps, a `TokenFeed` (tokens still on the device); after it, `static.replayed(cache)`;
3. before every forward the engine calls `model.agree_step(n_tokens, bucket)`: a model whose forward meets other
   ranks (EP) agrees there on one bucket for all, or on an eager step; a single-process model returns `bucket`.

Every capability is declared here, with its type, and never probed (`hasattr`): a model that cannot run one kind of
step says so by a declared value (`capturable = False`), not by lacking a method.

Speculative decoding (issue 27; docs/engine.md). A verify step: a decoding sequence's chunk is its last token and
a draft (`SeqChunk.drafts` trailing tokens), logits for 1 + drafts rows; the model keeps the drafts' cache writes
aside until `StepCache.commit_drafts` gets the accepted count of each chunk. Drafts come from a `Drafter`: after
every forward it takes what each chunk committed (`Commit`) and proposes the next drafts; a model offers its own as
`StepModel.drafter` (None without a draft module), and a drafter may offer its draft step over fixed buffers for
the static steps (`Drafter.static_draft`, a `StaticDraft`: CUDA graphs of it follow each verify graph's step, and
a decode graph holds its write of the step's rows). Verify steps run static too (CUDA graphs, one per bucket of n
sequences and width r = 1 + the step's most drafts, r <= `StaticDecode.max_rows`): `static_decode(...,
max_rows=1 + K)`, `fill(n, DecodeRows(..., drafts=[row b's draft tokens]), width=r)`, a forward over
`batch(n, r)` (logits for all n·r rows: sequence b's at b·r.., those past its drafts padding), then
`replayed(cache)` before `commit_drafts`. A benchmark times a verify step of B sequences x (1 + k) rows as:
`bufs = DecodeBuffers(B, max_len, block_tokens, pad_slot, pad_block, device, max_rows=1 + k)`,
`bufs.fill(B, tokens, positions, slots, blocks, engram_rows, drafts=[[...k tokens]] * B, width=1 + k)`,
`graphs = DecodeGraphs(model, cache, StaticDecodeInputs(bufs))`, `graphs.sizes, graphs.widths = [B], [1 + k]`,
`graphs.capture_all()`, `graphs.replay(B, B, width=1 + k)` (mini.engine.cuda_graphs).

Images (issue 29). A request may carry images: each is an `ImageSpan` of the prompt, positions [start, end) that
take the image's embeddings instead of token embeddings (their ids are the model's image id; the engine reads them
as it reads any id). The engine keeps every span inside one prefill chunk, keys the prefix cache's blocks by the
digests of the spans they intersect, and hands each chunk the spans it needs (`SeqChunk.images`) and each static
decode row its sequence's spans (`DecodeRows.images`); what an image *is* (`ImageSpan.data`) only the model reads:
it encodes each image once, inside `build_batch`, and the batch carries the step's image rows to `forward`; the
engine says when no live sequence holds an image any more (`StepModel.release_images`). A model that cannot read
images says so (`StepModel.reads_images = False`); the engine then refuses requests with images.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


@dataclass(frozen=True)
class ImageSpan:
    """An image in a sequence's history: positions [start, start + length) take its embeddings. `digest` names its
    content (equal digests: equal embeddings; the prefix cache keys blocks by it); `data` is the model's own input
    (mini.model.image_input.ImageInput), which the engine never reads."""
    start: int
    length: int
    digest: str
    data: object = field(repr=False, compare=False)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class SeqChunk:
    """One sequence's part of an eager step: a prefill chunk of any length starting anywhere, or one decode token."""
    tokens: list[int]  # the whole history of the sequence up to the chunk's end
    start: int  # absolute position of the chunk's first token (= tokens already in the cache)
    slot: int  # row of the sequence in the per-sequence pools (window rings, compressor state)
    blocks: list[int]  # block ids of the paged pools covering positions 0..len(tokens)-1
    want_logits: bool = True
    # a speculative verify chunk: its last `drafts` tokens are a draft, not yet committed: logits for them and the
    # row before (1 + drafts rows), and the cache keeps them aside until `StepCache.commit_drafts`
    drafts: int = 0
    # the sequence's image spans that start before the chunk's end, in order (those its positions are in, and
    # those the model may look back over); empty for a text-only sequence
    images: list[ImageSpan] = field(default_factory=list)

    def __post_init__(self):
        if not 0 <= self.start < len(self.tokens):
            raise ValueError(f"chunk start {self.start} outside a history of {len(self.tokens)} tokens")
        if not 0 <= self.drafts < len(self.tokens) - self.start:
            raise ValueError(f"{self.drafts} drafts in a chunk of {len(self.tokens) - self.start} tokens")


@dataclass
class DecodeRows:
    """The sequences of a pure-decode step, one row each, in columns (a static step fills its buffers from them
    without making an object per row). Row b decodes the token at `positions[b]`."""
    positions: list[int]
    slots: list[int]
    blocks: list[list[int]]  # block ids covering positions 0..positions[b]
    # history(b, start, end): tokens start..end-1 of row b's sequence, as the host knows them: every token before
    # its position, and its own token unless a TokenFeed brings it (then never asked for)
    history: Callable[[int, int, int], list[int]]
    # images(b): row b's sequence's image spans (before its position: a decode row is never inside one)
    images: Callable[[int], list[ImageSpan]] = lambda b: []
    # a verify step (speculative decoding): row b's draft tokens, at positions[b] + 1..; empty: no drafts at all
    drafts: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.positions)

    @staticmethod
    def none() -> "DecodeRows":
        """No rows: a step of padding only (a capture's warm-up, a data-parallel rank without tokens)."""
        return DecodeRows([], [], [], lambda b, start, end: [])


@dataclass
class TokenFeed:
    """Decode tokens still on the device (an overlapped step's samples, see mini.engine.llm): row b of the step
    takes `ids[rows[b]]` where rows[b] >= 0. `fetch()` waits for them, appends them to the histories on the host
    (for a forward that needs them there) and returns them all (a list like `ids`)."""
    ids: torch.Tensor
    rows: list[int]
    fetch: Callable[[], list[int]]


class StaticDecode(Protocol):
    """A model's static device inputs for decode and verify steps of up to `max_seqs` sequences of up to
    `max_rows` rows each (`StepModel.static_decode`) of up to `max_len` positions. A forward over `batch(n, width,
    span)` reads only these buffers, so it can be captured once per (n, width, span) and replayed after `fill`."""
    max_seqs: int
    max_rows: int  # rows per sequence: 1 + the most drafts a verify step may hold (1: decode only)
    max_len: int  # positions a sequence may reach (the engine's max_model_len)
    device: torch.device

    def batch(self, n: int, width: int = 1, span: int | None = None) -> object:
        """A fresh batch over the first n sequences, `width` rows each (own layout: capture one per bucket), for
        steps whose sequences all end within `span` <= max_len positions (None: max_len): its per-sequence work
        follows the span, not max_len. Its forward gives logits for every row, sequence b's at rows
        b·width..b·width + width - 1."""

    def fill(self, n: int, rows: DecodeRows, feed: TokenFeed | None = None, width: int = 1) -> None:
        """Copy the step's rows (len(rows) <= n) into the buffers, the sequences past them padding (all n for
        `DecodeRows.none()`); with `width` > 1 each sequence's token and its `rows.drafts` (at most width - 1),
        padded to `width` rows. `feed`: tokens taken on the device (decode steps only); the model calls
        `feed.fetch()` only where it needs them on the host, as late as it can."""

    def replayed(self, cache: StepCache) -> None:
        """After each forward of a batch of these buffers (eager or a graph's replay): what that forward leaves on
        the host besides its logits, for the last fill's rows (a verify step's draft rows in `cache`, for
        `commit_drafts`; a drafter's inputs in the model). The engine calls it before reading the logits."""


class StepCache(Protocol):
    """The cache pools the runner keeps for the model (StepModel.new_cache)."""

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every per-sequence state row of slots `src` to slots `dst` (int64, on the cache's device)."""

    def commit_drafts(self, accepted: list[int]) -> None:
        """After a forward with draft rows (`SeqChunk.drafts`): chunk b's first accepted[b] drafts join the cache
        as if decoded one by one, the others leave no trace a later step reads (one count per chunk of that step,
        0 for a chunk without drafts)."""


@dataclass
class Commit:
    """What a step kept of one of its chunks (in chunk order), for a `Drafter`: the chunk's first `rows` rows
    (all of a prefill chunk, 1 + the accepted drafts of a verify chunk, 0 for a sequence that finished) are in the
    cache now, positions ..end-1 of slot `slot`; `anchor` is the token sampled at position `end` (None: the chunk
    did not sample), on which a draft of at most `max_draft` tokens is wanted."""
    rows: int
    length: int  # the chunk's rows in the step's forward (where its rows start in the step's row order)
    slot: int
    end: int
    anchor: int | None
    max_draft: int
    history: Callable[[], list[int]]  # the sequence's tokens 0..end (anchor included), for drafters that read them


class Drafter(Protocol):
    """Proposes draft tokens for speculative decoding (docs/engine.md): the model's own draft module
    (`StepModel.drafter`), or a test's."""
    max_draft: int  # the most tokens one draft holds
    # a draft stops before its first token whose confidence (a probability) is below this; 0: never (a drafter
    # without a confidence estimate ignores it)
    min_confidence: float

    def propose(self, cache: StepCache, commits: list[Commit]) -> list[list[int]]:
        """Called after every forward of a speculating engine, before prefix-cache snapshots are taken: take in
        what the step committed (its state for the drafter lives in `cache`'s slots) and return one draft per
        commit (empty without an anchor or `max_draft` 0)."""

    def static_draft(self, static: StaticDecode, cache: StepCache) -> StaticDraft | None:
        """The same draft step over fixed device buffers, for the steps that run over `static` (CUDA graphs), or
        None: this drafter drafts through `propose` after every step."""


class StaticDraft(Protocol):
    """A drafter's draft step after a static decode or verify step of n sequences x `width` rows
    (`Drafter.static_draft`), split so that CUDA graphs can hold its device work: `fill(n, commits)` copies what
    the host knows of the step's chunks (in the step's sequence order; sequences past them padding), `write(n,
    width)` takes in the step's committed rows (what the step's forward left in the static buffers) and
    `propose(n)` drafts for all n sequences, both with device ops only and no host sync (captured once per
    bucket, replayed after each `fill`); `drafts(commits)` reads the last `propose` back (one draft per commit,
    as `Drafter.propose` returns them). Equal to `Drafter.propose` bit for bit under the deterministic mode.
    `write_decode(n)`: what `fill` + `write(n, 1)` take in after a decode step (width 1), read from the step's
    own buffers instead (every row of a decode step is committed; padding rows go to the scratch slot): the
    engine runs it inside the decode step's own forward (its graph), never `write(n, 1)`."""

    def fill(self, n: int, commits: list[Commit]) -> None: ...

    def write(self, n: int, width: int) -> None: ...

    def write_decode(self, n: int) -> None: ...

    def propose(self, n: int) -> None: ...

    def drafts(self, commits: list[Commit]) -> list[list[int]]: ...


class StepModel(Protocol):
    """What the engine steps."""
    config: object  # vocab_size, eos_id, max_position_embeddings are what the engine reads
    # decode steps may be captured in CUDA graphs (static_decode): False when each forward exchanges token counts
    # with other ranks and nothing agrees on them first
    capturable: bool
    # the model reads images (ImageSpan.data): False for a model without a vision tower
    reads_images: bool
    # the model's own draft module for speculative decoding, None without one (V4.1 without `mtp.*`)
    drafter: Drafter | None

    def agree_step(self, n_tokens: int, bucket: int | None) -> int | None:
        """Called before every forward of `n_tokens` tokens that fits the decode graph of `bucket` (None: it needs
        an eager forward). Returns the bucket to replay (at least `bucket`) or None: run eagerly. One process:
        `bucket`; EP ranks agree on one answer for all (mini.parallel.dp.DPModel)."""

    def build_batch(self, chunks: list[SeqChunk], device) -> object:
        """The eager step's batch (whatever `forward` takes) from one chunk per sequence."""

    def release_images(self, digests: list[str]) -> None:
        """No live sequence holds these images any more (`ImageSpan.digest`; a preempted sequence is live): the model
        may drop what it keeps of them. Called as the last sequence holding one finishes or is aborted."""

    def static_decode(self, max_seqs: int, max_len: int, block_tokens: int, pad_slot: int, pad_block: int,
                      device, dtype, max_rows: int = 1) -> StaticDecode:
        """Static decode buffers for sequences of up to `max_len` tokens, `max_rows` rows each at most (1 + the
        most drafts of a verify step); padding rows write only slot `pad_slot` and block `pad_block` (spares the
        engine keeps out of the block manager's hands)."""

    def new_cache(self, n_slots: int, n_blocks: int, block_tokens: int, device, dtype) -> StepCache: ...

    def cache_bytes(self, block_tokens: int, dtype) -> tuple[int, int]:
        """(bytes per block, bytes per slot) of the cache pools."""

    def forward(self, batch, cache) -> torch.Tensor:
        """Logits [rows that want them, vocab], in chunk order; writes the step into `cache`."""
