"""KVCache pools follow the layer plan; the sizing helpers equal what the pools allocate."""
import pytest
import torch

from mini.config import preset
from mini.model import KVCache


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name,block_tokens", [("tiny-v4.1", 16), ("tiny-v4", 128)])
def test_pools_and_sizes(name, block_tokens):
    cfg = preset(name)
    n_slots, n_blocks = 3, 5
    c = KVCache(cfg, n_slots, n_blocks, block_tokens, "cpu", torch.bfloat16)
    assert len(c.window) == cfg.n_layers and c.window[0].shape == (n_slots, cfg.window_size, cfg.head_dim)
    assert sorted(c.comp_kv) == list(cfg.kv_cache_layers) and sorted(c.index_k) == list(cfg.index_key_layers)
    for layer, pool in c.comp_kv.items():
        assert pool.shape == (n_blocks, block_tokens // cfg.compress_ratios[layer], cfg.head_dim)
    paged = _bytes(list(c.comp_kv.values()) + list(c.index_k.values()))
    per_slot = _bytes(c.window) + _bytes([t for s in (*c.comp_state.values(), *c.index_state.values()) for t in s])
    per_slot += _bytes([c.keys.fresh])
    assert KVCache.bytes_per_block(cfg, block_tokens, torch.bfloat16) * n_blocks == paged
    assert KVCache.bytes_per_slot(cfg, torch.bfloat16) * n_slots == per_slot


@pytest.mark.parametrize("name", ["tiny-v4.1", "tiny-v4"])
def test_key_store_holds_rings_and_pools(name):
    """Every window ring and compressed pool is a view of the one KeyStore, at disjoint rows, the fresh rows last;
    `row_of` finds each view's first row and refuses a tensor outside the store."""
    cfg = preset(name)
    c = KVCache(cfg, 3, 5, 128, "cpu", torch.bfloat16)
    rows, seen = c.keys.rows, []
    for view in [*c.window, *c.comp_kv.values()]:
        at = c.keys.row_of(view)
        assert at is not None and view.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
        n = view.shape[0] * view.shape[1]
        assert torch.equal(rows[at:at + n], view.reshape(n, -1))
        seen.append((at, at + n))
    fresh = c.keys.row_of(c.keys.fresh)
    seen.sort()
    assert all(a[1] <= b[0] for a, b in zip(seen, seen[1:])) and seen[-1][1] <= fresh
    assert fresh + c.keys.fresh.shape[0] == rows.shape[0] and c.keys.fresh.shape[0] == 3 * 8
    c.window[1][2, 5].fill_(7.0)  # a write through a view lands in the store
    assert rows[c.keys.row_of(c.window[1]) + 2 * cfg.window_size + 5].eq(7.0).all()
    assert c.keys.row_of(torch.zeros(4, cfg.head_dim, dtype=torch.bfloat16)) is None
    assert c.keys.row_of(c.index_k[next(iter(c.index_k))]) is None  # the index keys are not attention keys


def test_state_rows():
    c41, c4 = preset("tiny-v4.1"), preset("tiny-v4")
    v41, v4 = KVCache(c41, 2, 1, 16), KVCache(c4, 2, 1, 128)
    # V4.1: only the ratio-2 KV source keeps open groups (2 rows); ratio 1 emits every token
    assert set(v41.comp_state) == {2} and v41.comp_state[2][0].shape == (2, 2, c41.head_dim)
    assert v41.index_state == {}
    # V4 ratio 4 overlaps: 8 rows of both channel halves; ratio 128: 128 rows
    assert v4.comp_state[2][0].shape == (2, 8, 2 * c4.head_dim) and v4.comp_state[3][0].shape == (2, 128, c4.head_dim)
    assert v4.index_state[2][1].shape == (2, 8, 2 * c4.index_head_dim) and v4.comp_state[2][1].dtype == torch.float32


def test_block_tokens_must_fit_every_ratio():
    with pytest.raises(ValueError, match="multiple"):
        KVCache(preset("tiny-v4"), 1, 1, 64)
