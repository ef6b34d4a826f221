"""The sparse attention core's arguments as one typed record (`mini.ops.attention.sparse_attention`'s signature),
shared by the op's dispatch and the kernel adapters that take a whole step (mini/kernels/flashmla_attention.py),
and `KeyStore`: the one allocation a cache keeps its attention keys in, so such a kernel can read them in place."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class KeyStore:
    """One tensor holding a cache's attention keys: every layer's window ring and every compressed pool are views
    of `rows` [N, D] (mini.model.cache.KVCache), and `fresh` [F, D], its last rows, is where a decode or verify
    step copies its own new keys. A kernel that reads keys by row number from one tensor (FlashMLA's sparse kernel)
    then reads a step's keys where they are, instead of from a per-call copy of every ring and pool block."""
    rows: torch.Tensor
    fresh: torch.Tensor

    def row_of(self, view: torch.Tensor) -> int | None:
        """The row of `rows` where `view` (rows of width D, contiguous) starts; None if it lies elsewhere."""
        base, width = self.rows.data_ptr(), self.rows.shape[1] * self.rows.element_size()
        offset = view.data_ptr() - base
        inside = 0 <= offset < self.rows.numel() * self.rows.element_size() and view.dtype == self.rows.dtype
        return offset // width if inside and offset % width == 0 and view.shape[-1] == self.rows.shape[1] else None


@dataclass(frozen=True, eq=False)
class AttentionInput:
    q: torch.Tensor  # [T, H, D]
    kv_new: torch.Tensor  # [T, D]: this step's window KV
    window: torch.Tensor  # [n_slots, W, D]: the rings
    sink: torch.Tensor  # [H] fp32
    positions: torch.Tensor  # [T]
    seq_of: torch.Tensor  # [T]
    slots: torch.Tensor  # [B]
    start_pos: torch.Tensor  # [B]
    scale: float
    comp: torch.Tensor | None = None  # [n_blocks, rows_per_block, D]: the compressed pool
    block_table: torch.Tensor | None = None  # [B, nb]
    comp_idx: torch.Tensor | None = None  # [T, K] absolute group ids, -1 = none
    ratio: int = 1
    rope_out: torch.Tensor | None = None  # complex64 [T, rd/2]: the output is rotated back by it
    # rows each sequence holds when the step is decode-shaped (T = B x rows_per_seq: a decode step's 1, a static
    # verify step's 1 + k); 1 for any other step
    rows_per_seq: int = 1
    store: KeyStore | None = None  # where window and comp live, when the cache keeps them in one KeyStore

    @property
    def decode_shaped(self) -> bool:
        """Every sequence of the step holds rows_per_seq rows (a decode or static verify step)."""
        return self.q.shape[0] == self.slots.shape[0] * self.rows_per_seq

    def args(self) -> tuple:
        """The positional arguments of `sparse_attention` and of our Triton kernel (`sparse_mla_attention`)."""
        return (self.q, self.kv_new, self.window, self.sink, self.positions, self.seq_of, self.slots, self.start_pos,
                self.scale, self.comp, self.block_table, self.comp_idx, self.ratio, self.rope_out)

    @property
    def with_pool(self) -> bool:
        return self.comp_idx is not None and self.comp_idx.shape[-1] > 0

    def keys(self) -> list[torch.Tensor]:
        """The tensors keys are read from: the chunk's KV, the rings, the pool when groups are read."""
        return [self.kv_new, self.window] + ([self.comp] if self.with_pool else [])

    def chunks_of(self, rows: torch.Tensor, seqs: torch.Tensor, sub_seq_of: torch.Tensor) -> "AttentionInput":
        """The input restricted to `rows`, the whole chunks of the sequences `seqs` (in step order; `sub_seq_of`:
        each row's index into `seqs`): the step those sequences would make without the step's other chunks (their
        slots, starts and block-table rows; a chunk's rows keep reading each other's fresh keys)."""
        return AttentionInput(
            self.q[rows], self.kv_new[rows], self.window, self.sink, self.positions[rows], sub_seq_of,
            self.slots[seqs], self.start_pos[seqs], self.scale, self.comp,
            None if self.block_table is None else self.block_table[seqs],
            None if self.comp_idx is None else self.comp_idx[rows], self.ratio,
            None if self.rope_out is None else self.rope_out[rows])
