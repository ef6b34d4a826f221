"""A verify step from static buffers (DecodeBuffers with `max_rows` > 1 -> DecodeLayout of width 1 + K, what a
CUDA graph per (B, width) captures) == the same verify chunks built by Batch.build (StepLayout), bit for bit (CPU,
fp32, the kernels' deterministic mode): the logits of every real row, and after `commit_drafts` every cache row of
a real sequence (rings, compressor states, compressed KV, index keys), for accept lengths 0..K, sequences with
different draft lengths (padding rows inside a sequence) beside padding sequences, frontiers across the ring's wrap
at 128, a block boundary and both ratio-2 parities; then a second verify step from the committed frontiers."""
import copy

import pytest
import torch

import mini.ops
from mini.model import Batch, KVCache, SeqChunk
from mini.model.static_decode import StaticDecodeInputs
from mini.model.batch import DecodeBuffers
from mini.step import DecodeRows

BT, K, MAX_LEN = 16, 5, 256
PROMPTS = [121, 124, 126, 127, 63, 30]  # frontiers cross 128 (the ring's wrap), 128 (a block), both parities
DRAFTS = [5, 5, 5, 3, 0, 2]  # a sequence without drafts (all padding rows) and short drafts beside full ones
ACCEPTS = [[0, 2, 5, 3, 0, 1], [1, 3, 4, 2, 0, 2], [5, 4, 0, 0, 0, 0]]  # every length 0..K of a 5-token draft


def _pools(cache):
    pools = list(cache.window) + list(cache.comp_kv.values()) + list(cache.index_k.values())
    for states in (cache.comp_state, cache.index_state):
        for kv_and_score in states.values():
            pools += list(kv_and_score)
    return pools


def _same_real_rows(got: KVCache, want: KVCache, pad_slot: int, pad_block: int, what: str) -> None:
    """Every pool row but the scratch slot's and block's, bit for bit (-inf == -inf, NaN never)."""
    for i, (g, w) in enumerate(zip(_pools(got), _pools(want))):
        real = torch.ones(g.shape[0], dtype=torch.bool)
        real[pad_slot if g.shape[0] == got.n_slots else pad_block] = False
        assert torch.equal(g[real], w[real]), f"{what}: cache pool {i}"


def _static(model, hasher, n_seqs, pad_slot, pad_block, on_device):
    engram = {}
    if hasher is not None and on_device:
        engram = {"engram_lookback": hasher.lookback}
    elif hasher is not None:
        engram = {"engram_shape": (*hasher.primes.shape, model.config.engram_head_dim)}
    bufs = DecodeBuffers(n_seqs, MAX_LEN, BT, pad_slot, pad_block, "cpu", engram_dtype=torch.float32,
                         max_rows=1 + K, **engram)
    return StaticDecodeInputs(bufs, hasher, model.engram_rows, model)


@pytest.mark.parametrize("on_device", [True, False])
def test_static_verify_step_equals_built_verify_step(tiny_model, on_device):
    model, hasher = tiny_model("tiny-v4.1")
    cfg = model.config
    n, nb = len(PROMPTS), MAX_LEN // BT
    slots = [3, 0, 5, 1, 2, 4]
    perm = torch.randperm(n * nb, generator=torch.Generator().manual_seed(3)).tolist()
    blocks = [perm[i * nb:(i + 1) * nb] for i in range(n)]
    pad_slot, pad_block = n, n * nb
    gen = torch.Generator().manual_seed(11)
    futures = [torch.randint(3, cfg.vocab_size, (p + 2 * (K + 1),), generator=gen).tolist() for p in PROMPTS]
    bucket = n + 2  # two padding sequences
    with mini.ops.deterministic_mode():
        eager = KVCache(cfg, n + 1, n * nb + 1, BT, "cpu", torch.float32)
        prefill = [SeqChunk(f[:p], 0, s, b, want_logits=False) for f, p, s, b in zip(futures, PROMPTS, slots, blocks)]
        model.forward(Batch.build(prefill, cfg, "cpu", hasher), eager)
        static = copy.deepcopy(eager)
        for pool in _pools(static):  # scratch rows start as garbage: a real sequence must never read them
            pool[pad_slot if pool.shape[0] == static.n_slots else pad_block] = float("nan")
        inputs = _static(model, hasher, bucket, pad_slot, pad_block, on_device)
        frontier = list(PROMPTS)  # the next position to feed: the sequence's token
        for step, accepts in enumerate(ACCEPTS[:2]):
            drafts = [f[p + 1:p + 1 + k] for f, p, k in zip(futures, frontier, DRAFTS)]
            chunks = [SeqChunk(f[:p + 1 + k], p, s, b, drafts=k)
                      for f, p, s, b, k in zip(futures, frontier, slots, blocks, DRAFTS)]
            want = model.forward(Batch.build(chunks, cfg, "cpu", hasher), eager)
            rows = DecodeRows(list(frontier), slots, blocks, lambda b, lo, hi: futures[b][lo:hi], drafts=drafts)
            inputs.fill(bucket, rows, width=1 + K)
            batch = inputs.batch(bucket, 1 + K)
            got = model.forward(batch, static)
            inputs.replayed(static)
            assert got.shape == (bucket * (1 + K), cfg.vocab_size)
            real = inputs.buffers.real_rows()
            assert len(real) == want.shape[0] == sum(1 + k for k in DRAFTS)
            assert torch.equal(got[real], want), f"logits of step {step}"
            assert model.target_features is None  # (no DSpark here: the engine's DSpark test reads them)
            # before the commit: everything a real sequence owns (the drafts are kept aside in both)
            _same_real_rows(static, eager, pad_slot, pad_block, f"step {step} before commit")
            for a in (ACCEPTS if step == 0 else [accepts]):
                e, s = copy.deepcopy(eager), copy.deepcopy(static)
                e.commit_drafts(a)
                s.commit_drafts(a)
                _same_real_rows(s, e, pad_slot, pad_block, f"step {step}, accepted {a}")
            eager.commit_drafts(accepts)
            static.commit_drafts(accepts)
            frontier = [p + 1 + a for p, a in zip(frontier, accepts)]


def test_static_verify_fill_checks():
    bufs = DecodeBuffers(max_seqs=4, max_len=64, block_tokens=16, pad_slot=9, pad_block=30, device="cpu",
                         max_rows=3)
    bufs.fill(3, [5, 6], [17, 3], [2, 0], [[4, 7], [1]], drafts=[[8, 9], [10]], width=3)
    b = bufs.batch(3, 3)
    assert b.input_ids.tolist() == [5, 8, 9, 6, 10, 0, 0, 0, 0]
    assert b.positions.tolist() == [17, 18, 19, 3, 4, 5, 0, 1, 2]
    assert b.seq_of.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert b.slots.tolist() == [2, 0, 9] and b.start_pos.tolist() == [17, 3, 0] and b.lens.tolist() == [3, 2, 1]
    assert bufs.real_rows() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="at most 2"):
        bufs.fill(3, [5], [17], [2], [[4, 7]], drafts=[[8, 9, 10]], width=3)
    with pytest.raises(ValueError, match="1 to 3"):
        bufs.batch(2, 4)
    with pytest.raises(ValueError, match="past the sequence's 2 blocks"):
        bufs.fill(3, [5], [30], [2], [[4, 7]], drafts=[[8, 9]], width=3)
    with pytest.raises(ValueError, match="no feed"):
        bufs.fill(3, [5], [17], [2], [[4, 7]], feed=(torch.tensor([1]), [0]), drafts=[[8]], width=3)


def test_verify_chunks_are_marked_for_the_step_s_row_lists():
    """The deterministic mode computes a verify chunk's rows as decode steps (mini.kernels.flashmla_attention.
    attend_by_chunk_kind): the step's row lists carry which sequences hold verify chunks, eager and static."""
    from mini.config import preset
    from mini.testing.rank_model import hasher_of
    cfg = preset("tiny-v4.1")
    hasher = hasher_of(cfg)
    chunks = [SeqChunk(list(range(3, 15)), 4, 0, [0]), SeqChunk(list(range(3, 24)), 18, 1, [1, 2], drafts=2),
              SeqChunk(list(range(3, 9)), 5, 2, [3])]
    eager = Batch.build(chunks, cfg, "cpu", hasher=hasher).layout(16, cfg.window_size)
    assert eager.verify_seqs.tolist() == [False, True, False] and eager.key_rows.verify is eager.verify_seqs
    assert Batch.build(chunks[:1], cfg, "cpu", hasher=hasher).layout(16, cfg.window_size).key_rows.verify is None
    bufs = DecodeBuffers(max_seqs=4, max_len=64, block_tokens=16, pad_slot=9, pad_block=30, device="cpu",
                         max_rows=3)
    bufs.fill(3, [5, 6], [17, 3], [2, 0], [[4, 7], [1]], drafts=[[8, 9], [10]], width=3)
    assert bufs.batch(3, 3).layout(16, cfg.window_size).key_rows.verify.tolist() == [True] * 3
    bufs.fill(2, [5, 6], [17, 3], [2, 0], [[4, 7], [1]])
    assert bufs.batch(2).layout(16, cfg.window_size).key_rows.verify is None
