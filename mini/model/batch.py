"""One forward step as a flat batch of tokens (docs/design.md "The forward step").

Every sequence of the step contributes one chunk: a prefill chunk of any length starting anywhere, or a decode
chunk of one token. Their tokens are concatenated into T rows; the model sees `[T, ...]` tensors plus the index
tensors below and never loops over sequences.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mini.config import ModelConfig
from mini.model.layout import StepLayout


@dataclass
class SeqChunk:
    tokens: list[int]  # the whole history of the sequence up to the chunk's end
    start: int  # absolute position of the chunk's first token (= tokens already in the cache)
    slot: int  # row of the sequence in the per-sequence pools (window rings, compressor state)
    blocks: list[int]  # block ids of the paged pools covering positions 0..len(tokens)-1
    want_logits: bool = True

    def __post_init__(self):
        if not 0 <= self.start < len(self.tokens):
            raise ValueError(f"chunk start {self.start} outside a history of {len(self.tokens)} tokens")


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
    engram_ids: torch.Tensor | None  # [T, n_engram_layers, n_hash_cols] int64 (V4.1)
    # host copies of the per-sequence sizes, so that index tensors can be shaped without a device sync
    start_host: list[int] = field(default_factory=list)
    lens_host: list[int] = field(default_factory=list)
    n_blocks_host: list[int] = field(default_factory=list)
    _layouts: dict = field(default_factory=dict, repr=False)

    @property
    def n_tokens(self) -> int:
        return int(sum(self.lens_host))

    @property
    def n_seqs(self) -> int:
        return len(self.lens_host)

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
            if c.want_logits:
                logit_rows.append(row - 1)
            if hasher is not None:
                engram.append(hasher.hash_ids(c.tokens, c.start, len(c.tokens)))

        def t(v, dtype=torch.int64):
            return torch.tensor(v, dtype=dtype, device=device)

        return cls(
            input_ids=t(ids), positions=t(pos), seq_of=t(seq_of), slots=t([c.slot for c in chunks]),
            start_pos=t([c.start for c in chunks]), lens=t([len(c.tokens) - c.start for c in chunks]),
            block_table=table.to(device), logit_rows=t(logit_rows),
            engram_ids=torch.cat(engram).to(device) if engram else None,
            start_host=[c.start for c in chunks], lens_host=[len(c.tokens) - c.start for c in chunks],
            n_blocks_host=[len(c.blocks) for c in chunks])

    def layout(self, block_tokens: int, window: int) -> StepLayout:
        """The step's index tensors for a cache with `block_tokens` positions per block (built once per batch)."""
        key = (block_tokens, window)
        if key not in self._layouts:
            self._layouts[key] = StepLayout(self, block_tokens, window)
        return self._layouts[key]
