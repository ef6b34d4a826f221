"""Block/slot allocation, prefix hits (blocks + snapshot), eviction."""
from mini.engine.block_manager import BlockManager
from mini.engine.sequence import SamplingParams, Sequence


def _seq(tokens, name="s"):
    return Sequence(name, list(tokens), SamplingParams(), seed=0)


def _run(bm, seq, upto):
    """Pretend a step computed `seq` up to `upto` tokens; returns the snapshot copy, if any."""
    assert bm.grow(seq, upto)
    seq.num_computed = upto
    return bm.commit(seq)


def test_grow_and_release():
    bm = BlockManager(n_blocks=5, block_tokens=4, n_seq_slots=2, enable_prefix_caching=False)
    a, b = _seq(range(10), "a"), _seq(range(3), "b")
    assert bm.admit(a) is None and bm.admit(b) is None and not bm.has_free_slot()
    assert bm.grow(a, 10) and len(a.blocks) == 3
    assert not bm.grow(b, 9) and b.blocks == []  # needs 3, 2 free: nothing taken
    assert bm.grow(b, 8) and bm.n_free_blocks == 0
    bm.release(a)
    assert bm.n_free_blocks == 3 and bm.has_free_slot() and a.slot == -1


def test_prefix_hit_needs_blocks_and_snapshot():
    bm = BlockManager(n_blocks=8, block_tokens=4, n_seq_slots=2, n_snapshots=2)
    a = _seq(range(10), "a")
    bm.admit(a)
    assert _run(bm, a, 7) is None  # not on a boundary
    snap = _run(bm, a, 8)
    assert snap is not None and snap.src == a.slot and snap.dst >= 2
    a_blocks = a.blocks[:2]
    bm.release(a)
    b = _seq(list(range(8)) + [50, 51], "b")
    restore = bm.admit(b)
    assert restore is not None and restore.src == snap.dst and restore.dst == b.slot
    assert b.num_computed == 8 and b.blocks == a_blocks
    # a prompt equal to the cached prefix still computes its last token: hit stops one block earlier
    c = _seq(range(8), "c")
    assert bm.admit(c) is None and c.num_computed == 0 and c.split_at == 4


def test_shared_blocks_are_refcounted_and_evicted_last():
    bm = BlockManager(n_blocks=4, block_tokens=2, n_seq_slots=3, n_snapshots=1)
    a = _seq(range(5), "a")
    bm.admit(a)
    _run(bm, a, 4)
    bm.release(a)
    b = _seq([0, 1, 2, 3, 9], "b")
    assert bm.admit(b) is not None and b.num_computed == 4
    shared = list(b.blocks)
    assert bm.grow(b, 5)
    c = _seq([7] * 3, "c")
    bm.admit(c)
    assert not bm.grow(c, 4)  # 1 block free: shared ones are in use
    bm.release(b)
    assert bm.grow(c, 4)  # unhashed blocks are handed out before cached ones
    assert not set(c.blocks) & set(shared)
    d = _seq([0, 1, 2, 3, 8], "d")
    assert bm.admit(d) is not None and d.blocks == shared
    assert bm.n_free_blocks == 0 and not bm.grow(c, 6)
    bm.release(d)  # cached again, and the only free blocks: c's growth must now evict one of them
    assert bm.grow(c, 6) and bm.admit(_seq([0, 1, 2, 3, 8], "e")) is None


def test_snapshot_lru_eviction_frees_slot():
    bm = BlockManager(n_blocks=16, block_tokens=2, n_seq_slots=1, n_snapshots=1)
    a = _seq(range(9), "a")
    bm.admit(a)
    first = _run(bm, a, 2)
    second = _run(bm, a, 4)
    assert first.dst == second.dst  # one snapshot slot: the older snapshot was dropped
    bm.release(a)
    b = _seq([0, 1, 5, 5], "b")
    assert bm.admit(b) is None  # the snapshot at 2 is gone


def test_pool_sizing_on_cpu_and_given():
    import torch

    from fake_model import FakeCache, FakeConfig, FakeModel
    from mini.engine.model_runner import CPU_CACHE_BYTES, size_cache
    cfg = FakeConfig()
    model = FakeModel(cfg)
    given = size_cache(model, "cpu", torch.float32, 4, 8, 2, 77, 0.9, 4096)
    assert (given.n_blocks, given.n_slots) == (77, 10)
    capped = size_cache(model, "cpu", torch.float32, 4, 8, 2, None, 0.9, 4096)
    assert capped.n_blocks == 8 * 4096 // 4  # the 1 GiB budget holds more than 8 sequences can use
    budget = size_cache(model, "cpu", torch.float32, 4, 8, 2, None, 0.9, 1 << 40)
    per_slot, per_block = FakeCache.bytes_per_slot(cfg, None), FakeCache.bytes_per_block(cfg, 4, None)
    assert budget.n_blocks == (CPU_CACHE_BYTES - 10 * per_slot) // per_block
