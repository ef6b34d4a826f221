"""Index tensors of one step, derived from a Batch with vectorised torch ops (no loop over sequences).

Where each key lives (docs/design.md "Cache pools"):
* the window of a query at position p is positions p-W+1..p: chunk rows or ring rows `slot*W + pos % W`
  (mini.ops.attention resolves them); the chunk's last W positions are written to the ring;
* compressed group j (ratio r) of a sequence is pool row `block_table[j // rows_per_block] * rows_per_block +
  j % rows_per_block`, rows_per_block = block_tokens // r;
* a compressor's partial groups live in state row `slot * state_rows + pos % state_rows`.

StepLayout shapes some tensors from host copies of the sequence sizes (any step). DecodeLayout builds the same
tensors for a pure-decode step from static buffers with fixed shapes and device ops only (CUDA graphs).

A layout reads its batch through `LayoutInput`, the fields it needs, so that this module does not import the batch
(mini.model.batch imports this one: `Batch.layout` builds and keeps a step's layouts).
"""
from __future__ import annotations

from typing import Protocol

import torch

from mini.model.drafts import DraftRows
from mini.ops.attention import group_rows, step_rows
from mini.ops.compressor import GroupIndex
from mini.ops.step_plan import StepPlan, choices, plan_step


class LayoutInput(Protocol):
    """What a layout reads of its batch (mini.model.batch.Batch; docs/design.md "The forward step")."""
    positions: torch.Tensor  # [T] int64, absolute
    seq_of: torch.Tensor  # [T] int64, 0..B-1
    slots: torch.Tensor  # [B] int64
    start_pos: torch.Tensor  # [B] int64
    lens: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, nb] int32
    start_host: list[int]  # host copies of the sizes (StepLayout)
    lens_host: list[int]
    n_blocks_host: list[int]
    drafts_host: list[int]  # per sequence, the chunk's last rows that are drafts (empty: none; mini.model.drafts)
    max_len: int | None  # static decode buffers (DecodeLayout): the span all sequences end within, scratch slot/block
    pad_slot: int
    pad_block: int
    width: int  # (DecodeLayout) rows per sequence: 1 + the most drafts of a verify step, 1 for decode
    keep: object  # (DecodeLayout) Batch.keep, and the verify step's DraftRows that keeps with it
    kept_drafts: DraftRows | None

    @property
    def n_tokens(self) -> int: ...


def _members_per_group(ratio: int, overlap: bool) -> int:
    return ratio * (2 if overlap else 1)


class StepLayout:
    draft_rows: DraftRows | None = None  # a verify step's drafts (SeqChunk.drafts): kept, not written
    verify_seqs: torch.Tensor | None = None  # [B] bool: the sequences whose chunks hold drafts (verify chunks)
    rows_per_seq = 1  # rows every sequence holds when the step is decode-shaped (DecodeLayout: its width)

    def __init__(self, batch: LayoutInput, block_tokens: int, window: int):
        dev = batch.positions.device
        self.device, self.block_tokens, self.window = dev, block_tokens, window
        self.batch = batch
        self.start_host = batch.start_host
        self.end_host = [s + n for s, n in zip(batch.start_host, batch.lens_host)]
        for b, (end, nb) in enumerate(zip(self.end_host, batch.n_blocks_host)):
            if nb * block_tokens < end:
                raise ValueError(f"sequence {b} of the batch reaches position {end - 1} but its {nb} blocks of "
                                 f"{block_tokens} positions end at {nb * block_tokens - 1}")
        self.n_tokens = batch.n_tokens
        lens = batch.lens
        self.row_start = torch.cumsum(lens, 0) - lens  # [B] first row of each sequence
        self.end_pos = batch.start_pos + lens
        self.tok_end = self.end_pos[batch.seq_of]
        self.tok_slot = batch.slots[batch.seq_of]
        # the per-sequence state later steps read (window ring, open compressor groups) takes rows up to
        # `write_end`, the chunk's end less its drafts; the draft rows' writes wait in `draft_rows`
        self.write_end = self.tok_end
        if any(batch.drafts_host):
            self._drafts(batch)
        self._groups: dict = {}
        self._seq_rows: dict = {}
        self._tables: dict = {}
        self._window()

    def _drafts(self, batch: LayoutInput):
        drafts = batch.drafts_host
        per_seq = torch.tensor(drafts, device=self.device)
        self.write_end = self.tok_end - per_seq[batch.seq_of]
        self.verify_seqs = per_seq > 0
        row_start = [0]
        for n in batch.lens_host:
            row_start.append(row_start[-1] + n)
        has = [b for b, k in enumerate(drafts) if k]
        for b in has:
            if not 0 < drafts[b] < batch.lens_host[b]:
                raise ValueError(f"sequence {b}: {drafts[b]} drafts in a chunk of {batch.lens_host[b]} rows (a "
                                 "verify chunk starts with one committed token)")
        self.draft_rows = DraftRows(len(drafts), has, [row_start[b + 1] - drafts[b] for b in has],
                                    [self.end_host[b] - drafts[b] for b in has], [drafts[b] for b in has],
                                    batch.slots[has].tolist())

    # ------------------------------------------------------------------ sliding window
    def _window(self):
        """The last <= W positions of each chunk before its drafts are written into the ring after the layer's
        attention."""
        W, pos = self.window, self.batch.positions
        self.ring_write_row = torch.nonzero((pos >= self.write_end - W) & (pos < self.write_end)).flatten()
        self.ring_write_dst = (self.tok_slot * W + pos % W)[self.ring_write_row]

    # ------------------------------------------------------------------ paged compressed pools
    def _pool_rows(self, seq: torch.Tensor, group: torch.Tensor, ratio: int) -> torch.Tensor:
        return group_rows(group, seq, self.batch.block_table, self.block_tokens // ratio)

    def _max_groups(self, ratio: int) -> int:
        """N of seq_rows: the most complete groups of any sequence at the step's end."""
        return max(e // ratio for e in self.end_host)

    def seq_rows(self, ratio: int) -> torch.Tensor:
        """[B, N] flat pool row of group j of each sequence, -1 for groups not complete at the step's end."""
        if ratio not in self._seq_rows:
            n = self._max_groups(ratio)
            j = torch.arange(n, device=self.device)
            seq = torch.arange(self.end_pos.shape[0], device=self.device)[:, None].expand(-1, n)
            done = j < (self.end_pos[:, None] // ratio)
            self._seq_rows[ratio] = self._pool_rows(seq, torch.where(done, j, -1), ratio)
        return self._seq_rows[ratio]

    def n_visible(self, ratio: int) -> torch.Tensor:
        """[T] groups a query may see: a group is visible once its last token is at or before the query (built once
        per step and ratio: the indexer layers of a ratio share it)."""
        return self.table(("n_visible", ratio), lambda: (self.batch.positions + 1) // ratio)

    def groups(self, ratio: int, overlap: bool) -> GroupIndex:
        """Groups completed in this step. Without overlap group j pools its own `ratio` tokens; with overlap (V4
        ratio 4) it pools group j-1's tokens (channel half 0) then its own (half 1): M = 2·ratio members. Open
        groups (and, with overlap, the last complete one) are kept in `state_rows = M` rows per slot."""
        key = (ratio, overlap)
        if key not in self._groups:
            self._groups[key] = self._group_index(ratio, overlap)
        return self._groups[key]

    def _group_index(self, ratio: int, overlap: bool) -> GroupIndex:
        """Every group some chunk completes, in sequence order (G from the host sizes)."""
        dev, b = self.device, self.batch
        first = [s // ratio for s in self.start_host]
        counts = [e // ratio - f for e, f in zip(self.end_host, first)]
        G = sum(counts)
        counts_t = torch.tensor(counts, device=dev)
        seq = torch.repeat_interleave(torch.arange(len(counts), device=dev), counts_t, output_size=G)
        offset = torch.arange(G, device=dev) - (torch.cumsum(counts_t, 0) - counts_t)[seq]
        group = b.start_pos[seq] // ratio + offset
        M = _members_per_group(ratio, overlap)
        write_row = torch.nonzero(self._stays_open(ratio, overlap)).flatten()
        write_state = (self.tok_slot * M + b.positions % M)[write_row]
        return self._members(seq, group, self._pool_rows(seq, group, ratio), ratio, overlap, write_row, write_state)

    def _stays_open(self, ratio: int, overlap: bool) -> torch.Tensor:
        """[T] bool: the token belongs to a group still open after the step (with overlap, also to the last
        complete one), so the compressor state keeps it. Draft rows never (`draft_rows`)."""
        pos = self.batch.positions
        return (pos >= (self.write_end // ratio - int(overlap)) * ratio) & (pos < self.write_end)

    def _members(self, seq, group, pool_row, ratio: int, overlap: bool, write_row, write_state) -> GroupIndex:
        """The GroupIndex of groups (seq, group): where each of their M members is read from. A member is in the
        chunk when its position is in [start, end) of its sequence, in the state rows when it is before start."""
        b = self.batch
        M = _members_per_group(ratio, overlap)
        member_pos = (group - int(overlap))[:, None] * ratio + torch.arange(M, device=self.device)
        start = b.start_pos[seq][:, None]
        in_chunk = (member_pos >= start) & (member_pos < self.end_pos[seq][:, None])
        member_row = torch.where(in_chunk, self.row_start[seq][:, None] + member_pos - start, -1)
        earlier = (member_pos < start) & (member_pos >= 0)
        member_state = torch.where(earlier, b.slots[seq][:, None] * M + member_pos % M, -1)
        return GroupIndex(seq=seq, group=group, pos=group * ratio, pool_row=pool_row, member_row=member_row,
                          member_state=member_state, write_row=write_row, write_state=write_state)

    def keep(self, key, rows: torch.Tensor) -> torch.Tensor:
        """Rows the forward leaves for after it (DSpark's target features): the step's own tensor."""
        return rows

    def table(self, name: str, make):
        """A per-step value shared by the layers (e.g. RoPE tables), built once by `make()`."""
        if name not in self._tables:
            self._tables[name] = make()
        return self._tables[name]

    def plan(self, dtype: torch.dtype) -> StepPlan:
        """What runs for this step (mini.ops.step_plan): resolved once per step, activation dtype and set of backend
        choices, and handed by the model to every layer's ops."""
        return self.table(("plan", dtype, choices(self.device)), lambda: plan_step(self.n_tokens, self.device, dtype))

    @property
    def window_widths(self) -> torch.Tensor:
        """[B] int32: each sequence's window entries in the official key lists (mini.kernels.sparse_attention.
        window_widths), the same for every layer: built once per step instead of in each layer's attention."""
        from mini.kernels.sparse_attention import window_widths  # triton is optional on CPU: import on use
        b = self.batch
        return self.table("window_widths", lambda: window_widths(b.seq_of, b.start_pos, self.window))

    @property
    def key_rows(self):
        """The step's row lists for the FlashMLA path (mini.ops.attention.step_rows): held here, so the step's
        layers share them and they go with the step; built lazily by the calls that read them."""
        b = self.batch
        return self.table("key_rows", lambda: step_rows(b.positions, b.seq_of, b.slots, b.start_pos,
                                                        self.verify_seqs))


class DecodeLayout(StepLayout):
    """A decode step from static buffers (Batch.max_len set), `batch.width` rows per sequence: row b·width + i is
    sequence b's row i (width 1: row b = sequence b's one token). Every index tensor has a shape fixed by B, the
    width and max_len and comes from device ops only, so the step can be captured once in a CUDA graph and replayed
    with new buffer contents.

    * seq_rows spans the groups of max_len positions (N = max_len // ratio), -1 past each sequence's;
    * groups(): one entry per row, the group its token falls in (a decode token completes at most one group per
      ratio); an entry the row does not complete writes its latent into the scratch block `batch.pad_block`;
    * a sequence's first row goes to its ring, and to its compressor state unless it closes its group, else to the
      scratch slot `batch.pad_slot`;
    * padding rows (slot pad_slot, every block pad_block) write nothing a real sequence reads.

    A verify step (width > 1: a sequence's token and its drafts, mini.model.drafts) is Batch.build's verify chunk
    of `lens[b]` rows followed by padding rows at the next positions: the drafts' ring and state writes are kept in
    `draft_rows` (their places come with each fill: DecodeBuffers.draft_rows), the groups real rows complete are
    written as an eager verify writes them, those of padding rows (after every real row: none of them reads one)
    go to the scratch block."""

    def __init__(self, batch: LayoutInput, block_tokens: int, window: int):
        self.device, self.block_tokens, self.window = batch.positions.device, block_tokens, window
        self.batch = batch
        self.n_tokens = batch.positions.shape[0]
        self.rows_per_seq = batch.width
        self._groups, self._seq_rows, self._tables = {}, {}, {}
        if batch.width == 1:
            self.row_start = batch.seq_of  # row b is sequence b
            self.end_pos = self.tok_end = self.write_end = batch.positions + 1
            self.tok_slot = batch.slots
            self.ring_write_row = slice(None)  # every row in order (row b is sequence b's token): no gather
            self.ring_write_dst = batch.slots * window + batch.positions % window
            return
        seq = batch.seq_of
        self.row_start = torch.arange(batch.slots.shape[0], device=self.device) * batch.width
        self.end_pos = batch.start_pos + batch.lens  # the real rows' end, drafts included (Batch.build's)
        self.tok_end = self.end_pos[seq]
        self.write_end = (batch.start_pos + 1)[seq]  # the committed end: drafts are kept, not written
        self.tok_slot = batch.slots[seq]
        self.real = batch.positions < self.tok_end  # [T] a sequence's token and drafts, not its padding rows
        self.ring_write_row = slice(None, None, batch.width)  # row b·width, sequence b's token: a view, no gather
        self.ring_write_dst = batch.slots * window + batch.start_pos % window
        self.draft_rows = batch.kept_drafts

    @property
    def verify_seqs(self) -> torch.Tensor | None:
        """Every sequence of a verify step (width > 1) holds a verify chunk; built only when the step's row lists
        are (`key_rows`), not in every captured step."""
        if self.rows_per_seq == 1:
            return None
        return torch.ones(self.batch.slots.shape[0], dtype=torch.bool, device=self.device)

    def _max_groups(self, ratio: int) -> int:
        return self.batch.max_len // ratio

    def keep(self, key, rows: torch.Tensor) -> torch.Tensor:
        """Kept in the static buffers' own tensor (Batch.keep): a captured step leaves it there for every bucket."""
        return rows if self.batch.keep is None else self.batch.keep(key, rows)

    def _group_index(self, ratio: int, overlap: bool) -> GroupIndex:
        b, M = self.batch, _members_per_group(ratio, overlap)
        seq, group = b.seq_of, b.positions // ratio
        closes = (b.positions + 1) % ratio == 0
        scratch_row = b.pad_block * (self.block_tokens // ratio)
        if b.width == 1:
            pool_row = torch.where(closes, self._pool_rows(seq, group, ratio), scratch_row)
        else:  # a padding row's group, perhaps past the block table, is never looked up
            closes = closes & self.real
            pool_row = torch.where(closes, self._pool_rows(seq, torch.where(closes, group, -1), ratio), scratch_row)
        state_slot = torch.where(self._stays_open(ratio, overlap), self.tok_slot, b.pad_slot)
        # every row writes its state row (write_row None: all, in order, no gather); those that do not stay open
        # write the scratch slot's
        return self._members(seq, group, pool_row, ratio, overlap, None, state_slot * M + b.positions % M)
