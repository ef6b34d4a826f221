"""Lightning indexer (spec §2.4.5): picks, per query, the `index_topk` compressed groups it attends to.

score[t, j] = Σ_h relu(q[t,h] · k[j]) · w[t,h] over the groups j visible to query t (j < (pos+1) // ratio), in the
activation dtype as the reference computes it. V4.1 adds a two-level top-k: the candidate source keeps the best
`topk_blocks` blocks of `block_size` groups (the block of the newest visible group always), and later index sources
only score inside them. Results are absolute group ids, -1 = none; equal scores prefer the newer group.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from mini.formats import fake_quant_fp4
from mini.ops import deterministic, use_fast

if TYPE_CHECKING:
    from mini.ops.step_plan import StepPlan

GATHER_ELEMENTS = 1 << 25  # the reference gathers the keys of a block of queries at once: at most this many values
# The reference backend ranks groups as the official code does (`widths` of select_candidates / top_groups): its
# choice among exactly equal scores depends on the row's width, so prefill, chunked prefill and decode may keep
# different groups at a tie, as the official code's own do. False: ties go to the newer group everywhere (the fast
# path's rule, layout-invariant), for tests that compare layouts with each other.
RANK_AS_OFFICIAL = True


def tie_rule(fast: bool) -> str:
    """How the indexer ranks exactly equal scores in a step whose tensors the fast path serves (`fast`) or not:
    "official" (the official reference's rule: torch.topk at each sequence's width, so prefill, chunked prefill and
    decode may keep different groups at a tie) on the reference backend outside the deterministic mode with
    RANK_AS_OFFICIAL; else "newer" (ties go to the newer group: the fast path's and the deterministic mode's rule,
    the same in every layout)."""
    return "official" if RANK_AS_OFFICIAL and not fast and not deterministic() else "newer"


def tie_widths(scores: torch.Tensor, tok_end: torch.Tensor, ratio: int, step: StepPlan | None = None
               ) -> torch.Tensor | None:
    """The `widths` argument of `select_candidates` / `top_groups` for this step under its tie rule (`step`'s, or
    `tie_rule` for `scores`' device): each query's sequence's groups at the step's end (`tok_end` [T] // ratio)
    for the official rule, else None."""
    rule = step.tie_rule if step is not None else tie_rule(use_fast(scores))
    return tok_end // ratio if rule == "official" else None


@lru_cache(maxsize=8)
def _hadamard_matrix(n: int, device: torch.device) -> torch.Tensor:
    """Sylvester-ordered Walsh–Hadamard matrix scaled by n^-0.5 (orthonormal and symmetric, so x @ H = x @ H^T), on
    `device` once (a copy from the host cannot run in a captured CUDA graph)."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * n ** -0.5).to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """V4's `rotate_activation`: the normalised Walsh–Hadamard transform of the last dim, fp32 math."""
    return torch.nn.functional.linear(x.float(), _hadamard_matrix(x.shape[-1], x.device)).to(x.dtype)


def quantize_index(x: torch.Tensor, rotate: bool) -> torch.Tensor:
    """Index q / k after RoPE: (V4: Hadamard, then) FP4 1x32 with ue8m0 scales."""
    return fake_quant_fp4(hadamard(x) if rotate else x, 32, "ue8m0")


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq_rows: torch.Tensor,
                 seq_of: torch.Tensor, n_visible: torch.Tensor, step_table=None,
                 candidates: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, di], weights [T, H] (scale folded in), keys [P, di] (flat pool), seq_rows [B, N] pool row of each
    sequence's group j, n_visible [T] -> [T, N] scores in q.dtype (the reference rounds the head sum to it), -inf
    where the group is not visible or, given `candidates` (bool [T, N], V4.1's level one), not a candidate.
    `step_table`: the step's `StepLayout.table` (what its layers share, built once: the kernel's grid plan); None:
    built for this call. The kernel does not read the keys of groups no query may see."""
    if use_fast(q) and q.dtype == torch.bfloat16:
        from mini.kernels.indexer_scores import index_scores as index_scores_kernel, programs, supported
        if supported(q.shape[1], q.shape[2]):
            B, H = seq_rows.shape[0], q.shape[1]
            plan = None if step_table is None else step_table(("index_programs", B, H),
                                                              lambda: programs(seq_of, B, H))
            return index_scores_kernel(q, weights, keys, seq_rows, seq_of, n_visible, candidates, plan=plan)
    T, N = q.shape[0], seq_rows.shape[1]
    out = torch.empty(T, N, dtype=q.dtype, device=q.device)
    j = torch.arange(N, device=q.device)
    step = max(1, GATHER_ELEMENTS // (N * q.shape[-1]))
    for lo in range(0, T, step):
        hi = min(lo + step, T)
        k = keys[seq_rows[seq_of[lo:hi]].clamp_min(0)].to(q.dtype)  # [t, N, di]
        s = torch.einsum("thd,tnd->thn", q[lo:hi], k).relu()
        s = (s * weights[lo:hi, :, None].to(q.dtype)).sum(dim=1)
        out[lo:hi] = s.masked_fill(j >= n_visible[lo:hi, None], float("-inf"))
    return out if candidates is None else out.masked_fill_(~candidates, float("-inf"))


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """Integer keys ordered as x's values, then by index: order-preserving bits of the value above the index.
    bf16 rows of at most 2^16 entries fit int32 (16 + 16 bits: half the bytes and radix passes), others int64.
    The fast path computes the int32 keys in one kernel (mini/kernels/order_keys.py) instead of seven."""
    if use_fast(x):
        from mini.kernels.order_keys import order_keys, supported
        if supported(x):
            return order_keys(x)
    x = x + 0.0  # turns -0.0 into 0.0: they tie
    N = x.shape[-1]
    if x.dtype == torch.bfloat16:
        bits = x.view(torch.int16)
        value = bits ^ ((bits >> 15) & 0x7FFF)  # 16-bit order key; negative: larger magnitude, smaller key
        if N <= 1 << 16:
            return (value.int() << 16) | torch.arange(N, dtype=torch.int32, device=x.device)
        # wider rows: the key above a 32-bit index, shifted in place: ~14 bytes an entry at the peak against ~30
        # through fp32 bits (the verify graphs of a 1M span ran an emulated rank out of memory there, docs/perf/042)
        return value.long().bitwise_left_shift_(32).bitwise_or_(torch.arange(N, device=x.device))
    index = torch.arange(N, device=x.device)
    bits = x.float().contiguous().view(torch.int32).long()
    return (torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) << 32) | index


def topk_recent(x: torch.Tensor, k: int, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of x (fp32 or bf16); equal values go to the higher
    index (the newer group); `sorted=False` returns them in any order. Ties are common: relu makes every group with
    no positive head score exactly 0, and a plain top-k would then pick by layout, so that prefill, chunked prefill
    and decode could choose differently. One top-k over integer keys (value, then index) does it in a single pass."""
    indices = _order_keys(x).topk(k, dim=-1, sorted=sorted).indices
    return x.gather(-1, indices), indices


def select_candidates(scores: torch.Tensor, n_visible: torch.Tensor, topk_blocks: int, block_size: int,
                      widths: torch.Tensor | None = None) -> torch.Tensor:
    """Level one of V4.1's two-level top-k: bool [T, N], True inside the kept blocks. A block scores its best
    group; the block of the newest visible group is forced in (it is only partly filled); unreachable blocks
    (score -inf) are never kept. Ties go to the newer block; with `widths` ([T]: the groups of each query's
    sequence at the step's end) they are the official reference's instead (`_by_width`)."""
    if widths is not None:
        return _by_width(scores, widths, torch.zeros_like(scores, dtype=torch.bool),
                         lambda s, rows: _official_candidates(s, n_visible[rows], topk_blocks, block_size))
    N = scores.shape[-1]
    blocks = torch.nn.functional.pad(scores, (0, -N % block_size), value=float("-inf"))
    blocks = blocks.unflatten(-1, (-1, block_size)).amax(-1)
    newest = ((n_visible - 1) // block_size)[:, None]  # -1 when nothing is visible: no block forced
    blocks = blocks.masked_fill(torch.arange(blocks.shape[-1], device=scores.device) == newest, float("inf"))
    values, indices = topk_recent(blocks, min(topk_blocks, blocks.shape[-1]), sorted=False)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, indices, values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[:, :N]


def _by_width(scores: torch.Tensor, widths: torch.Tensor, out: torch.Tensor, fn) -> torch.Tensor:
    """`out` with out[rows, :w] = fn(scores[rows, :w], rows) for the rows of each width w: the official reference
    ranks one sequence's [queries, end // ratio] scores with torch.topk, whose choice among equal scores depends on
    the row's length, so each row is ranked at its own sequence's width (a loop over the step's distinct widths)."""
    for w in torch.unique(widths).tolist():
        rows = torch.nonzero(widths == w).flatten()
        if w > 0:
            got = fn(scores[rows, :w], rows)
            out[rows, :got.shape[1]] = got
    return out


def _official_candidates(scores: torch.Tensor, n_visible: torch.Tensor, topk_blocks: int,
                         block_size: int) -> torch.Tensor:
    """The reference's `select_candidate_blocks` on rows of one width: a sorted torch.topk of the block scores."""
    width = scores.shape[-1]
    blocks = torch.nn.functional.pad(scores, (0, -width % block_size), value=float("-inf"))
    blocks = blocks.unflatten(-1, (-1, block_size)).amax(-1)
    newest = ((n_visible - 1) // block_size)[:, None]
    blocks = blocks.masked_fill(torch.arange(blocks.shape[-1], device=scores.device) == newest, float("inf"))
    top = blocks.topk(min(topk_blocks, blocks.shape[-1]), dim=-1)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[:, :width]


def top_groups(scores: torch.Tensor, k: int, n_visible: torch.Tensor | None = None,
               widths: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [T, min(k, N)]: the best-scoring groups in ascending order, -1 where fewer are reachable; ties go to
    the newer group. With `widths` (and `n_visible`, [T] each) the official reference's selection instead: per
    query, torch.topk(min(k, width)) of its sequence's `width` scores, ascending, ids at or past n_visible -> -1
    (a visible group outside the candidate blocks can then be kept, when too few candidates are visible)."""
    if widths is not None:
        def official(s: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            ids = s.topk(min(k, s.shape[-1]), dim=-1, sorted=False).indices.sort(dim=-1).values
            return torch.where(ids < n_visible[rows, None], ids, -1)
        out = torch.full((scores.shape[0], min(k, scores.shape[-1])), -1, dtype=torch.int64, device=scores.device)
        return _by_width(scores, widths, out, official)
    values, indices = topk_recent(scores, min(k, scores.shape[-1]), sorted=False)
    ids = torch.where(values > float("-inf"), indices, -1)
    return ids.sort(dim=-1).values


def ordered_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, K] with each query's valid group ids first, in their order, then the -1s; [T] int32: how many are
    valid). Every attention path reads a query's groups in this order (and the same set in any order), so an index
    source's top-k is ordered once and the layers reading it pass the count as `sparse_attention`'s `comp_valid`:
    our kernel then skips ordering and counting them in every layer (issue 28)."""
    ids = ids.gather(-1, torch.sort((ids < 0).to(torch.int8), dim=-1, stable=True).indices)
    return ids, (ids >= 0).sum(-1, dtype=torch.int32)


def top_groups_ordered(scores: torch.Tensor, k: int, n_visible: torch.Tensor | None = None,
                       widths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ordered_ids(top_groups(scores, k, n_visible, widths)): an index source's top-k in the order attention reads
    it, with the count. Without `widths` (ties to the newer group, the fast path's rule) from the top-k's own sort:
    the ids sorted with N in place of -1, then -1 again (three small kernels fewer per index source); on the fast
    path one kernel, which given `n_visible` (the scores past each row's are -inf) reads only the visible columns."""
    if widths is not None:  # the official rule's ids: -1s anywhere
        return ordered_ids(top_groups(scores, k, n_visible, widths))
    N = scores.shape[-1]
    if use_fast(scores):  # the same ids in one kernel (mini/kernels/top_ids.py) where it is faster
        from mini.kernels.top_ids import build_for, supported, top_ids
        block = build_for(scores.shape[0], N, n_visible is not None)
        if block is not None and supported(scores, min(k, N)):  # (past n_visible: -inf, index_scores')
            return top_ids(scores, min(k, N), block=block, n_visible=n_visible)
    values, indices = topk_recent(scores, min(k, N), sorted=False)
    valid = values > float("-inf")
    ids = torch.where(valid, indices, N).sort(dim=-1).values  # N: after every group id
    return torch.where(ids < N, ids, -1), valid.sum(-1, dtype=torch.int32)
