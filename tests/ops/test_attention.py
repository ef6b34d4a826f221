"""Sparse attention reading keys by index (window ring, fresh chunk, paged pool) vs a dense masked softmax."""
import math

import torch

import mini.ops.attention as attention_op
from mini.ops.attention import sparse_attention


def _dense_oracle(q, keys_per_query, sink, scale):
    """keys_per_query: list of [n_t, D] key sets; softmax over the keys plus the sink logit, K = V."""
    out = []
    for t, keys in enumerate(keys_per_query):
        logits = torch.einsum("hd,nd->hn", q[t].double(), keys.double()) * scale
        full = torch.cat([logits, sink.double()[:, None]], dim=1).softmax(-1)[:, :-1]
        out.append(full @ keys.double())
    return torch.stack(out)


def test_sparse_attention_matches_dense_masked_softmax():
    g = torch.Generator().manual_seed(3)
    H, D, W, ratio, per_block = 3, 24, 8, 2, 4  # block_tokens = 8
    n_slots, n_blocks = 5, 7
    # two sequences: a chunk of 5 starting at 11 (slot 3) and a decode at 20 (slot 1)
    starts, lens, slots = [11, 20], [5, 1], [3, 1]
    blocks = [[4, 0, 6], [2, 5, 3]]
    positions = torch.tensor([p for s, n in zip(starts, lens) for p in range(s, s + n)])
    seq_of = torch.tensor([b for b, n in enumerate(lens) for _ in range(n)])
    T = len(positions)
    q = torch.randn(T, H, D, generator=g)
    kv_new = torch.randn(T, D, generator=g)
    window = torch.randn(n_slots, W, D, generator=g)
    comp = torch.randn(n_blocks, per_block, D, generator=g)
    sink = torch.randn(H, generator=g)
    table = torch.tensor(blocks, dtype=torch.int32)
    comp_idx = torch.tensor([[0, 3, -1], [1, -1, -1], [5, 2, 0], [-1, -1, -1], [4, 1, 2], [9, 0, -1]])
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    out[:] = sparse_attention(q, kv_new, window, sink, positions, seq_of, torch.tensor(slots),
                              torch.tensor(starts), scale, comp, table, comp_idx, ratio)

    keys = []
    row0 = [0, 5]
    for t in range(T):
        b, p = int(seq_of[t]), int(positions[t])
        ks = []
        for kp in range(max(0, p - W + 1), p + 1):
            if kp >= starts[b]:
                ks.append(kv_new[row0[b] + kp - starts[b]])
            else:
                ks.append(window[slots[b], kp % W])
        for gid in comp_idx[t].tolist():
            if gid >= 0:
                ks.append(comp[blocks[b][gid // per_block], gid % per_block])
        keys.append(torch.stack(ks))
    ref = _dense_oracle(q, keys, sink, scale)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_window_only_layer_and_long_chunk_crosses_query_blocks(monkeypatch):
    """A long chunk gathered in several query blocks, no compressed pool: each query sees up to W keys."""
    g = torch.Generator().manual_seed(4)
    H, D, W, T = 2, 16, 128, 300
    monkeypatch.setattr(attention_op, "GATHER_ELEMENTS", 7 * 2 * W * D)  # blocks of 7 queries
    q = torch.randn(T, H, D, generator=g)
    kv_new = torch.randn(T, D, generator=g)
    window = torch.full((1, W, D), float("nan"))  # a fresh sequence never reads its ring
    sink = torch.zeros(H)
    positions = torch.arange(T)
    out = sparse_attention(q, kv_new, window, sink, positions, torch.zeros(T, dtype=torch.long),
                           torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), D ** -0.5)
    keys = [kv_new[max(0, t - W + 1): t + 1] for t in range(T)]
    torch.testing.assert_close(out.double(), _dense_oracle(q, keys, sink, D ** -0.5), atol=1e-5, rtol=1e-5)
    assert math.isfinite(out.abs().max().item())
