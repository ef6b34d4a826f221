"""The row numbers of a decode-shaped step's keys in a cache's KeyStore (mini.kernels.attention_input), for a kernel
that reads keys by row from one tensor (FlashMLA's sparse kernel, mini/kernels/flashmla_attention.py).

A decode or static verify step (every sequence holds the same rows_per_seq rows, its token and its drafts) lists,
for query t of sequence b at position p (the sequence's rows start at `start`):
* its window, positions p - W + 1 .. p (those >= 0): a position >= start is one of the step's own rows, copied to
  the store's fresh rows at `fresh_row` + t - (p - position); an earlier one sits in the sequence's ring, row
  `ring_row` + slot * W + position % W;
* its compressed groups, comp_idx[t] (absolute group ids, -1 = none): pool row `pool_row` + block_table[b, g //
  rows_per_block] * rows_per_block + g % rows_per_block;
then -1 up to `n` entries (the kernel's multiple). The same keys as mini.ops.attention.scratch_keys lists for the
query (the plain definition of a query's keys), in the decode ring's order; only the row numbers differ.
`key_rows_reference` is the same in torch ops (the tests' reference; the interpreter runs the kernel on CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _key_rows_kernel(pos_ptr, seq_ptr, slot_ptr, start_ptr, btab_ptr, cidx_ptr, rows_ptr,
                     ring_row, pool_row, fresh_row, n_comp, stride_btab, stride_cidx, n,
                     W: tl.constexpr, RPB: tl.constexpr, BLOCK: tl.constexpr):
    """Program (query t, BLOCK entries of its list): window entries j < W, then groups, then -1."""
    t = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    start = tl.load(start_ptr + seq).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    kpos = pos - W + 1 + j
    seen = kpos >= 0
    kpos = tl.where(seen, kpos, 0)
    win = tl.where(kpos >= start, fresh_row + t - (pos - kpos), ring_row + slot * W + kpos % W)
    c = j - W
    in_comp = (c >= 0) & (c < n_comp)
    g = tl.load(cidx_ptr + t * stride_cidx + c, mask=in_comp, other=-1).to(tl.int64)
    has = g >= 0
    g = tl.where(has, g, 0)
    blk = tl.load(btab_ptr + seq * stride_btab + g // RPB, mask=in_comp & has, other=0).to(tl.int64)
    comp = pool_row + blk * RPB + g % RPB
    row = tl.where(j < W, tl.where(seen, win, -1), tl.where(in_comp & has, comp, -1))
    tl.store(rows_ptr + t * n + j, row.to(tl.int32), mask=j < n)


def key_rows(positions: torch.Tensor, seq_of: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
             W: int, ring_row: int, fresh_row: int, block_table: torch.Tensor | None = None,
             comp_idx: torch.Tensor | None = None, rows_per_block: int = 1, pool_row: int = 0,
             multiple: int = 1) -> torch.Tensor:
    """rows [T, n] int32 (n = W + comp_idx's width, rounded up to `multiple`), as the module docstring lists them;
    one launch, no device sync (sizes from shapes)."""
    T = positions.shape[0]
    n_comp = 0 if comp_idx is None else comp_idx.shape[1]
    n = W + n_comp
    n += -n % multiple
    rows = torch.empty(T, n, dtype=torch.int32, device=positions.device)
    if T == 0:
        return rows
    if n_comp == 0:  # (pointers the kernel never reads through)
        block_table, comp_idx = start_pos, positions
    block = min(1024, triton.next_power_of_2(n))
    _key_rows_kernel[(T, triton.cdiv(n, block))](
        positions, seq_of, slots, start_pos, block_table, comp_idx, rows, ring_row, pool_row, fresh_row, n_comp,
        block_table.stride(0) if n_comp else 0, comp_idx.stride(0) if n_comp else 0, n,
        W=W, RPB=rows_per_block, BLOCK=block)
    return rows


def key_rows_reference(positions, seq_of, slots, start_pos, W: int, ring_row: int, fresh_row: int,
                       block_table=None, comp_idx=None, rows_per_block: int = 1, pool_row: int = 0,
                       multiple: int = 1) -> torch.Tensor:
    """`key_rows` in torch ops."""
    T = positions.shape[0]
    t = torch.arange(T, device=positions.device)[:, None]
    pos, seq = positions[:, None].long(), seq_of[:, None].long()
    start, slot = start_pos.long()[seq], slots.long()[seq]
    kpos = pos - W + 1 + torch.arange(W, device=positions.device)[None, :]
    win = torch.where(kpos >= start, fresh_row + t - (pos - kpos), ring_row + slot * W + kpos.clamp_min(0) % W)
    parts = [torch.where(kpos >= 0, win, -1)]
    if comp_idx is not None and comp_idx.shape[1]:
        g = comp_idx.long()
        blk = block_table.long()[seq, g.clamp_min(0) // rows_per_block]
        parts.append(torch.where(g >= 0, pool_row + blk * rows_per_block + g.clamp_min(0) % rows_per_block, -1))
    rows = torch.cat(parts, 1)
    pad = -rows.shape[1] % multiple
    return torch.cat([rows, rows.new_full((T, pad), -1)], 1).to(torch.int32)
