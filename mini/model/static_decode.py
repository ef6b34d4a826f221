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
    looked up on the host (DecodeBuffers built with `engram_shape`)."""

    def __init__(self, buffers: DecodeBuffers, hasher=None,
                 engram_rows: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.buffers, self.hasher, self.engram_rows = buffers, hasher, engram_rows
        self.max_seqs = buffers.max_seqs
        self.device = buffers.ids.device

    def batch(self, n: int) -> Batch:
        return self.buffers.batch(n)

    def fill(self, n: int, rows: DecodeRows, feed: TokenFeed | None = None) -> None:
        fed = np.array(feed.rows if feed is not None else [-1] * len(rows), dtype=np.int64)
        tokens = [0 if r >= 0 else rows.history(b, p, p + 1)[0] for b, (p, r) in enumerate(zip(rows.positions,
                                                                                                 fed.tolist()))]
        lookup = prefix = None
        if self.hasher is not None and len(rows):  # the last `lookback` tokens of each sequence, its decode token last
            k = self.hasher.lookback
            tails = np.full((len(rows), k), -1, dtype=np.int64)  # -1: before the sequence's start
            for b, p in enumerate(rows.positions):  # the tokens before the decode token, image positions dead
                tail = dead_at_images(rows.history(b, max(0, p + 1 - k), p), max(0, p + 1 - k), rows.images(b))
                tails[b, k - 1 - len(tail):k - 1] = tail
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
                          None if feed is None else (feed.ids, feed.rows), engram_prefix=prefix)
