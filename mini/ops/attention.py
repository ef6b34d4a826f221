"""Sparse MQA attention with a sink (spec §2.4.6), reading its keys by index from the cache pools (design.md step 4).

A query at position p of sequence b attends to
* its window, positions max(0, p-W+1)..p: rows of the chunk's fresh `kv_new` for positions at or after the chunk
  start, otherwise ring row `pos % W` of the sequence's slot in `window`;
* compressed groups `comp_idx` (absolute group ids, -1 = none) of the paged pool `comp`: group g lives in row
  `block_table[b, g // rows_per_block] * rows_per_block + g % rows_per_block`.
K = V (one latent). o[t,h] = Σ_n softmax_n(q[t,h]·k_n · scale) k_n, the denominator also holding exp(sink[h]).
With a RoPE table `rope_out`, o's tail is rotated back by its conjugate (V = K carries the keys' rotation): the
kernel does it in its epilogue instead of one more pass over [T, H, D].
Logits and softmax statistics are fp32; the probabilities are rounded to the activation dtype before P·V, as in
the reference kernel.

On the GPU (bf16) the op runs one of two kernels, chosen once per process by MINI_SPARSE_ATTN (`sparse_backend`):
our Triton kernel (`mini.kernels.sparse_attention`, same signature), or for prefill-sized steps FlashMLA's SM90
sparse prefill kernel (`mini.kernels.flashmla_attention`), which reads keys by row from ONE tensor: `scratch_keys`
lays the step's keys out as such a tensor plus each query's row list (the plain definition); `StepRows` gives the
same bits, building what a step's layers share once per step.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from mini.ops import library_choice, use_fast
from mini.ops.rope import apply_rope

GATHER_ELEMENTS = 1 << 25  # the reference gathers the keys of a block of queries at once: at most this many values
AUTO_CHECK_TOL = 2e-2  # MINI_SPARSE_ATTN=auto: FlashMLA's first output vs ours, largest per-token relative error


def window_rows(positions, seq_of, slots, start_pos, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, W] rows of kv_new and [T, W] flat rows of the rings holding each query's window (-1 = elsewhere/none)."""
    k = torch.arange(W, device=positions.device)
    key_pos = positions[:, None] - (W - 1) + k
    fresh = key_pos >= start_pos[seq_of][:, None]
    valid = key_pos >= 0
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None] - (W - 1) + k
    new = torch.where(valid & fresh, rows, -1)
    ring = torch.where(valid & ~fresh, slots[seq_of][:, None] * W + key_pos % W, -1)
    return new, ring


def group_rows(group_ids, seq, block_table, rows_per_block: int) -> torch.Tensor:
    """Flat pool rows of absolute group ids (any shape, -1 kept), seq broadcasting against them."""
    g = group_ids.clamp_min(0)
    rows = block_table[seq, g // rows_per_block].long() * rows_per_block + g % rows_per_block
    return torch.where(group_ids >= 0, rows, -1)


def _attend(q, keys, valid, sink, scale):
    logits = torch.einsum("thd,tnd->thn", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    peak = torch.maximum(logits.amax(-1), sink[None, :])  # [t, H]
    p = torch.exp(logits - peak[..., None])
    denom = p.sum(-1) + torch.exp(sink[None, :] - peak)
    return torch.einsum("thn,tnd->thd", p.to(q.dtype).float(), keys) / denom[..., None]


def sparse_attention(q: torch.Tensor, kv_new: torch.Tensor, window: torch.Tensor, sink: torch.Tensor,
                     positions: torch.Tensor, seq_of: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
                     scale: float, comp: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     comp_idx: torch.Tensor | None = None, ratio: int = 1,
                     rope_out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], kv_new [T, D], window [n_slots, W, D], sink [H] fp32, positions/seq_of [T], slots/start_pos
    [B]; optional comp [n_blocks, rows_per_block, D] with block_table [B, nb] and comp_idx [T, K] group ids;
    optional rope_out table complex64 [T, rd/2] (apply_rope(inverse=True) of the output).
    Returns [T, H, D] in q.dtype. (`ratio` only matters to kernels that address blocks by token position.)"""
    if use_fast(q) and q.dtype == torch.bfloat16:
        return _fast(q, kv_new, window, sink, positions, seq_of, slots, start_pos, scale, comp, block_table,
                     comp_idx, ratio, rope_out)
    T, W, D = q.shape[0], window.shape[1], q.shape[-1]
    new_rows, ring_rows = window_rows(positions, seq_of, slots, start_pos, W)
    sources = [(kv_new, new_rows), (window.view(-1, D), ring_rows)]
    if comp_idx is not None and comp_idx.shape[-1]:
        sources.append((comp.view(-1, D), group_rows(comp_idx, seq_of[:, None], block_table, comp.shape[1])))
    out = torch.empty_like(q)
    step = max(1, GATHER_ELEMENTS // (sum(rows.shape[1] for _, rows in sources) * D))
    for lo in range(0, T, step):
        hi = min(lo + step, T)
        valid = torch.cat([rows[lo:hi] >= 0 for _, rows in sources], dim=1)
        keys = torch.cat([src[rows[lo:hi].clamp_min(0)] for src, rows in sources], dim=1).float()
        keys = keys.masked_fill(~valid[..., None], 0.0)  # unread slots may hold anything, NaN included
        out[lo:hi] = _attend(q[lo:hi], keys, valid, sink.float(), scale).to(q.dtype)
    return out if rope_out is None else apply_rope(out, rope_out, inverse=True)


def scratch_keys(kv_new: torch.Tensor, window: torch.Tensor, positions: torch.Tensor, seq_of: torch.Tensor,
                 slots: torch.Tensor, start_pos: torch.Tensor, comp: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, comp_idx: torch.Tensor | None = None,
                 width_multiple: int = 1, valid_first: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys `sparse_attention` reads, as rows of one tensor: (kv [N, D], rows [T, n] int32, count [T] int32).

    kv holds kv_new's T rows, then the ring of each of the step's B sequences (W rows each, ring order), then with
    a pool the blocks of each block-table row (nb·rpb rows each, so group g of sequence b is row
    T + B·W + b·nb·rpb + g; entries -1 past a sequence's blocks gather block 0, which no query reads). Query t
    reads rows[t, :count[t]] (-1 = none; n = W + K rounded up to `width_multiple`, padded with -1); with
    `valid_first` its rows are sorted descending, so count[t] is its number of keys, else count = n. Every size
    comes from tensor shapes: no device sync."""
    T, D = kv_new.shape
    B, W = slots.shape[0], window.shape[1]
    new, ring = window_rows(positions, seq_of, torch.arange(B, device=slots.device), start_pos, W)
    parts, rows = [kv_new, window.index_select(0, slots).view(B * W, D)], [torch.where(ring >= 0, ring + T, new)]
    if comp_idx is not None and comp_idx.shape[-1]:
        nb, rpb = block_table.shape[1], comp.shape[1]
        parts.append(comp.index_select(0, block_table.flatten().long().clamp_min(0)).view(B * nb * rpb, D))
        rows.append(torch.where(comp_idx >= 0, T + B * W + seq_of[:, None] * (nb * rpb) + comp_idx, -1))
    rows = torch.cat(rows, dim=1)
    pad = -rows.shape[1] % width_multiple
    rows = torch.cat([rows, rows.new_full((T, pad), -1)], dim=1).to(torch.int32)
    if not valid_first:
        return torch.cat(parts), rows, torch.full((T,), rows.shape[1], dtype=torch.int32, device=rows.device)
    rows = rows.sort(dim=-1, descending=True).values
    return torch.cat(parts), rows, (rows >= 0).sum(-1, dtype=torch.int32)


@dataclass
class _RowLists:
    """Row lists built for one layer's keys, kept for the next layers of the step that read the same ones."""
    ids: torch.Tensor | None  # the comp_idx they were built from (held, so its identity stays unique), None = none
    shape: tuple[int, ...]  # (W, nb, rows_per_block, n): what else the row numbers depend on
    rows: torch.Tensor  # [T, n] int32
    count: torch.Tensor  # [T] int32


@dataclass
class StepRows:
    """`scratch_keys(..., valid_first=True)` bit for bit, for the FlashMLA calls of one step, building once what
    its layers share (design.md: every layer sees the same Batch; the layers of one index source read the same
    top-k ids, one tensor):
    * the window part of the row lists, per W: it depends only on the step's positions, sequences and starts;
    * the pool's flat block ids (the block table's);
    * the whole row lists and counts of the last index source, reused while a layer passes the same `comp_idx`
      tensor (by identity: top-k ids are a new tensor every step and never written in place) and sizes.
    Each call still copies its own keys (chunk KV, rings, pool blocks) into a fresh scratch: three copies.

    Row order: every pool row (>= T + B·W) lies above every ring row (>= T) above every chunk row, so a query's
    descending list is its groups' rows, descending, then its window rows, descending, then -1 padding; the
    window part is sorted once per step, the groups once per index source, and the two are joined with one
    scatter. The step is recognised by the identity of its index tensors (held until the next step, so no other
    tensor can take their ids): callers must not rewrite a step's index tensors or top-k ids in place between its
    layers, nor reuse them for another step's values. The model does neither: a Batch's tensors are fixed, static
    decode buffers are seen through new views each step (DecodeBuffers.batch), and CUDA-graph capture never
    reaches FlashMLA (flashmla_attention.supported)."""
    step: tuple[torch.Tensor, ...] = ()  # (positions, seq_of, slots, start_pos) of the step served
    window: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # W -> rows [T, W], count
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None  # (block_table, its flat block ids, -1 -> block 0)
    lists: _RowLists | None = None

    def scratch_keys(self, kv_new, window, positions, seq_of, slots, start_pos, comp=None, block_table=None,
                     comp_idx=None, width_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv [N, D], rows [T, n] int32, count [T] int32) exactly as `scratch_keys` lays them out."""
        step = (positions, seq_of, slots, start_pos)
        if len(self.step) != 4 or any(a is not b for a, b in zip(step, self.step)):
            self.step, self.window, self.blocks, self.lists = step, {}, None, None
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
            new, ring = window_rows(positions, seq_of, torch.arange(B, device=slots.device), start_pos, W)
            rows = torch.where(ring >= 0, ring + T, new).to(torch.int32).sort(dim=-1, descending=True).values
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


_STEP_ROWS = StepRows()  # the current step's (FlashMLA path only)


def flashmla_attention(q, kv_new, window, sink, positions, seq_of, slots, start_pos, scale, comp=None,
                       block_table=None, comp_idx=None, ratio: int = 1, rope_out=None) -> torch.Tensor:
    """`sparse_attention` through FlashMLA's sparse prefill kernel over the step's scratch keys (`StepRows`). The
    output's inverse RoPE is a separate pass (the library has no epilogue for it), over the rotated channels only,
    in place: the others are left as the kernel wrote them."""
    from mini.kernels.flashmla_attention import TOPK_MULTIPLE, sparse_prefill
    kv, rows, count = _STEP_ROWS.scratch_keys(kv_new, window, positions, seq_of, slots, start_pos, comp,
                                              block_table, comp_idx, TOPK_MULTIPLE)
    out = sparse_prefill(q, kv, rows, count, sink, scale)
    if rope_out is not None:
        tail = out[..., -2 * rope_out.shape[-1]:]
        tail.copy_(apply_rope(tail, rope_out, inverse=True))
    return out


_SPARSE_BACKEND: str | None = None  # "triton", "flashmla", or "auto-flashmla" (FlashMLA, its first call checked)


def sparse_backend() -> str:
    """The fast path's kernel, resolved once per process from MINI_SPARSE_ATTN = auto (default: FlashMLA where it
    imports on an SM90 GPU, kept only if its first output matches ours) | flashmla | triton. Steps FlashMLA does
    not serve (decode-sized, other head counts or widths, CUDA-graph capture) run the Triton kernel either way."""
    global _SPARSE_BACKEND
    if _SPARSE_BACKEND is None:
        from mini.kernels.flashmla_attention import available
        _SPARSE_BACKEND = library_choice("MINI_SPARSE_ATTN", "flashmla", available)
    return _SPARSE_BACKEND


def _fast(q, kv_new, window, sink, positions, seq_of, slots, start_pos, scale, comp, block_table, comp_idx, ratio,
          rope_out) -> torch.Tensor:
    from mini.kernels import flashmla_attention as flashmla
    from mini.kernels.sparse_attention import sparse_mla_attention
    args = (q, kv_new, window, sink, positions, seq_of, slots, start_pos, scale, comp, block_table, comp_idx, ratio,
            rope_out)
    backend = sparse_backend()
    if backend != "triton":
        with_pool = comp_idx is not None and comp_idx.shape[-1] > 0
        keys = [kv_new, window] + ([comp] if with_pool else [])
        scratch_rows = kv_new.shape[0] + slots.shape[0] * window.shape[1]  # scratch_keys' kv
        scratch_rows += block_table.shape[0] * block_table.shape[1] * comp.shape[1] if with_pool else 0
        if flashmla.supported(q, keys, scratch_rows):
            return flashmla_attention(*args) if backend == "flashmla" else _first_flashmla_call(args)
    return sparse_mla_attention(*args)


def _first_flashmla_call(args) -> torch.Tensor:
    """MINI_SPARSE_ATTN=auto: run both kernels once and keep FlashMLA for the process only if it ran and matched
    ours on every token (a library we only hold as a binary must cost one comparison when it is wrong, not a
    model's output). One device sync, once per process."""
    global _SPARSE_BACKEND
    from mini.kernels.sparse_attention import sparse_mla_attention
    ours = sparse_mla_attention(*args)
    try:
        diff = (flashmla_attention(*args).float() - ours.float()).flatten(1).norm(dim=1)
        err = float((diff / ours.float().flatten(1).norm(dim=1).clamp_min(1e-30)).max())
        problem = None if err < AUTO_CHECK_TOL else f"differs from the Triton kernel's by {err:.3g} on a token"
    except Exception as e:  # the library's shape/arch checks raise before launching; a changed API raises too
        problem = f"failed ({type(e).__name__}: {str(e)[:200]})"
    if problem:
        warnings.warn(f"MINI_SPARSE_ATTN=auto: FlashMLA's sparse prefill {problem}; using the Triton kernel")
    _SPARSE_BACKEND = "triton" if problem else "flashmla"
    return ours
