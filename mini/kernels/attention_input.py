"""The sparse attention core's arguments as one typed record (`mini.ops.attention.sparse_attention`'s signature),
shared by the op's dispatch and the kernel adapters that take a whole step (mini/kernels/flashmla_attention.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def one_token_rows(self, single: torch.Tensor) -> "AttentionInput":
        """The input restricted to the rows `single` of one-token chunks: one row per sequence, so they form a
        decode step of those sequences (T = B, their slots, starts and block-table rows, sequence i = row i), the
        step they would make without the step's other chunks."""
        seqs = self.seq_of[single]
        sub_seq_of = torch.arange(single.shape[0], device=self.seq_of.device, dtype=self.seq_of.dtype)
        return AttentionInput(
            self.q[single], self.kv_new[single], self.window, self.sink, self.positions[single], sub_seq_of,
            self.slots[seqs], self.start_pos[seqs], self.scale, self.comp,
            None if self.block_table is None else self.block_table[seqs],
            None if self.comp_idx is None else self.comp_idx[single], self.ratio,
            None if self.rope_out is None else self.rope_out[single])
