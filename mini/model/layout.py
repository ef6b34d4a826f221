"""Index tensors of one step, derived from a Batch with vectorised torch ops (no loop over sequences).

Where each key lives (docs/design.md "Cache pools"):
* the window of a query at position p is positions p-W+1..p: chunk rows or ring rows `slot*W + pos % W`
  (mini.ops.attention resolves them); the chunk's last W positions are written to the ring;
* compressed group j (ratio r) of a sequence is pool row `block_table[j // rows_per_block] * rows_per_block +
  j % rows_per_block`, rows_per_block = block_tokens // r;
* a compressor's partial groups live in state row `slot * state_rows + pos % state_rows`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mini.ops.attention import group_rows
from mini.ops.compressor import GroupIndex

if TYPE_CHECKING:
    from mini.model.batch import Batch


class StepLayout:
    def __init__(self, batch: "Batch", block_tokens: int, window: int):
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
        self._groups: dict = {}
        self._seq_rows: dict = {}
        self._tables: dict = {}
        self._window()

    # ------------------------------------------------------------------ sliding window
    def _window(self):
        """The last <= W positions of each chunk are written into the ring after the layer's attention."""
        W, pos = self.window, self.batch.positions
        self.ring_write_row = torch.nonzero(pos >= self.tok_end - W).flatten()
        self.ring_write_dst = (self.tok_slot * W + pos % W)[self.ring_write_row]

    # ------------------------------------------------------------------ paged compressed pools
    def _pool_rows(self, seq: torch.Tensor, group: torch.Tensor, ratio: int) -> torch.Tensor:
        return group_rows(group, seq, self.batch.block_table, self.block_tokens // ratio)

    def seq_rows(self, ratio: int) -> torch.Tensor:
        """[B, N] flat pool row of group j of each sequence, -1 for groups not complete at the step's end;
        N = the most complete groups of any sequence."""
        if ratio not in self._seq_rows:
            n = max(e // ratio for e in self.end_host)
            j = torch.arange(n, device=self.device)
            seq = torch.arange(len(self.end_host), device=self.device)[:, None].expand(-1, n)
            done = j < (self.end_pos[:, None] // ratio)
            self._seq_rows[ratio] = self._pool_rows(seq, torch.where(done, j, -1), ratio)
        return self._seq_rows[ratio]

    def n_visible(self, ratio: int) -> torch.Tensor:
        """[T] groups a query may see: a group is visible once its last token is at or before the query."""
        return (self.batch.positions + 1) // ratio

    def groups(self, ratio: int, overlap: bool) -> GroupIndex:
        """Groups completed in this step. Without overlap group j pools its own `ratio` tokens; with overlap (V4
        ratio 4) it pools group j-1's tokens (channel half 0) then its own (half 1): M = 2·ratio members. Open
        groups (and, with overlap, the last complete one) are kept in `state_rows = M` rows per slot."""
        key = (ratio, overlap)
        if key in self._groups:
            return self._groups[key]
        dev, b = self.device, self.batch
        first = [s // ratio for s in self.start_host]
        counts = [e // ratio - f for e, f in zip(self.end_host, first)]
        G = sum(counts)
        counts_t = torch.tensor(counts, device=dev)
        seq = torch.repeat_interleave(torch.arange(len(counts), device=dev), counts_t, output_size=G)
        offset = torch.arange(G, device=dev) - (torch.cumsum(counts_t, 0) - counts_t)[seq]
        group = b.start_pos[seq] // ratio + offset
        M = ratio * (2 if overlap else 1)
        member_pos = (group - int(overlap))[:, None] * ratio + torch.arange(M, device=dev)
        start = b.start_pos[seq][:, None]
        in_chunk = member_pos >= start
        member_row = torch.where(in_chunk, self.row_start[seq][:, None] + member_pos - start, -1)
        member_state = torch.where(~in_chunk & (member_pos >= 0), b.slots[seq][:, None] * M + member_pos % M, -1)
        open_from = (self.tok_end // ratio - int(overlap)) * ratio
        write_row = torch.nonzero(b.positions >= open_from).flatten()
        write_state = (self.tok_slot * M + b.positions % M)[write_row]
        gi = GroupIndex(seq=seq, group=group, pos=group * ratio, pool_row=self._pool_rows(seq, group, ratio),
                        member_row=member_row, member_state=member_state, write_row=write_row,
                        write_state=write_state)
        self._groups[key] = gi
        return gi

    def table(self, name: str, make):
        """A per-step value shared by the layers (e.g. RoPE tables), built once by `make()`."""
        if name not in self._tables:
            self._tables[name] = make()
        return self._tables[name]
