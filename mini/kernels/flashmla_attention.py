"""FlashMLA's SM90 sparse prefill kernel (`sgl-flash-mla`, `flash_mla_sparse_fwd`) for the sparse attention core:
library adapter, called only from mini/ops/attention.py (whose `core_kernel` decides when it runs). Everything the
library needs beside the kernel is here: `StepRows` lays a step's keys out as the kernel reads them (a scratch; the
plain definition is mini.ops.attention.scratch_keys), `serves` / `takes_model` say which steps and shapes it takes,
`attend` runs it over a step (the output's inverse RoPE as its own pass), `checked_first_call` is MINI_SPARSE_ATTN
=auto's comparison with our kernel, and `attend_by_chunk_kind` is the deterministic mode's split of a step's rows.
`serves_in_place` / `attend_in_place`: decode-shaped steps (decode and static verify, CUDA graphs included) over the
cache's KeyStore itself, no scratch: the step's new keys copied to its fresh rows, the row lists from
mini/kernels/key_rows.py.

The kernel computes, per query token t and head h, over the key rows rows[t, :count[t]] of one bf16 tensor kv
(rows -1 or >= N skipped): o = Σ_j softmax_j(q·k_j·scale) k_j (K = V, all 512 channels), the denominator also
holding exp(sink[h]) (unscaled), fp32 logits and statistics, P rounded to bf16 before P·V, output bf16. That is
`mini.ops.attention.sparse_attention`'s arithmetic before its output RoPE. The SM90 build ("legacy" half of the
wheel, `use_legacy=True`) takes heads of width 512 and a row list whose length is a multiple of 128 (it walks it
two 64-row blocks at a time); `topk_length` (= count) lets a query stop after its valid rows. One CTA per (token,
64 heads). Over a scratch it serves prefill-sized steps only (the scratch copies every key a step can touch);
over the cache's KeyStore (`attend_in_place`) decode and verify steps of more rows than our kernel splits too: at
V4.1 width on the H200 the library alone took 66 us a layer for 256 decode rows at 32K and 76 us for a verify step
of 64 x 6 rows, and the B = 256 x 32K decode step went from 66.7 to 58.6 ms (docs/perf/024; the library's own
decode path rejects V4.1's cache formats). Only 64 heads (V4.1-Flash) are used: 128 is in the kernel's feature
list, but the binary also carries a `params.h_q == 64` assertion of unknown scope and was only run at 64 heads.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from mini.kernels.attention_input import AttentionInput

HEADS = (64,)
HEAD_DIM = 512  # d_v is fixed at 512, so with K = V the key width must be 512 too (576 would mean V = K[:512])
TOPK_MULTIPLE = 128
MIN_TOKENS = 512  # prefill-sized steps only; where the scratch building stops paying is a guess, not measured
# the scratch copies every key a step can touch, not only those it reads: skip steps where that is out of
# proportion (a ~1 KB row per key vs ~84 MFLOP of attention per token at V4.1's 64 heads x 640 keys)
SCRATCH_ROWS_PER_TOKEN = 32
AUTO_CHECK_TOL = 2e-2  # MINI_SPARSE_ATTN=auto: FlashMLA's first output vs ours, largest per-token relative error


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


def serves_in_place(inp: AttentionInput) -> bool:
    """Whether `attend_in_place` takes this step: the model's shapes (`takes_model`), a decode-shaped step of more
    rows than our kernel splits (`few_rows`) whose new keys fit the store's fresh rows, its ring and pool views of
    the store, row numbers within int32."""
    store, T = inp.store, inp.q.shape[0]
    if store is None or not inp.decode_shaped or T > store.fresh.shape[0] or few_rows(T, inp.q.shape[1], inp.q.device):
        return False
    views = [inp.window] + ([inp.comp] if inp.with_pool else [])
    return (store.rows.shape[0] < 2 ** 31 and all(v.is_contiguous() and store.row_of(v) is not None for v in views)
            and takes_model(inp.q, inp.keys()))


def few_rows(T: int, heads: int, device: torch.device) -> bool:
    """A step our Triton kernel splits over its key lists (mini.kernels.sparse_attention.split_pieces: its 2 programs
    per row and 64 heads fill at most half the SMs). It stays there: the library runs one CTA per row and 64 heads,
    so a few rows leave most SMs idle (B = 1 x 6 rows on the H200: the library alone 25 us a call, eager; our split
    kernel ~22 us a call in the verify step's graph, docs/perf/024)."""
    from mini.kernels.device_info import sm_count
    return 2 * (2 * T * -(-heads // 64)) <= sm_count(device)


def attend_in_place(inp: AttentionInput, unrotate: Unrotate) -> torch.Tensor:
    """The sparse attention core of a decode-shaped step through the kernel, reading the keys in the cache's
    KeyStore where they are (`serves_in_place` said yes): the step's new keys go to the store's fresh rows first
    (rows the next such step overwrites), then each query lists its window and groups (mini/kernels/key_rows.py)."""
    from mini.kernels.key_rows import key_rows
    store, T = inp.store, inp.q.shape[0]
    store.fresh[:T].copy_(inp.kv_new)
    pool = inp.with_pool
    rows = key_rows(inp.positions, inp.seq_of, inp.slots, inp.start_pos, inp.window.shape[1],
                    store.row_of(inp.window), store.row_of(store.fresh), inp.block_table if pool else None,
                    inp.comp_idx if pool else None, inp.comp.shape[1] if pool else 1,
                    store.row_of(inp.comp) if pool else 0, TOPK_MULTIPLE)
    count = torch.full((T,), rows.shape[1], dtype=torch.int32, device=rows.device)
    return prefill_unrotated(inp.q, store.rows, rows, count, inp.sink, inp.scale, inp.rope_out, unrotate)


def scratch_rows(inp: AttentionInput) -> int:
    """The rows of the step's scratch (`StepRows.scratch_keys`' kv): chunk KV, each sequence's ring and, when
    groups are read, each sequence's pool blocks."""
    rows = inp.kv_new.shape[0] + inp.slots.shape[0] * inp.window.shape[1]
    if inp.with_pool:
        rows += inp.block_table.shape[0] * inp.block_table.shape[1] * inp.comp.shape[1]
    return rows


def serves(inp: AttentionInput) -> bool:
    """Whether the kernel serves this step (`supported` with the step's scratch size)."""
    return supported(inp.q, inp.keys(), scratch_rows(inp))


def takes_model(q: torch.Tensor, keys: list[torch.Tensor]) -> bool:
    """The kernel takes the model's queries and keys: dtypes, head count and width, the library on this GPU.
    Nothing about the step (its size, its scratch), so a query's kernel never follows what else is batched (the
    deterministic mode's condition)."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and all(k.dtype == torch.bfloat16 for k in keys)
            and q.shape[1] in HEADS and q.shape[2] == HEAD_DIM and available())


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


Unrotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, rope table) -> x rotated back


def prefill_unrotated(q, kv, rows, count, sink, scale, rope_out, unrotate: Unrotate) -> torch.Tensor:
    """The kernel over a scratch, then the output's inverse RoPE as a separate pass (the library has no epilogue
    for it), over the rotated channels only, in place: the others are left as the kernel wrote them."""
    out = sparse_prefill(q, kv, rows, count, sink, scale)
    if rope_out is not None:
        tail = out[..., -2 * rope_out.shape[-1]:]
        tail.copy_(unrotate(tail, rope_out))
    return out


def attend(inp: AttentionInput, key_rows: "StepRows", unrotate: Unrotate) -> torch.Tensor:
    """The sparse attention core of a step through the kernel, over the step's scratch keys (`key_rows`)."""
    kv, rows, count = key_rows.scratch_keys(inp.kv_new, inp.window, inp.comp, inp.block_table, inp.comp_idx,
                                            TOPK_MULTIPLE)
    return prefill_unrotated(inp.q, kv, rows, count, inp.sink, inp.scale, inp.rope_out, unrotate)


def checked_first_call(ours: Callable[[], torch.Tensor], theirs: Callable[[], torch.Tensor]
                       ) -> tuple[torch.Tensor, str | None]:
    """MINI_SPARSE_ATTN=auto's check of the library's first call: our kernel's output, then the library's, compared
    per token (largest relative error under AUTO_CHECK_TOL); a library we only hold as a binary must cost one
    comparison when it is wrong, not a model's output. Returns the output of the kernel to keep and the problem
    (None: the library ran and matched). One device sync."""
    mine = ours()
    try:
        got = theirs()
        diff = (got.float() - mine.float()).flatten(1).norm(dim=1)
        err = float((diff / mine.float().flatten(1).norm(dim=1).clamp_min(1e-30)).max())
        problem = None if err < AUTO_CHECK_TOL else f"differs from the Triton kernel's by {err:.3g} on a token"
    except Exception as e:  # the library's shape/arch checks raise before launching; a changed API raises too
        problem = f"failed ({type(e).__name__}: {str(e)[:200]})"
    return (mine if problem else got), problem


def attend_by_chunk_kind(inp: AttentionInput, key_rows: "StepRows",
                         triton: Callable[[AttentionInput], torch.Tensor], unrotate: Unrotate) -> torch.Tensor:
    """The deterministic mode's split of a step (its `key_rows` in position order): the queries of prefill chunks
    of more than one token through the kernel, those of one-token chunks and of verify chunks (`key_rows.verify`:
    they stand for decode steps, whose numbers speculation must keep) through `triton` (our kernel with the mode's
    lists) as the step those sequences would make alone (`AttentionInput.chunks_of`), scattered back, so that
    neither kind's numbers depend on the other being in the step. The split is found once per step (one host sync)
    and kept on `key_rows`."""
    q, slots, seq_of = inp.q, inp.slots, inp.seq_of
    if key_rows.multi_token is None:  # once per step (one host sync): the queries of each kind of chunk
        prefill = torch.bincount(seq_of, minlength=slots.shape[0]) > 1
        if key_rows.verify is not None:
            prefill &= ~key_rows.verify
        multi = prefill[seq_of]
        idx, single = multi.nonzero().squeeze(1), (~multi).nonzero().squeeze(1)
        seqs, sub_seq_of = torch.unique_consecutive(seq_of[single], return_inverse=True)  # a chunk's rows adjoin
        key_rows.multi_token = (idx.shape[0], idx, single, seqs, sub_seq_of.to(seq_of.dtype))
    n, idx, single, seqs, sub_seq_of = key_rows.multi_token
    if n == 0:
        return triton(inp)
    kv, rows, count = key_rows.scratch_keys(inp.kv_new, inp.window, inp.comp, inp.block_table, inp.comp_idx,
                                            TOPK_MULTIPLE)
    if n == q.shape[0]:
        return prefill_unrotated(q, kv, rows, count, inp.sink, inp.scale, inp.rope_out, unrotate)
    out = torch.empty_like(q)
    out[idx] = prefill_unrotated(q[idx], kv, rows[idx], count[idx], inp.sink, inp.scale,
                                 None if inp.rope_out is None else inp.rope_out[idx], unrotate)
    out[single] = triton(inp.chunks_of(single, seqs, sub_seq_of))
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
                 window_rows: Callable, position_order: bool = False, verify: torch.Tensor | None = None):
        self.step = (positions, seq_of, slots, start_pos)
        self.verify = verify  # [B] bool: the sequences whose chunks are verify chunks (None: none)
        self._window_rows_of = window_rows
        # the deterministic mode's lists: window keys newest first by position, so that where a chunk starts (which
        # keys are fresh, where the ring wraps) moves no key in a query's list
        self.position_order = position_order
        # the mode's split (`attend_by_chunk_kind`), per step: (n prefill rows, their rows, the other rows, the
        # other rows' sequences, each of those rows' index into them)
        self.multi_token: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
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
