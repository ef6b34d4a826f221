"""The draft rows of a speculative verify step (docs/engine.md, "DSpark speculative decoding"), and how the cache
takes the accepted ones.

A verify chunk is [b, d1..dk] at positions f+1..f+1+k (`SeqChunk.drafts` = k): b is committed, the drafts are
not yet. The forward computes every row as a prefill chunk would (its queries read the fresh rows of the chunk,
groups the drafts complete are pooled and read within the step), but the per-sequence state that a later step
reads stops at the committed end f+2 (`StepLayout`: ring writes and the compressor's open-group writes cover rows
before it only). What those writes would have been for the draft rows is kept here: each layer's window KV row
and each compressor's (kv, score) row. Once the engine knows how many drafts a sequence accepted,
`commit(cache, accepted)` writes the accepted rows where plain decode would have: ring slot pos % W, and the state
rows of the group still open at the new frontier. Nothing else needs undoing: a group that rejected rows completed
sits in a pool row that no query reads before a later step completes that group again from committed tokens and
overwrites it (the compressor runs before attention in every layer).
"""
from __future__ import annotations

from typing import Callable

import torch


class DraftRows:
    """Draft rows of one step of `n_seqs` chunks: the i-th chunk with drafts is chunk `seqs[i]`, its drafts rows
    `first_row[i]`..+`count[i]`-1 at positions `first_pos[i]`.., in slot `slots[i]` (host lists)."""

    def __init__(self, n_seqs: int, seqs: list[int], first_row: list[int], first_pos: list[int], count: list[int],
                 slots: list[int], store: Callable[[object, torch.Tensor], torch.Tensor] | None = None):
        self.n_seqs, self.seqs = n_seqs, seqs
        self.first_row, self.first_pos, self.count, self.slots = first_row, first_pos, count, slots
        self.window: dict[int, torch.Tensor] = {}  # layer -> [T, head_dim] every row's window KV
        # (pool name, layer) -> (kv, score) [T, width] fp32, ratio, overlap: every row as the state takes it
        self.state: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, int, bool]] = {}
        # static verify steps (mini.model.layout.DecodeLayout): store(key, rows) copies the rows into a tensor of
        # the static buffers' own (DecodeBuffers.keep), shared by every captured step, and returns it
        self.store = store

    def placed(self, n_seqs: int, seqs: list[int], first_row: list[int], first_pos: list[int], count: list[int],
               slots: list[int]) -> "DraftRows":
        """The same kept rows at another step's places: a static verify step keeps its rows in the buffers' tensors
        and learns which of them are drafts at each fill."""
        rows = DraftRows(n_seqs, seqs, first_row, first_pos, count, slots)
        rows.window, rows.state = self.window, self.state
        return rows

    def _kept(self, key, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.store is None else self.store(key, rows)

    def keep_window(self, layer: int, kv: torch.Tensor) -> None:
        """Keep a layer's window KV rows [T, head_dim] (what the ring would take)."""
        self.window[layer] = self._kept(("window", layer), kv)

    def keeper(self, pool: str, layer: int, ratio: int, overlap: bool):
        """A `compress(keep=)` callback storing that compressor's rows."""
        def keep(kv: torch.Tensor, score: torch.Tensor) -> None:
            self.state[(pool, layer)] = (self._kept((pool, layer, "kv"), kv), self._kept((pool, layer, "score"), score),
                                         ratio, overlap)
        return keep

    def commit(self, window: list[torch.Tensor], states: dict[str, dict], accepted: list[int]) -> None:
        """Write the first accepted[b] draft rows of each chunk b (in the step's chunk order, 0 for a chunk without
        drafts) into the rings `window[l]` [n_slots, W, d] and the compressor states `states[pool][l]` ((kv, score)
        [n_slots, M, width]), as their decode steps would have."""
        if len(accepted) != self.n_seqs:
            raise ValueError(f"accepted counts for {len(accepted)} chunks, the step had {self.n_seqs}")
        drafted = dict(zip(self.seqs, self.count))
        for b, a in enumerate(accepted):
            if not 0 <= a <= drafted.get(b, 0):
                raise ValueError(f"chunk {b}: {a} drafts accepted of {drafted.get(b, 0)}")
        accepted = [accepted[b] for b in self.seqs]
        rows, pos, slot, end = [], [], [], []
        for r0, p0, a, s in zip(self.first_row, self.first_pos, accepted, self.slots):
            rows += range(r0, r0 + a)
            pos += range(p0, p0 + a)
            slot += [s] * a
            end += [p0 + a] * a  # the committed end (exclusive) of the row's sequence
        if not rows:
            return
        some = next(iter(self.window.values()), None)
        device = some.device if some is not None else next(iter(self.state.values()))[0].device
        r, p, s, e = (torch.tensor(v, dtype=torch.int64, device=device) for v in (rows, pos, slot, end))
        for layer, kv in self.window.items():
            ring = window[layer]
            W = ring.shape[1]
            ring.view(-1, ring.shape[-1])[s * W + p % W] = kv[r].to(ring.dtype)
        for (pool, layer), (kv, score, ratio, overlap) in self.state.items():
            state_kv, state_score = states[pool][layer]
            M = state_kv.shape[1]
            live = p >= (e // ratio - int(overlap)) * ratio  # members of the groups open at the frontier
            dst = (s * M + p % M)[live]
            state_kv.view(-1, kv.shape[-1])[dst] = kv[r[live]]
            state_score.view(-1, score.shape[-1])[dst] = score[r[live]]
