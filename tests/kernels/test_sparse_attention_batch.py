"""A sequence's sparse attention does not depend on the other sequences of its step: the official key-list order
(window width per sequence, softmax blocks of 64 over window + compressed entries) is built per sequence, in the
reference op and in the kernel, so a sequence alone and batched with prefills and decodes of other lengths give the
same bits. (A step-wide width made a prefill row's blocks move with its neighbours' lengths: the deterministic
mode's tests saw 12 of 24 greedy answers change under load on the H200.)"""
import pytest
import torch

from tests.kernels.test_sparse_attention import make_case

# (length, start) per sequence: fresh prefills shorter and longer than W, a decode, a continued chunk
SEQS = [(7, 0), (3, 0), (1, 19), (20, 0), (4, 9)]


def _alone(b, q, kv_new, comp_idx, s):
    """The inputs of sequence s as a step of its own (same caches and pools)."""
    rows = (b.seq_of == s).nonzero().squeeze(1)
    one = lambda t: t[s:s + 1]  # noqa: E731
    return (q[rows], kv_new[rows], b.positions[rows], torch.zeros_like(rows), one(b.slots), one(b.start_pos),
            one(b.block_table), None if comp_idx is None else comp_idx[rows]), rows


def _check(run, b, q, kv_new, comp_idx):
    both = run(q, kv_new, b.positions, b.seq_of, b.slots, b.start_pos, b.block_table, comp_idx)
    assert torch.isfinite(both).all()
    for s in range(len(SEQS)):
        args, rows = _alone(b, q, kv_new, comp_idx, s)
        alone = run(*args)
        assert torch.equal(alone, both[rows]), f"sequence {s} {SEQS[s]}: alone != batched"


def test_reference_key_lists_alone_equal_batched(flat_batch):
    """The reference op's window lists (and so where its compressed entries start, `_after_window`) are the same
    for a sequence alone and batched. (Its sums are not compared bitwise: torch's CPU reductions and MKL round a
    row differently with the padded list length; the kernel test below compares bits.)"""
    from mini.ops.attention import reference_window_rows
    W = 16
    b = flat_batch(*zip(*SEQS), block_tokens=8, device="cpu")

    def lists(positions, seq_of, slots, start_pos):
        new, ring, width = reference_window_rows(positions, seq_of, slots, start_pos, W)
        key = torch.where(new >= 0, positions[new.clamp_min(0)], -1)  # a fresh key by its position
        return [(k[:w].tolist(), r[:w].tolist(), int(w)) for k, r, w in zip(key, ring, width)]
    both = lists(b.positions, b.seq_of, b.slots, b.start_pos)
    for s, (n, start) in enumerate(SEQS):
        rows = (b.seq_of == s).nonzero().squeeze(1)
        alone = lists(b.positions[rows], torch.zeros_like(rows), b.slots[s:s + 1], b.start_pos[s:s + 1])
        assert alone == [both[r] for r in rows.tolist()], f"sequence {s} {SEQS[s]}"
        assert all(w == (min(n, W) if start == 0 else W) for _, _, w in alone)


@pytest.mark.parametrize("prefill_lists", [True, False])
@pytest.mark.parametrize("with_comp", [True, False])
def test_kernel_alone_equals_batched(with_comp, prefill_lists, interpreter, flat_batch):
    """Both list layouts: the official one (prefill lists min(chunk, W) wide) and the deterministic mode's."""
    from mini.kernels.sparse_attention import sparse_mla_attention
    H, D, W, ratio, rpb, topk = 4, 32, 16, 2, 4, 70
    b, q, kv_new, window, comp, sink, comp_idx = make_case(flat_batch, "cpu", torch.float32, *zip(*SEQS),
                                                           H, D, W, ratio, rpb, topk)

    def run(q, kv_new, positions, seq_of, slots, start_pos, block_table, comp_idx):
        out = torch.full_like(q, float("nan"))
        out.copy_(sparse_mla_attention(q, kv_new, window, sink, positions, seq_of, slots, start_pos, D ** -0.5,
                                       comp=comp, block_table=block_table,
                                       comp_idx=comp_idx if with_comp else None, ratio=ratio,
                                       prefill_lists=prefill_lists, block_h=8, block_n=64, num_warps=1))
        return out
    _check(run, b, q, kv_new, comp_idx)
    if not prefill_lists:  # the deterministic mode's W-wide lists hold the same keys: the float64 oracle's result
        from tests.kernels.test_sparse_attention import oracle
        ref = oracle(q, kv_new, window, comp, sink, b, comp_idx if with_comp else None, ratio, D ** -0.5)
        got = run(q, kv_new, b.positions, b.seq_of, b.slots, b.start_pos, b.block_table, comp_idx)
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
