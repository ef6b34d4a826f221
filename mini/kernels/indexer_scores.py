"""Lightning-indexer scores without a [tokens × groups × heads] tensor (mini/ops/indexer.py).

score[t, j] = Σ_h relu(q[t,h] · k[j]) · w[t,h] for the groups j < n_visible[t] of t's sequence, -inf elsewhere (and
outside the V4.1 candidate blocks when a mask is given). A program takes BLOCK_T consecutive tokens of ONE sequence
and BLOCK_N of its groups: the q rows of its tokens ([BLOCK_T·H, di], contiguous) meet one gathered key tile
[BLOCK_N, di] in a single dot, so each key tile is read once per BLOCK_T tokens; the head sum happens in registers.
Keys no token of the program may see (not yet visible, not a candidate) are not read.

Rounding follows the reference, which runs in the activation dtype: each head's dot and its weighted value are
rounded to that dtype, the head sum is fp32, and the sum is rounded once more and stored in that dtype. Top-k is
not this kernel's: `torch.topk` over the [T, N] scores (one row per token: the only full-size intermediate; bf16
scores let it run on 32-bit keys, see ops.indexer.topk_recent).
"""
import torch
import triton
import triton.language as tl


# One build whatever the step's size, so that a served step never meets a build the warm-up missed: the candidates'
# row stride is the step's group count rounded to a block or not (mini.ops.indexer.select_candidates pads, its
# official-tie form does not), and the tiles per program follow the step's tokens and groups (`tiles_per_program`;
# as a constexpr, bursts at the server's defaults compiled 4 and 8 after the warm-up: docs/perf/034)
@triton.jit(do_not_specialize=["stride_cand", "tiles"])
def _index_scores_kernel(
    q_ptr, w_ptr, k_ptr, rows_ptr, nvis_ptr, prog_seq_ptr, prog_t0_ptr, seq_end_ptr, cand_ptr, out_ptr,
    N, stride_rows, stride_cand, tiles,
    H: tl.constexpr, DI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_CAND: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    seq = tl.load(prog_seq_ptr + tl.program_id(0))
    if seq < 0:
        return
    t0 = tl.load(prog_t0_ptr + tl.program_id(0))
    t_end = tl.load(seq_end_ptr + seq)
    toks = t0 + tl.arange(0, BLOCK_T)
    tok_ok = toks < t_end
    nvis = tl.load(nvis_ptr + toks, mask=tok_ok, other=0)
    # this program's `tiles` consecutive key tiles: those that start below the last visible group are scored, the
    # rest only written -inf
    lo = tl.program_id(1) * (BLOCK_N * tiles)
    hi = tl.minimum(lo + BLOCK_N * tiles, N)
    scored_hi = tl.minimum(hi, tl.max(nvis, axis=0))

    r = tl.arange(0, BLOCK_T * H)  # q row r = token (r // H), head (r % H)
    row_tok = t0 + r // H
    row_ok = row_tok < t_end
    d = tl.arange(0, DI)
    q = tl.load(q_ptr + (t0 * H + r)[:, None].to(tl.int64) * DI + d[None, :], mask=row_ok[:, None], other=0.0)
    w = tl.load(w_ptr + t0 * H + r, mask=row_ok, other=0.0)
    for n0 in tl.range(lo, scored_hi, BLOCK_N, num_stages=LOOP_STAGES):
        j = n0 + tl.arange(0, BLOCK_N)
        krow = tl.load(rows_ptr + seq * stride_rows + j, mask=j < N, other=-1)
        out_ok = tok_ok[:, None] & (j < N)[None, :]
        visible = out_ok & (j[None, :] < nvis[:, None])
        if HAS_CAND:
            cand = tl.load(cand_ptr + toks[:, None].to(tl.int64) * stride_cand + j[None, :], mask=out_ok, other=0)
            visible = visible & (cand != 0)
        # a key no token of the program may see is not read (its scores are -inf whatever it holds): V4.1's later
        # index layers read only the candidate blocks' keys, half of them at 32K context
        krow = tl.where(tl.max(visible.to(tl.int32), axis=0) > 0, krow, -1)
        k = tl.load(k_ptr + tl.maximum(krow, 0)[:, None].to(tl.int64) * DI + d[None, :], mask=(krow >= 0)[:, None],
                    other=0.0)
        s = tl.dot(q, tl.trans(k)).to(q.dtype)  # [BLOCK_T·H, BLOCK_N], rounded like the reference einsum
        s = (tl.maximum(s, 0.0) * w[:, None]).to(q.dtype).to(tl.float32)
        score = tl.sum(tl.reshape(s, [BLOCK_T, H, BLOCK_N]), axis=1).to(q.dtype).to(tl.float32)
        tl.store(out_ptr + toks[:, None].to(tl.int64) * N + j[None, :],
                 tl.where(visible, score, float("-inf")).to(out_ptr.dtype.element_ty), mask=out_ok)
    hidden_lo = lo + tl.cdiv(tl.maximum(scored_hi - lo, 0), BLOCK_N) * BLOCK_N
    for n0 in range(hidden_lo, hi, BLOCK_N):  # nothing visible in these tiles
        j = n0 + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + toks[:, None].to(tl.int64) * N + j[None, :],
                 tl.full([BLOCK_T, BLOCK_N], float("-inf"), out_ptr.dtype.element_ty),
                 mask=tok_ok[:, None] & (j < N)[None, :])


def supported(heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this indexer shape: head count and head dim are tile dimensions (powers of two),
    and a dot needs K >= 16. Others run the reference (mini.ops.indexer.index_scores)."""
    return heads & (heads - 1) == 0 and head_dim & (head_dim - 1) == 0 and head_dim >= 16


def programs(seq_of: torch.Tensor, n_seqs: int, heads: int, block_t: int = 2) -> tuple:
    """The grid plan of `index_scores` for a step's tokens and its index head count: (block_t, each program's
    sequence, its first token, each sequence's end row). It depends on the step alone, so the step's indexer
    layers can share it (issue 28: ~17 small kernels each otherwise)."""
    block_t = max(block_t, 16 // heads)  # a dot needs at least 16 rows
    return (block_t, *_programs(seq_of, n_seqs, block_t))


def _programs(seq_of: torch.Tensor, n_seqs: int, block_t: int):
    """Per program: its sequence (-1 = idle) and first token, so that a program never mixes sequences. Built on
    the device without a sync; the grid is the upper bound cdiv(T, block_t) + n_seqs."""
    T, dev = seq_of.shape[0], seq_of.device
    lens = torch.zeros(n_seqs, dtype=torch.int64, device=dev).index_add_(0, seq_of, torch.ones_like(seq_of))
    first_row = torch.cumsum(lens, 0) - lens
    tiles = (lens + block_t - 1) // block_t
    tile_end = torch.cumsum(tiles, 0)
    n_prog = triton.cdiv(T, block_t) + n_seqs
    p = torch.arange(n_prog, device=dev)
    seq = torch.searchsorted(tile_end, p, right=True)
    live = seq < n_seqs
    seq = seq.clamp_max(n_seqs - 1)
    t0 = first_row[seq] + (p - (tile_end[seq] - tiles[seq])) * block_t
    return torch.where(live, seq, -1), t0, first_row + lens


# A program scores `tiles` consecutive key tiles of its tokens (q loaded once, the tiles' loads pipelined) where the
# grid keeps at least MIN_PROGRAMS programs; one tile each below that (B = 1 decode). One tile per program left
# decode at 256 x 32K latency-bound: 8 indexer layers 5.3 ms for ~2.3 ms of key bytes (docs/perf/025). Per call
# the loop is 1.6x faster there, but that step measured no faster with it (docs/perf/030: not yet explained).
MIN_PROGRAMS = 2048
MAX_TILES = 32


def tiles_per_program(programs: int, n_tiles: int) -> int:
    """The largest power of two <= MAX_TILES that keeps programs x cdiv(n_tiles, tiles) >= MIN_PROGRAMS (else 1)."""
    tiles = 1
    while tiles < MAX_TILES and programs * triton.cdiv(n_tiles, 2 * tiles) >= MIN_PROGRAMS:
        tiles *= 2
    return tiles


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq_rows: torch.Tensor,
                 seq_of: torch.Tensor, n_visible: torch.Tensor, candidates: torch.Tensor | None = None,
                 block_t: int = 2, block_n: int = 128, num_warps: int = 4, num_stages: int = 2,
                 plan: tuple | None = None, tiles: int | None = None, loop_stages: int = 3) -> torch.Tensor:
    """q [T, H, di], weights [T, H], keys [P, di] (flat pool), seq_rows [B, N] (-1 = not complete), seq_of [T],
    n_visible [T], optional candidates bool [T, N] -> [T, N] in q.dtype (-inf: not visible / not a candidate).
    `tiles`: key tiles per program (None: `tiles_per_program`); the scores' bits do not depend on it."""
    T, H, DI = q.shape
    B, N = seq_rows.shape
    out = torch.empty(T, N, dtype=q.dtype, device=q.device)
    if T == 0 or N == 0:
        return out
    q = q.contiguous()
    weights = weights.to(q.dtype).contiguous()
    keys, seq_rows = keys.to(q.dtype).contiguous(), seq_rows.contiguous()
    if not supported(H, DI):
        raise ValueError(f"index_scores kernel: {H} heads x {DI} need powers of two (head dim >= 16)")
    # `plan`: the step's `programs(seq_of, B, H, block_t)`, shared by its indexer layers (None: built here)
    block_t, prog_seq, prog_t0, seq_end = programs(seq_of, B, H, block_t) if plan is None else plan
    cand = candidates.view(torch.uint8) if candidates is not None else out
    assert cand.stride(-1) == 1
    n_tiles = triton.cdiv(N, block_n)
    tiles = tiles_per_program(prog_seq.shape[0], n_tiles) if tiles is None else tiles
    grid = (prog_seq.shape[0], triton.cdiv(n_tiles, tiles))
    _index_scores_kernel[grid](q, weights, keys, seq_rows, n_visible, prog_seq, prog_t0, seq_end, cand, out,
                               N, seq_rows.stride(0), cand.stride(0), tiles, H=H, DI=DI, BLOCK_T=block_t,
                               BLOCK_N=block_n, HAS_CAND=candidates is not None, LOOP_STAGES=loop_stages,
                               num_warps=num_warps, num_stages=num_stages)
    return out
