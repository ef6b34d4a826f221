"""One forward step as a flat batch of tokens (docs/design.md "The forward step").

Every sequence of the step contributes one chunk: a prefill chunk of any length starting anywhere, or a decode
chunk of one token. Their tokens are concatenated into T rows; the model sees `[T, ...]` tensors plus the index
tensors below and never loops over sequences.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from mini.config import ModelConfig
from mini.model.drafts import DraftRows
from mini.model.layout import DecodeLayout, StepLayout
from mini.step import SeqChunk  # the contract's type; Batch.build takes it (and mini.model exports it)


@dataclass
class EngramInput:
    """A step's Engram input (V4.1), in one of three forms, by where the hash and the tables are:
    * "ids": hash ids [T, n_engram_layers, n_hash_cols] int64, hashed on the host (Batch.build); the model looks
      the rows up where the tables are;
    * "rows": table rows [T, n_engram_layers, n_hash_cols, head_dim] looked up on the host before a CUDA-graph
      replay (static decode buffers, tables on the host);
    * "prefix": the lookback - 1 tokens before each row's token [T, lookback - 1] (-1 before the sequence's
      start); the model hashes them with input_ids and looks up on the device (Model.hash_on_device);
    * "pending": a mini.model.engram_host.PendingEngramRows, rows being looked up in host tables since the step was
      scheduled; the first Engram layer waits for them."""
    form: str  # "ids" | "rows" | "prefix" | "pending"
    data: torch.Tensor  # PendingEngramRows for "pending"

    def __post_init__(self):
        if self.form not in ("ids", "rows", "prefix", "pending"):
            raise ValueError(f"Engram input form {self.form!r}: ids, rows, prefix or pending")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute
    seq_of: torch.Tensor  # [T] int64, 0..B-1
    slots: torch.Tensor  # [B] int64
    start_pos: torch.Tensor  # [B] int64
    lens: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, nb] int32, -1 past a sequence's blocks
    logit_rows: torch.Tensor  # [n] int64
    engram: EngramInput | None  # V4.1 models; None without Engram layers
    # host copies of the per-sequence sizes, so that index tensors can be shaped without a device sync
    start_host: list[int] = field(default_factory=list)
    lens_host: list[int] = field(default_factory=list)
    n_blocks_host: list[int] = field(default_factory=list)
    drafts_host: list[int] = field(default_factory=list)  # per sequence, its chunk's trailing draft rows (verify)
    images: object | None = None  # the step's image rows (mini.model.vision.ImageRows), None without any
    # a decode step in static buffers (DecodeBuffers) sets these instead of the host copies; its layout is a
    # DecodeLayout, shaped by max_len (the span every sequence of the step ends within: DecodeBuffers.batch)
    max_len: int | None = None
    width: int = 1  # rows per sequence of a static step (1 + its most drafts: a verify step; 1: decode)
    # static steps (DecodeBuffers): keep(key, rows) copies rows a forward leaves for after it (draft rows, DSpark's
    # target features) into the buffers' own tensor, shared by every captured step; `kept_drafts`: the draft rows
    # of a verify step (width > 1), kept there
    keep: Callable[[object, torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    kept_drafts: DraftRows | None = field(default=None, repr=False)
    pad_slot: int = -1  # the scratch slot and block that padding rows write into
    pad_block: int = -1
    _layouts: dict = field(default_factory=dict, repr=False)

    @property
    def n_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n_seqs(self) -> int:
        return self.slots.shape[0]

    @classmethod
    def build(cls, chunks: list[SeqChunk], config: ModelConfig, device, hasher=None) -> "Batch":
        """Flatten the chunks. `hasher` (mini.ops.engram.EngramHasher) is needed when the model has Engram layers."""
        if not chunks:
            raise ValueError("a batch needs at least one chunk")
        if config.engram_layer_ids and hasher is None:
            raise ValueError("this model has Engram layers: Batch.build needs an EngramHasher")
        ids, pos, seq_of, logit_rows, engram = [], [], [], [], []
        n_blocks = max(len(c.blocks) for c in chunks)
        table = torch.full((len(chunks), max(n_blocks, 1)), -1, dtype=torch.int32)
        row = 0
        for b, c in enumerate(chunks):
            n = len(c.tokens) - c.start
            ids += c.tokens[c.start:]
            pos += range(c.start, len(c.tokens))
            seq_of += [b] * n
            table[b, : len(c.blocks)] = torch.tensor(c.blocks, dtype=torch.int32)
            row += n
            if c.want_logits:  # a verify chunk's last committed row and its drafts: 1 + drafts rows
                logit_rows += range(row - 1 - c.drafts, row)
            if hasher is not None:
                engram.append(hasher.hash_ids(c.tokens, c.start, len(c.tokens)))

        def t(v, dtype=torch.int64):
            return torch.tensor(v, dtype=dtype, device=device)

        return cls(
            input_ids=t(ids), positions=t(pos), seq_of=t(seq_of), slots=t([c.slot for c in chunks]),
            start_pos=t([c.start for c in chunks]), lens=t([len(c.tokens) - c.start for c in chunks]),
            block_table=table.to(device), logit_rows=t(logit_rows),
            engram=EngramInput("ids", torch.cat(engram).to(device)) if engram else None,
            start_host=[c.start for c in chunks], lens_host=[len(c.tokens) - c.start for c in chunks],
            n_blocks_host=[len(c.blocks) for c in chunks],
            drafts_host=[c.drafts for c in chunks] if any(c.drafts for c in chunks) else [])

    def layout(self, block_tokens: int, window: int) -> StepLayout:
        """The step's index tensors for a cache with `block_tokens` positions per block (built once per batch)."""
        key = (block_tokens, window)
        if key not in self._layouts:
            self._layouts[key] = (StepLayout if self.max_len is None else DecodeLayout)(self, block_tokens, window)
        return self._layouts[key]


class DecodeBuffers:
    """Static device buffers of decode steps of up to `max_seqs` sequences, for CUDA graphs: a captured step reads
    its inputs from these addresses, so each step copies its values in (`fill`) and replays. `batch(n)` views the
    first n rows as a Batch whose layout is a DecodeLayout. Rows past the step's sequences are padding: token 0 at
    position 0 in the scratch slot, every block the scratch block.

    Verify steps (speculative decoding, mini.model.drafts): with `max_rows` > 1 a step may give each sequence
    `width` rows, its token and up to width - 1 draft tokens (`batch(n, width)`, `fill(drafts=, width=)`): row
    b·width + i is sequence b's row i, at position p_b + i. A sequence with fewer drafts is padded with rows of
    token 0 at the following positions; they come after every real row of the sequence (no real query reads them)
    and write only the scratch slot and block (DecodeLayout). The buffers keep each sequence's real row count.

    `fill` writes into pinned host mirrors and copies them over without waiting (on CUDA); a mirror is written again
    only once the previous copies are done (an event), which a decode step's sampling sync has long made true.

    An overlapped decode step (mini.engine.llm) feeds tokens that are still on the device: `fill(feed=(ids, rows))`
    takes row b's token from `ids[rows[b]]` (the previous step's sampled ids) where rows[b] >= 0, on the device.

    Engram (V4.1), one of two ways: `engram_shape` (tables on the host): a buffer of table rows looked up on the
    host, `fill(engram_rows=)`; `engram_lookback` (tables on the device): the lookback - 1 tokens before each row's
    token ride in extra rows of the ids buffer (`fill(engram_prefix=)`), and the model hashes them together with
    the row's token, fed or not, on the device (EngramInput "prefix"): nothing waits for a fed token."""

    def __init__(self, max_seqs: int, max_len: int, block_tokens: int, pad_slot: int, pad_block: int, device,
                 engram_shape: tuple[int, int, int] | None = None, engram_dtype=torch.bfloat16,
                 engram_lookback: int = 0, max_rows: int = 1):
        if engram_shape is not None and engram_lookback:
            raise ValueError("Engram rows come from the host (engram_shape) or are hashed on the device "
                             "(engram_lookback), not both")
        if max_rows < 1:
            raise ValueError(f"max_rows {max_rows}: a sequence takes at least one row")
        self.max_seqs, self.max_len, self.block_tokens = max_seqs, max_len, block_tokens
        self.max_rows = max_rows
        self.pad_slot, self.pad_block = pad_slot, pad_block
        self.n_table_blocks = -(-max_len // block_tokens)
        device = torch.device(device)
        pin = device.type == "cuda"
        n_rows = max_seqs * max_rows

        def mirrored(host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            host = host.pin_memory() if pin else host
            return host, host.to(device, copy=True)

        # token, position, slot of each row, the row of a fed token (-1: none), then (engram_lookback) the tokens
        # before the row's token, oldest first (-1: none); the block table; the Engram rows (engram_shape); per
        # sequence of a verify step: slot, first position, real rows
        self.n_prefix = max(engram_lookback - 1, 0)
        self.host_ids, self.ids = mirrored(torch.tensor([[0], [0], [pad_slot]] + [[-1]] * (1 + self.n_prefix))
                                           .repeat(1, n_rows))
        self.host_table, self.block_table = mirrored(
            torch.full((max_seqs, self.n_table_blocks), pad_block, dtype=torch.int32))
        self.host_seqs, self.seqs = mirrored(torch.tensor([[pad_slot], [0], [1]]).repeat(1, max_seqs))
        self.host_engram = self.engram_rows = None
        if engram_shape is not None:
            self.host_engram, self.engram_rows = mirrored(torch.zeros(n_rows, *engram_shape, dtype=engram_dtype))
        self.copied = torch.cuda.Event() if pin else None
        self.rows = torch.arange(n_rows, device=device)
        self.ones = torch.ones(max_seqs, dtype=torch.int64, device=device)
        # row -> sequence of a step of each width (width 1: `rows`)
        self.seq_of = {w: torch.arange(n_rows, device=device) // w for w in range(2, max_rows + 1)}
        self.filled: tuple[int, list[int], list[int], list[int]] = (1, [], [], [])  # width, drafts, slots, positions
        # what forwards over these buffers leave for after them (`keep`), one tensor per key for every bucket
        self.kept: dict[object, torch.Tensor] = {}
        self.kept_drafts = DraftRows(0, [], [], [], [], [], store=self.keep)

    def batch(self, n: int, width: int = 1, span: int | None = None) -> Batch:
        """A new Batch (own layout cache) over the first n sequences, `width` rows each (1: a decode step), whose
        index tensors span `span` <= max_len positions a sequence (None: max_len): a step whose sequences all end
        within it reads the same groups at a fraction of the work (DecodeLayout's N = span // ratio)."""
        if not 1 <= width <= self.max_rows:
            raise ValueError(f"{width} rows per sequence: these buffers take 1 to {self.max_rows}")
        span = self.max_len if span is None else span
        if not 0 < span <= self.max_len:
            raise ValueError(f"span {span}: these buffers span 1 to {self.max_len} positions")
        t = n * width
        ids, pos = self.ids[0, :t], self.ids[1, :t]
        engram = None
        if self.engram_rows is not None:
            engram = EngramInput("rows", self.engram_rows[:t])
        elif self.n_prefix:
            engram = EngramInput("prefix", self.ids[4:, :t].T)
        if width == 1:
            return Batch(input_ids=ids, positions=pos, seq_of=self.rows[:n], slots=self.ids[2, :n], start_pos=pos,
                         lens=self.ones[:n], block_table=self.block_table[:n], logit_rows=self.rows[:n],
                         engram=engram, max_len=span, pad_slot=self.pad_slot, pad_block=self.pad_block,
                         keep=self.keep)
        return Batch(input_ids=ids, positions=pos, seq_of=self.seq_of[width][:t], slots=self.seqs[0, :n],
                     start_pos=self.seqs[1, :n], lens=self.seqs[2, :n], block_table=self.block_table[:n],
                     logit_rows=self.rows[:t], engram=engram, max_len=span, pad_slot=self.pad_slot,
                     pad_block=self.pad_block, width=width, keep=self.keep, kept_drafts=self.kept_drafts)

    def keep(self, key, rows: torch.Tensor) -> torch.Tensor:
        """Copy `rows` [T, ...] (a forward's, T <= max_seqs · max_rows) into this key's tensor and return that
        tensor (all of it: row t is rows[t]). Made on the key's first forward (before any capture: its eager
        warm-up), then the same for every bucket: a captured step copies into it, so the graphs hold no such rows
        of their own (at V4.1-Flash width ~100 KB per row of every bucket otherwise)."""
        kept = self.kept.get(key)
        if kept is None or kept.shape[1:] != rows.shape[1:] or kept.dtype != rows.dtype:
            kept = self.kept[key] = torch.empty((self.rows.shape[0], *rows.shape[1:]), dtype=rows.dtype,
                                                device=rows.device)
        kept[:rows.shape[0]].copy_(rows)
        return kept

    def fill(self, n: int, tokens: list[int], positions: list[int], slots: list[int], blocks: list[list[int]],
             engram_rows: torch.Tensor | Callable[[], torch.Tensor] | None = None,
             feed: tuple[torch.Tensor, list[int]] | None = None, engram_prefix=None,
             drafts: list[list[int]] | None = None, width: int = 1) -> None:
        """Copy a step of len(tokens) <= n sequences into the buffers; sequences up to n are padded (all of them
        when there are none: what a capture's warm-up runs). `width`: rows per sequence, `drafts` each sequence's
        draft tokens (at most width - 1; None: none), the rows after its draft padding. Row-level inputs are in row
        order, `width` rows per sequence: `engram_rows` [k·width, ...] may be on the host, or be a function giving
        them, called once the other inputs are on their way (it may wait for `feed`'s tokens); `engram_prefix`
        [k·width, lookback - 1] int (engram_lookback buffers): the tokens before each row's token, oldest first, -1
        before its start. `feed` (device ids, one source row per sequence or -1): tokens taken on the device,
        replacing `tokens` (decode steps only: a draft's rows need their sequence's token on the host)."""
        k = len(tokens)
        drafts = drafts if drafts is not None else [[]] * k
        counts = [len(d) for d in drafts]
        if not 1 <= width <= self.max_rows:
            raise ValueError(f"{width} rows per sequence: these buffers take 1 to {self.max_rows}")
        if len(drafts) != k or any(c >= width for c in counts):
            raise ValueError(f"drafts of {counts} tokens for {k} sequences of {width} rows (at most {width - 1})")
        if feed is not None and len(feed[1]) != k:
            raise ValueError(f"feed has {len(feed[1])} source rows for {k} sequences")
        if feed is not None and width > 1:
            raise ValueError("a verify step's tokens come from the host: no feed")
        if not 0 <= k <= n <= self.max_seqs or n == 0:
            raise ValueError(f"{k} sequences in a bucket of {n} (buffers hold {self.max_seqs})")
        rows, t = k * width, n * width
        if self.engram_rows is not None and k and engram_rows is None:
            raise ValueError("this model has Engram layers: fill needs the looked-up rows")
        if self.n_prefix and k and (engram_prefix is None or np.shape(engram_prefix) != (rows, self.n_prefix)):
            raise ValueError(f"these buffers hash Engram ids on the device: fill needs the {self.n_prefix} tokens "
                             f"before each of the {rows} rows' tokens")
        for b, (p, blk, c) in enumerate(zip(positions, blocks, counts)):
            if not p + c < len(blk) * self.block_tokens or p + c >= self.max_len:
                raise ValueError(f"position {p + c} is past the sequence's {len(blk)} blocks or max_len "
                                 f"{self.max_len}")
        if self.copied is not None:
            self.copied.synchronize()  # the mirrors' previous contents have reached the device
        host, table = self.host_ids.numpy(), self.host_table.numpy()
        if width == 1:
            host[0, :k], host[1, :k], host[2, :k] = tokens, positions, slots
            host[3, :k] = -1 if feed is None else feed[1]
        else:
            step = np.arange(width)
            row_tokens = np.zeros((k, width), dtype=np.int64)
            for b, (tok, d) in enumerate(zip(tokens, drafts)):
                row_tokens[b, :1 + len(d)] = [tok, *d]
            host[0, :rows] = row_tokens.reshape(-1)
            host[1, :rows] = (np.asarray(positions, dtype=np.int64)[:, None] + step).reshape(-1)
            host[2, :rows] = np.repeat(np.asarray(slots, dtype=np.int64), width)
            host[3, :rows] = -1
            seqs = self.host_seqs.numpy()
            seqs[0, :k], seqs[1, :k], seqs[2, :k] = slots, positions, [1 + c for c in counts]
            seqs[0, k:n], seqs[1, k:n], seqs[2, k:n] = self.pad_slot, 0, 1
        host[0, rows:t], host[2, rows:t], host[3:, rows:t] = 0, self.pad_slot, -1
        host[1, rows:t] = np.tile(np.arange(width), n - k)  # padding sequences: positions 0..width-1
        if self.n_prefix and k:
            host[4:, :rows] = np.asarray(engram_prefix).T
        table[:n] = self.pad_block
        for b, blk in enumerate(blocks):
            table[b, :len(blk)] = blk
        self.ids[:, :t].copy_(self.host_ids[:, :t], non_blocking=True)
        self.block_table[:n].copy_(self.host_table[:n], non_blocking=True)
        if width > 1:
            self.seqs[:, :n].copy_(self.host_seqs[:, :n], non_blocking=True)
        if feed is not None and k:  # stream-ordered after the step that samples feed[0]: no host sync
            src = self.ids[3, :k]
            fed = feed[0].index_select(0, src.clamp(min=0)).to(self.ids.dtype)
            self.ids[0, :k] = torch.where(src >= 0, fed, self.ids[0, :k])
        if self.engram_rows is not None and k:
            self.host_engram[:rows].copy_(engram_rows() if callable(engram_rows) else engram_rows)
            self.engram_rows[:rows].copy_(self.host_engram[:rows], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.filled = (width, counts, list(slots), list(positions))

    def real_rows(self) -> list[int]:
        """The rows of the last fill's sequences that are theirs (not padding), in row order: each sequence's token
        and its drafts."""
        width, counts, _, _ = self.filled
        return [b * width + i for b, c in enumerate(counts) for i in range(1 + c)]

    def draft_rows(self) -> DraftRows | None:
        """The draft rows of the last fill (None without drafts), in the tensors verify steps keep them in
        (`kept_drafts`, filled by the forward that ran or was replayed)."""
        width, counts, slots, positions = self.filled
        has = [b for b, c in enumerate(counts) if c]
        if not has:
            return None
        return self.kept_drafts.placed(len(counts), has, [b * width + 1 for b in has], [positions[b] + 1 for b in has],
                           [counts[b] for b in has], [slots[b] for b in has])
