"""Parity of the indexer score kernel with mini.ops.indexer.index_scores (+ candidate masking), and of the top-k
that follows (mini.ops.indexer.top_groups) on its scores. Fresh random data, several sequences of odd lengths
mid-stream (chunked prefill and decode), shuffled pool blocks, NaN-poisoned output."""
import numpy as np
import pytest
import torch

from mini.ops.indexer import index_scores, select_candidates, top_groups

pytestmark = pytest.mark.usefixtures("reference_ops")


def make(flat_batch, lens, starts, H, DI, ratio, rpb, device, dtype):
    b = flat_batch(lens, starts, block_tokens=rpb * ratio, device=device)
    T = b.positions.numel()
    q = torch.randn(T, H, DI, device=device).to(dtype)
    w = (torch.randn(T, H, device=device) * 0.1).to(dtype)
    keys = torch.randn(b.n_blocks * rpb, DI, device=device).to(dtype)
    end = b.start_pos + b.lens
    N = int((end // ratio).max())
    j = torch.arange(N, device=device)
    per_block = rpb
    rows = b.block_table[:, (j // per_block)].long() * per_block + j % per_block
    seq_rows = torch.where(j < (end // ratio)[:, None], rows, -1)
    n_vis = (b.positions + 1) // ratio
    return b, q, w, keys, seq_rows, n_vis


def check(b, q, w, keys, seq_rows, n_vis, candidates=None, exact=True, **kw):
    from mini.kernels.indexer_scores import index_scores as kernel_scores
    got = kernel_scores(q, w, keys, seq_rows, b.seq_of, n_vis, candidates, **kw)
    ref = index_scores(q, w, keys, seq_rows, b.seq_of, n_vis)
    assert got.dtype == ref.dtype == q.dtype
    if candidates is not None:
        ref = ref.masked_fill(~candidates, float("-inf"))
    assert not got.isnan().any()
    assert torch.equal(got == float("-inf"), ref == float("-inf"))
    fin = ref > float("-inf")
    scale = ref[fin].float().abs().max()
    err = (got[fin].float() - ref[fin].float()).abs().max() / scale
    assert err < (1e-5 if exact else 2e-2), err
    # top-k: identical wherever the reference's k-th and (k+1)-th scores are apart by more than the score error
    k = 5
    a, r = top_groups(got, k), top_groups(ref, k)
    srt = ref.float().sort(-1, descending=True).values
    clear = (srt[:, k - 1] - srt[:, k]).abs() > 4 * err * scale if ref.shape[1] > k else torch.ones_like(n_vis).bool()
    assert torch.equal(a[clear], r[clear])
    return got


def test_index_scores_interpreter(interpreter, flat_batch):
    b, q, w, keys, seq_rows, n_vis = make(flat_batch, [9, 1, 6], [0, 37, 20], 4, 32, 2, 4, "cpu", torch.float32)
    check(b, q, w, keys, seq_rows, n_vis, block_t=4, block_n=16)
    cand = select_candidates(index_scores(q, w, keys, seq_rows, b.seq_of, n_vis), n_vis, 2, 4)
    check(b, q, w, keys, seq_rows, n_vis, cand, block_t=4, block_n=16)


def test_index_scores_tiles_per_program_interpreter(interpreter, flat_batch):
    """A program scoring several key tiles (a loop, then -inf past its tokens' last visible group) gives the bits
    of one tile a program, with tile counts that do not divide the key tiles (19 groups in 5 tiles of 4)."""
    from mini.kernels.indexer_scores import index_scores as kernel_scores
    b, q, w, keys, seq_rows, n_vis = make(flat_batch, [9, 1, 6], [0, 37, 20], 4, 32, 2, 4, "cpu", torch.float32)
    cand = select_candidates(index_scores(q, w, keys, seq_rows, b.seq_of, n_vis), n_vis, 2, 4)
    for c in (None, cand):
        one = check(b, q, w, keys, seq_rows, n_vis, c, block_t=4, block_n=4, tiles=1)
        for tiles in (2, 4, 8):
            got = kernel_scores(q, w, keys, seq_rows, b.seq_of, n_vis, c, block_t=4, block_n=4, tiles=tiles)
            assert torch.equal(got, one), tiles


def test_only_keys_a_token_may_see_are_read_interpreter(interpreter, flat_batch, monkeypatch):
    """A program reads only the keys its tokens may see: given candidates (V4.1's later index layers), every key
    address the interpreter loads lies in a row that some token sees as a candidate; without, in a visible row
    (and rows outside the candidates, so the check can fail)."""
    from triton.runtime import interpreter as triton_interpreter
    from mini.kernels.indexer_scores import index_scores as kernel_scores
    b, q, w, keys, seq_rows, n_vis = make(flat_batch, [1, 1, 3], [40, 37, 20], 4, 32, 1, 4, "cpu", torch.float32)
    cand = select_candidates(index_scores(q, w, keys, seq_rows, b.seq_of, n_vis), n_vis, 2, 4)
    loads = []
    load = triton_interpreter.InterpreterBuilder.create_masked_load

    def recorded(self, ptrs, mask, *rest):
        loads.append(ptrs.data[mask.data].astype("int64"))
        return load(self, ptrs, mask, *rest)

    monkeypatch.setattr(triton_interpreter.InterpreterBuilder, "create_masked_load", recorded)
    row_bytes = keys.shape[1] * keys.element_size()

    def rows_read(candidates):
        loads.clear()
        kernel_scores(q, w, keys, seq_rows, b.seq_of, n_vis, candidates, block_n=8, tiles=2)
        offsets = torch.from_numpy(np.concatenate(loads)) - keys.data_ptr()
        return set((offsets[(offsets >= 0) & (offsets < keys.numel() * keys.element_size())] // row_bytes).tolist())

    j = torch.arange(seq_rows.shape[1])
    visible = j < n_vis[:, None]
    allowed = set(seq_rows[b.seq_of][visible & cand].tolist())
    read = rows_read(cand)
    assert read and read <= allowed, sorted(read - allowed)
    read = rows_read(None)  # every visible group's key; the candidates are a strict subset here
    assert read - allowed and read <= set(seq_rows[b.seq_of][visible].tolist())


def test_tiles_per_program_keeps_the_grid_wide():
    from mini.kernels.indexer_scores import MAX_TILES, MIN_PROGRAMS, tiles_per_program
    assert tiles_per_program(2, 32) == 1  # B = 1 decode: every tile its own program
    for programs, n_tiles in ((1, 1), (3, 7), (384, 128), (384, 256), (2304, 64), (10, 5000)):
        t = tiles_per_program(programs, n_tiles)
        assert t & (t - 1) == 0 and 1 <= t <= MAX_TILES
        assert t == 1 or programs * -(-n_tiles // t) >= MIN_PROGRAMS  # wide enough
        assert t == MAX_TILES or programs * -(-n_tiles // (2 * t)) < MIN_PROGRAMS  # and the largest such


@pytest.mark.gpu
def test_index_scores_tiles_per_program_gpu(flat_batch):
    """At V4.1's indexer shape (32 heads x 128), decode rows of long sequences: the looped program's bits equal
    one tile a program's."""
    from mini.kernels.indexer_scores import index_scores as kernel_scores
    b, q, w, keys, seq_rows, n_vis = make(flat_batch, [1] * 7 + [33], [3001, 17, 4095, 900, 2500, 64, 1200, 1999],
                                          32, 128, 1, 64, "cuda", torch.bfloat16)
    one = kernel_scores(q, w, keys, seq_rows, b.seq_of, n_vis, tiles=1)
    for tiles in (2, 4, 8, 32):
        assert torch.equal(kernel_scores(q, w, keys, seq_rows, b.seq_of, n_vis, tiles=tiles), one), tiles


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2])
def test_index_scores_gpu(ratio, flat_batch):
    b, q, w, keys, seq_rows, n_vis = make(flat_batch, [517, 1, 250, 1], [0, 900, 301, 44], 32, 128, ratio, 64,
                                          "cuda", torch.bfloat16)
    cand = select_candidates(index_scores(q, w, keys, seq_rows, b.seq_of, n_vis), n_vis, 16, 8)
    for c in (None, cand):
        check(b, q, w, keys, seq_rows, n_vis, c, exact=False)
