"""The model's side of static decode steps (mini.step.StaticDecode): DecodeBuffers filled from the engine's
DecodeRows, with every input the model needs besides the tokens made here.

Engram (V4.1) needs each decode token's predecessors: the engine gives histories, the model hashes them. With the
tables on the device (Model.engram_on_device) the lookback - 1 tokens before each decode token go to the buffers
and the captured forward hashes and looks up on the device (EngramInput "prefix"): nothing waits for a fed token.
With the tables on the host the rows are hashed and looked up on the host before the replay: with a feed, its
tokens are fetched only after every other input is copied, so that the wait for the previous step is as late as it
can be (EngramInput "rows").
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from mini.model.batch import Batch, DecodeBuffers
from mini.model.image_input import dead_at_images
from mini.step import DecodeRows, TokenFeed


class StaticDecodeInputs:
    """DecodeBuffers of a model, filled from DecodeRows. `hasher`: the model's EngramHasher (None without Engram
    layers); `engram_rows(hash_ids)`: the host-table lookup (Model.engram_rows), used when the buffers take rows
    looked up on the host (DecodeBuffers built with `engram_shape`); `model`: whose `target_features` a replay
    sets (DSpark's input; None: a model without a draft module, or a benchmark's)."""

    def __init__(self, buffers: DecodeBuffers, hasher=None,
                 engram_rows: Callable[[torch.Tensor], torch.Tensor] | None = None, model=None):
        self.buffers, self.hasher, self.engram_rows, self.model = buffers, hasher, engram_rows, model
        self.max_seqs, self.max_rows, self.max_len = buffers.max_seqs, buffers.max_rows, buffers.max_len
        self.device = buffers.ids.device

    def batch(self, n: int, width: int = 1, span: int | None = None) -> Batch:
        return self.buffers.batch(n, width, span)

    def fill(self, n: int, rows: DecodeRows, feed: TokenFeed | None = None, width: int = 1) -> None:
        fed = np.array(feed.rows if feed is not None else [-1] * len(rows), dtype=np.int64)
        tokens = [0 if r >= 0 else rows.history(b, p, p + 1)[0] for b, (p, r) in enumerate(zip(rows.positions,
                                                                                                 fed.tolist()))]
        drafts = rows.drafts or [[] for _ in range(len(rows))]
        lookup = prefix = None
        if self.hasher is not None and len(rows):  # the last `lookback` tokens of each row, the row's token last
            k = self.hasher.lookback
            tails = np.full((len(rows) * width, k), -1, dtype=np.int64)  # -1: before the sequence's start
            for b, p in enumerate(rows.positions):  # the tokens before the decode token, image positions dead
                tail = dead_at_images(rows.history(b, max(0, p + 1 - k), p), max(0, p + 1 - k), rows.images(b))
                if width == 1:
                    tails[b, k - 1 - len(tail):k - 1] = tail
                    continue
                # a verify row i: the sequence's token and the drafts before it, then its own (0 past the drafts)
                seq = list(tail) + [tokens[b]] + list(drafts[b]) + [0] * (width - 1 - len(drafts[b]))
                for i in range(width):
                    window = seq[max(0, len(tail) + i + 1 - k):len(tail) + i + 1]
                    tails[b * width + i, k - len(window):] = window
            if width == 1:
                tails[:, -1] = tokens
            if self.buffers.n_prefix:  # tables on the device: hashed there, with the token the buffers hold
                prefix = tails[:, :-1]
            else:
                def lookup() -> torch.Tensor:  # tables on the host
                    if feed is not None:  # only now wait for the fed tokens: every other input is on its way
                        fed_rows = fed >= 0
                        tails[fed_rows, -1] = np.asarray(feed.fetch(), dtype=np.int64)[fed[fed_rows]]
                    return self.engram_rows(self.hasher.hash_last(tails))
        self.buffers.fill(n, tokens, rows.positions, rows.slots, rows.blocks, lookup,
                          None if feed is None else (feed.ids, feed.rows), engram_prefix=prefix,
                          drafts=drafts if width > 1 else None, width=width)

    def replayed(self, cache) -> None:
        """After a forward over these buffers (eager, or a graph's replay): the cache's draft rows are the last
        fill's (a verify step's, kept in the buffers; None without drafts), and the model's target features its
        real rows', in row order (as an eager step of the same chunks gives them)."""
        cache.drafts = self.buffers.draft_rows()
        features = self.buffers.kept.get("target_features")
        if self.model is None or features is None:
            return
        real = self.buffers.real_rows()
        if self.buffers.filled[0] == 1:
            self.model.target_features = features[:len(real)]
        else:
            self.model.target_features = features.index_select(0, torch.tensor(real, device=features.device))
