"""FlashMLA's SM90 sparse prefill kernel (`sgl-flash-mla`, `flash_mla_sparse_fwd`) for the sparse attention core:
library adapter, called only from mini/ops/attention.py: `StepRows` lays a step's keys out as the kernel reads them
(the plain definition is mini.ops.attention.scratch_keys), `sparse_prefill` calls the kernel.

The kernel computes, per query token t and head h, over the key rows rows[t, :count[t]] of one bf16 tensor kv
(rows -1 or >= N skipped): o = Σ_j softmax_j(q·k_j·scale) k_j (K = V, all 512 channels), the denominator also
holding exp(sink[h]) (unscaled), fp32 logits and statistics, P rounded to bf16 before P·V, output bf16. That is
`mini.ops.attention.sparse_attention`'s arithmetic before its output RoPE. The SM90 build ("legacy" half of the
wheel, `use_legacy=True`) takes heads of width 512 and a row list whose length is a multiple of 128 (it walks it
two 64-row blocks at a time); `topk_length` (= count) lets a query stop after its valid rows. One CTA per (token,
64 heads), so it serves prefill-sized steps; decode steps stay on the Triton kernel (its decode path rejects
V4.1's cache formats anyway). Only 64 heads (V4.1-Flash) are used: 128 is in the kernel's feature list, but the
binary also carries a `params.h_q == 64` assertion of unknown scope and was only run at 64 heads.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

HEADS = (64,)
HEAD_DIM = 512  # d_v is fixed at 512, so with K = V the key width must be 512 too (576 would mean V = K[:512])
TOPK_MULTIPLE = 128
MIN_TOKENS = 512  # prefill-sized steps only; where the scratch building stops paying is a guess, not measured
# the scratch copies every key a step can touch, not only those it reads: skip steps where that is out of
# proportion (a ~1 KB row per key vs ~84 MFLOP of attention per token at V4.1's 64 heads x 640 keys)
SCRATCH_ROWS_PER_TOKEN = 32


@functools.cache
def available() -> bool:
    """Whether the library imports with its SM90 kernels and the current GPU is SM90."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import flash_mla
    except Exception:  # not installed, or its extension does not load against this torch / driver
        return False
    return flash_mla.has_legacy()


def supported(q: torch.Tensor, keys: list[torch.Tensor], scratch_rows: int) -> bool:
    """Whether this call is one the kernel serves: bf16 CUDA q [T, H, 512] with H in HEADS and bf16 key sources,
    a prefill-sized step, a scratch of `scratch_rows` rows in proportion, outside CUDA-graph capture."""
    T, H, D = q.shape
    return (q.is_cuda and q.dtype == torch.bfloat16 and all(k.dtype == torch.bfloat16 for k in keys)
            and H in HEADS and D == HEAD_DIM and T >= MIN_TOKENS and scratch_rows <= SCRATCH_ROWS_PER_TOKEN * T
            and not torch.cuda.is_current_stream_capturing() and available())


def sparse_prefill(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, count: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [T, H, 512] bf16, kv [N, 512] bf16, rows [T, n] int32 (n a multiple of TOPK_MULTIPLE, -1 = none), count
    [T] int32 (rows read per query), sink [H] -> [T, H, 512] bf16 (arithmetic in the module docstring)."""
    from flash_mla import flash_mla_sparse_fwd
    out = flash_mla_sparse_fwd(q.contiguous(), kv.unsqueeze(1), rows.unsqueeze(1), float(scale), d_v=q.shape[-1],
                               attn_sink=sink.float().contiguous(), topk_length=count, use_legacy=True)[0]
    if out.shape != q.shape or out.dtype != q.dtype:  # (output, max_logits, lse) is the documented return
        raise RuntimeError(f"flash_mla_sparse_fwd returned {tuple(out.shape)} {out.dtype} for q {tuple(q.shape)}")
    return out


@dataclass
class _RowLists:
    """Row lists built for one layer's keys, kept for the next layers of the step that read the same ones."""
    ids: torch.Tensor | None  # the comp_idx they were built from (held, so its identity stays unique), None = none
    shape: tuple[int, ...]  # (W, nb, rows_per_block, n): what else the row numbers depend on
    rows: torch.Tensor  # [T, n] int32
    count: torch.Tensor  # [T] int32


class StepRows:
    """The kernel's inputs for the FlashMLA calls of ONE step (the step's layout holds it, so it dies with the step):
    `mini.ops.attention.scratch_keys(..., valid_first=True)` bit for bit, building once what its layers share
    (design.md: every layer sees the same Batch; the layers of one index source read the same top-k ids, one
    tensor):
    * the window part of the row lists, per W: it depends only on the step's positions, sequences and starts;
    * the pool's flat block ids (the block table's);
    * the whole row lists and counts of the last index source, reused while a layer passes the same `comp_idx`
      tensor (by identity, held here: top-k ids are a new tensor every layer that computes them and are never
      written in place) and sizes.
    Each call still copies its own keys (chunk KV, rings, pool blocks) into a fresh scratch: three copies.

    Row order: every pool row (>= T + B·W) lies above every ring row (>= T) above every chunk row, so a query's
    descending list is its groups' rows, descending, then its window rows, descending, then -1 padding; the
    window part is sorted once per step, the groups once per index source, and the two are joined with one
    scatter. `window_rows` is mini.ops.attention.window_rows (where a query's window keys live)."""

    def __init__(self, positions: torch.Tensor, seq_of: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
                 window_rows: Callable, position_order: bool = False):
        self.step = (positions, seq_of, slots, start_pos)
        self._window_rows_of = window_rows
        # the deterministic mode's lists: window keys newest first by position, so that where a chunk starts (which
        # keys are fresh, where the ring wraps) moves no key in a query's list
        self.position_order = position_order
        # the mode's split (mini.ops.attention), per step: (n multi-token rows, their rows, the one-token rows)
        self.multi_token: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self.window: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # W -> rows [T, W], count
        self.blocks: tuple[torch.Tensor, torch.Tensor] | None = None  # (block_table, flat block ids, -1 -> 0)
        self.lists: _RowLists | None = None

    def scratch_keys(self, kv_new, window, comp=None, block_table=None, comp_idx=None, width_multiple: int = 1
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv [N, D], rows [T, n] int32, count [T] int32) exactly as `scratch_keys` lays them out."""
        slots = self.step[2]
        T, D = kv_new.shape
        B, W = slots.shape[0], window.shape[1]
        with_pool = comp_idx is not None and comp_idx.shape[-1] > 0
        nb, rpb = (block_table.shape[1], comp.shape[1]) if with_pool else (0, 0)
        kv = kv_new.new_empty(T + B * W + B * nb * rpb, D)
        kv[:T] = kv_new
        torch.index_select(window, 0, slots, out=kv[T:T + B * W].view(B, W, D))
        if with_pool:
            torch.index_select(comp, 0, self._block_ids(block_table), out=kv[T + B * W:].view(B * nb, rpb, D))
        n = W + (comp_idx.shape[-1] if with_pool else 0)
        shape = (W, nb, rpb, n + -n % width_multiple)
        ids = comp_idx if with_pool else None
        if self.lists is None or self.lists.ids is not ids or self.lists.shape != shape:
            self.lists = _RowLists(ids, shape, *self._row_lists(ids, T, B, shape))
        return kv, self.lists.rows, self.lists.count

    def _block_ids(self, block_table: torch.Tensor) -> torch.Tensor:
        if self.blocks is None or self.blocks[0] is not block_table:
            self.blocks = (block_table, block_table.flatten().long().clamp_min(0))
        return self.blocks[1]

    def _window_rows(self, T: int, B: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, W] int32 window rows of each query, valid first in descending order, and their count [T]."""
        if W not in self.window:
            positions, seq_of, slots, start_pos = self.step
            new, ring = self._window_rows_of(positions, seq_of, torch.arange(B, device=slots.device), start_pos, W)
            rows = torch.where(ring >= 0, ring + T, new).to(torch.int32)
            if self.position_order:  # column k is position p-W+1+k: newest first, the missing ones last
                rows = rows.flip(-1)
                rows = rows.gather(-1, torch.sort((rows < 0).to(torch.int8), dim=-1, stable=True).indices)
            else:
                rows = rows.sort(dim=-1, descending=True).values
            self.window[W] = rows, (rows >= 0).sum(-1, dtype=torch.int32)
        return self.window[W]

    def _row_lists(self, ids, T: int, B: int, shape) -> tuple[torch.Tensor, torch.Tensor]:
        W, nb, rpb, n = shape
        win, win_count = self._window_rows(T, B, W)
        rows = win.new_full((T, n), -1)
        if ids is None:
            rows[:, :W] = win
            return rows, win_count
        groups = ids.to(torch.int32).sort(dim=-1, descending=True).values  # a query's groups first, -1 last
        valid = groups >= 0
        first_row = T + B * W + self.step[1].to(torch.int32) * (nb * rpb)  # group 0 of each query's sequence
        rows[:, : groups.shape[1]] = torch.where(valid, groups + first_row[:, None], -1)
        n_groups = valid.sum(-1, dtype=torch.int32)
        # window row i goes right after the groups, at column n_groups + i (the -1 tail lands on -1 padding)
        rows.scatter_(1, n_groups[:, None].long() + torch.arange(W, device=rows.device), win)
        return rows, n_groups + win_count
