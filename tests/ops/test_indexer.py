"""Lightning indexer: scores over visible groups read through the block table, candidate blocks, top-k rules."""
import pytest
import torch

import mini.ops.indexer as indexer_op
from mini.ops.indexer import hadamard, index_scores, select_candidates, top_groups, topk_recent

NEG = float("-inf")


def test_scores_match_a_loop_and_respect_visibility(monkeypatch):
    monkeypatch.setattr(indexer_op, "GATHER_ELEMENTS", 2 * 11 * 32)  # blocks of 2 queries
    g = torch.Generator().manual_seed(0)
    H, di, per_block, ratio = 3, 32, 4, 2
    pool = torch.randn(6 * per_block, di, generator=g)
    blocks = [[5, 1, 3], [0, 4, 2]]
    # sequence 0: queries at positions 9..12; sequence 1: one query at position 21
    positions = torch.tensor([9, 10, 11, 12, 21])
    seq_of = torch.tensor([0, 0, 0, 0, 1])
    n_visible = (positions + 1) // ratio
    N = 11
    j = torch.arange(N)
    seq_rows = torch.stack([torch.tensor(b)[j // per_block] * per_block + j % per_block for b in blocks])
    seq_rows[0, 7:] = -1  # sequence 0 has 13 positions: groups 0..5 complete, 6 open (not in the pool yet)
    q = torch.randn(5, H, di, generator=g)
    w = torch.randn(5, H, generator=g)
    out = torch.full((5, N), float("nan"))
    out[:] = index_scores(q, w, pool, seq_rows, seq_of, n_visible)
    for t in range(5):
        for jj in range(N):
            if jj >= n_visible[t]:
                assert out[t, jj] == NEG
            else:
                k = pool[seq_rows[seq_of[t], jj]]
                ref = ((q[t] @ k).relu() * w[t]).sum()
                torch.testing.assert_close(out[t, jj], ref, atol=1e-5, rtol=1e-5)
    assert out[0, 4].isfinite() and out[0, 5] == NEG  # position 9 sees groups 0..4 (positions 0..9)


def test_candidate_blocks_force_the_newest_and_keep_the_best():
    # one query, 11 visible groups in blocks of 4: blocks 0, 1 full, block 2 partial (groups 8..10)
    s = torch.tensor([[5.0, 0, 0, 0, 1, 9, 1, 1, 0.5, 0.1, 0.2, NEG, NEG, NEG]])
    keep = select_candidates(s, torch.tensor([11]), topk_blocks=2, block_size=4)
    # best block is 1 (max 9); block 2 (holding the newest group 10) is forced in; block 0 (max 5) is dropped.
    # The mask covers whole blocks (group 11 is not visible yet: its score stays -inf anyway)
    assert keep.tolist() == [[False] * 4 + [True] * 8 + [False] * 2]
    # more blocks allowed than reachable: unreachable blocks never come back
    keep = select_candidates(s, torch.tensor([11]), topk_blocks=8, block_size=4)
    assert keep[0, :11].all() and not keep[0, 12:].any()
    # nothing visible: nothing kept, no block forced
    assert not select_candidates(torch.full((1, 6), NEG), torch.tensor([0]), 2, 4).any()


def test_top_groups_sorted_minus_one_padded_and_ties_go_to_newer_groups():
    s = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0, NEG], [NEG, 2.0, NEG, NEG, NEG, NEG]])
    ids = top_groups(s, 3)
    assert ids[0].tolist() == [1, 3, 4]  # 3.0, 1.0, then the newest of the tied zeros
    assert ids[1].tolist() == [-1, -1, 1]
    assert top_groups(s, 10).shape == (2, 6)  # k is capped at the number of groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the 32-bit key path
def test_topk_recent_equals_a_stable_sort_that_prefers_newer_entries(dtype):
    g = torch.Generator().manual_seed(2)
    specials = torch.tensor([0.0, -0.0, 1.5, NEG, float("inf"), -3.0])
    for _ in range(50):
        x = torch.randn(5, 37, generator=g)
        pick = torch.randint(0, 9, (5, 37), generator=g)  # about 2/3 of the entries become a tied special value
        x = torch.where(pick < 6, specials[pick.clamp(max=5)], x).to(dtype)
        k = int(torch.randint(1, 38, (), generator=g))
        values, indices = topk_recent(x, k)
        v, order = x.float().flip(-1).sort(dim=-1, descending=True, stable=True)
        assert torch.equal(indices, 36 - order[:, :k])
        assert torch.equal(values.float(), v[:, :k])
        _, unsorted = topk_recent(x, k, sorted=False)  # the same set
        assert torch.equal(unsorted.sort(-1).values, indices.sort(-1).values)


def test_topk_recent_on_bf16_rows_wider_than_the_32_bit_keys():
    """bf16 rows of more than 2^16 entries take the int64 keys (a 1M span's ratio-1 indexer): the same stable
    sort's picks, ties (zeros of both signs, -inf) to the newer entry, and the fp32 rows' keys' order."""
    g = torch.Generator().manual_seed(3)
    N = (1 << 16) + 37
    specials = torch.tensor([0.0, -0.0, 1.5, NEG, -3.0])
    x = torch.randn(3, N, generator=g)
    pick = torch.randint(0, 8, (3, N), generator=g)
    x = torch.where(pick < 5, specials[pick.clamp(max=4)], x).to(torch.bfloat16)
    for k in (1, 512, N):
        values, indices = topk_recent(x, k)
        v, order = x.float().flip(-1).sort(dim=-1, descending=True, stable=True)
        assert torch.equal(indices, N - 1 - order[:, :k])
        assert torch.equal(values.float(), v[:, :k])
    assert torch.equal(topk_recent(x, 512)[1], topk_recent(x.float(), 512)[1])  # the fp32 keys pick the same


def test_reindex_sources_only_pick_inside_the_candidates():
    g = torch.Generator().manual_seed(1)
    T, N = 7, 40
    n_vis = torch.tensor([3, 9, 17, 25, 33, 39, 40])
    vis = torch.arange(N) < n_vis[:, None]
    source = torch.randn(T, N, generator=g).masked_fill(~vis, NEG)
    cand = select_candidates(source, n_vis, topk_blocks=3, block_size=4) & vis
    own = torch.randn(T, N, generator=g).masked_fill(~vis, NEG).masked_fill(~cand, NEG)
    ids = top_groups(own, 6)
    picked = torch.zeros(T, N, dtype=torch.bool)
    for t in range(T):
        picked[t, ids[t][ids[t] >= 0]] = True
    assert (picked <= cand).all()
    assert (picked.sum(1) == torch.minimum(cand.sum(1), torch.tensor(6))).all()


def test_hadamard_is_the_normalised_walsh_transform():
    x = torch.randn(5, 128, dtype=torch.float64)

    def fwht(v):  # iterative butterflies, natural (Sylvester) order
        v = v.clone()
        h = 1
        while h < v.shape[-1]:
            a = v.view(*v.shape[:-1], -1, 2, h)
            a[..., 0, :], a[..., 1, :] = a[..., 0, :] + a[..., 1, :], a[..., 0, :] - a[..., 1, :]
            h *= 2
        return v / v.shape[-1] ** 0.5

    torch.testing.assert_close(hadamard(x.float()).double(), fwht(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hadamard(hadamard(x.float())).double(), x, atol=1e-5, rtol=1e-5)


def test_tie_rule_is_the_ops_choice(monkeypatch):
    """`tie_widths`: the official reference's ranking (each sequence's width) on the reference backend only;
    ties to the newer group (None) in the deterministic mode and with RANK_AS_OFFICIAL off."""
    import mini.ops
    from mini.ops import indexer
    scores, tok_end = torch.zeros(3, 5), torch.tensor([8, 8, 17])
    with mini.ops.using_backend("reference"):
        assert indexer.tie_widths(scores, tok_end, 4).tolist() == [2, 2, 4]
        with mini.ops.deterministic_mode():
            assert indexer.tie_widths(scores, tok_end, 4) is None
        monkeypatch.setattr(indexer, "RANK_AS_OFFICIAL", False)
        assert indexer.tie_widths(scores, tok_end, 4) is None
