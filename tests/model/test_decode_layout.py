"""A decode step from static buffers (DecodeBuffers -> DecodeLayout, what a CUDA graph captures) == the same step
built by Batch.build (StepLayout): logits, and every cache row a real sequence owns. On CPU, reference ops."""
import pytest
import torch

from mini.model import Batch, DecodeBuffers, KVCache, SeqChunk

# per preset: block_tokens, max_len, prompt lengths. The decode steps start at position = prompt length, so
# V4.1 (window 128, ratios 2 and 1): 127 crosses into the ring wrap, 63 / 129 close a ratio-2 group on the first /
# second step, 1 is a near-empty sequence. V4 (ratio 4 with overlap, ratio 128): 255 closes a ratio-128 group,
# 131 and 7 close ratio-4 groups on different steps, 300 reads two ratio-128 groups.
CASES = {"tiny-v4.1": (16, 320, [127, 63, 1, 200, 129]), "tiny-v4": (128, 512, [255, 131, 7, 300])}
STEPS = 3


def _prompt(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()


def _engram_rows(model, hasher, histories, positions):
    if hasher is None:
        return None
    ids = torch.cat([hasher.hash_ids(h, p, p + 1) for h, p in zip(histories, positions)])
    return model.engram_rows(ids)


def _engram_prefix(hasher, histories, positions):
    """[B, lookback - 1] the tokens before each position, -1 before the start."""
    k = hasher.lookback - 1
    return [[-1] * (k - min(p, k)) + h[max(0, p - k):p] for h, p in zip(histories, positions)]


def _buffers(cfg, hasher, max_len, bt, pad_slot, pad_block, on_device):
    engram = {}
    if hasher is not None and on_device:
        engram = {"engram_lookback": hasher.lookback}
    elif hasher is not None:
        engram = {"engram_shape": (len(cfg.engram_layer_ids), hasher.primes.shape[1], cfg.engram_head_dim)}
    return DecodeBuffers(max_seqs=8, max_len=max_len, block_tokens=bt, pad_slot=pad_slot, pad_block=pad_block,
                         device="cpu", engram_dtype=torch.float32, **engram)


def _close(a, b, what):
    """Equal up to summation order: the static step has more (masked) key columns and padding rows."""
    assert a.shape == b.shape and torch.isfinite(a).all() and torch.isfinite(b).all(), what
    err = (a.float() - b.float()).abs()
    assert err.max() < 5e-4, f"{what}: max error {err.max():.2e}"


@pytest.mark.parametrize("name,engram_on_device", [("tiny-v4.1", False), ("tiny-v4.1", True), ("tiny-v4", False)])
def test_static_decode_step_equals_built_step(name, engram_on_device, tiny_model, batch_invariant_gemms):
    """engram_on_device: the static step hashes its Engram ids on the device from the buffers' token window (the
    decode token as the buffers hold it) instead of taking rows looked up on the host; its hash ids equal
    Batch.build's and its logits equal, bit for bit, those of the host-looked-up static step."""
    model, hasher = tiny_model(name)
    cfg = model.config
    bt, max_len, lengths = CASES[name]
    n_seqs, nb = len(lengths), max_len // bt
    slots = [3, 0, 4, 1, 2] if n_seqs == 5 else [2, 0, 3, 1]  # scattered; slot n_seqs and the last block: scratch
    perm = torch.randperm(n_seqs * nb, generator=torch.Generator().manual_seed(7)).tolist()
    blocks = [perm[i * nb:(i + 1) * nb] for i in range(n_seqs)]
    pad_slot, pad_block = n_seqs, n_seqs * nb
    histories = [_prompt(cfg, n, seed=10 + i) for i, n in enumerate(lengths)]

    eager = KVCache(cfg, n_seqs + 1, n_seqs * nb + 1, bt, "cpu", torch.float32)
    prefill = Batch.build([SeqChunk(h, 0, s, b) for h, s, b in zip(histories, slots, blocks)], cfg, "cpu", hasher)
    first = model.forward(prefill, eager).argmax(-1).tolist()
    static = KVCache(cfg, n_seqs + 1, n_seqs * nb + 1, bt, "cpu", torch.float32)
    for src, dst in zip(_pools(eager), _pools(static)):
        dst.copy_(src)
    for pool in _pools(static):  # scratch rows start as garbage: a real sequence must never read them
        _scratch(pool, static, pad_slot, pad_block).fill_(float("nan"))

    bufs = _buffers(cfg, hasher, max_len, bt, pad_slot, pad_block, engram_on_device)
    if engram_on_device:  # the same step with host-looked-up rows, on its own copy of the cache
        host_bufs = _buffers(cfg, hasher, max_len, bt, pad_slot, pad_block, False)
        host_static = KVCache(cfg, n_seqs + 1, n_seqs * nb + 1, bt, "cpu", torch.float32)
        for src, dst in zip(_pools(static), _pools(host_static)):
            dst.copy_(src)
    next_tokens = first
    for step in range(STEPS):
        for h, t in zip(histories, next_tokens):
            h.append(t)
        pos = [len(h) - 1 for h in histories]
        built = Batch.build([SeqChunk(h, p, s, b) for h, p, s, b in zip(histories, pos, slots, blocks)], cfg,
                            "cpu", hasher)
        want = model.forward(built, eager)
        n = n_seqs + 1 + step  # padding rows: one, two, three
        fill = (n, [h[-1] for h in histories], pos, slots, blocks)
        if engram_on_device:
            bufs.fill(*fill, engram_prefix=_engram_prefix(hasher, histories, pos))
            batch = bufs.batch(n)
            assert batch.engram.form == "prefix" and built.engram.form == "ids"
            assert torch.equal(model.hash_on_device(batch.engram.data, batch.input_ids)[:n_seqs], built.engram.data)
            got = model.forward(batch, static)
            host_bufs.fill(*fill, _engram_rows(model, hasher, histories, pos))
            # real rows only: a padding row's Engram input is its hashed token 0 here, whatever the host left there
            assert torch.equal(got[:n_seqs], model.forward(host_bufs.batch(n), host_static)[:n_seqs])
        else:
            bufs.fill(*fill, _engram_rows(model, hasher, histories, pos))
            got = model.forward(bufs.batch(n), static)
        assert got.shape == (n, cfg.vocab_size)
        _close(got[:n_seqs], want, f"logits of step {step}")
        assert got[:n_seqs].argmax(-1).tolist() == want.argmax(-1).tolist()
        next_tokens = want.argmax(-1).tolist()
    for i, (a, b) in enumerate(zip(_pools(eager), _pools(static))):
        real = torch.ones(a.shape[0], dtype=torch.bool)
        real[pad_slot if a.shape[0] == eager.n_slots else pad_block] = False
        torch.testing.assert_close(b[real], a[real], atol=5e-4, rtol=0, msg=f"cache pool {i}")  # -inf: empty


def _pools(cache):
    pools = list(cache.window) + list(cache.comp_kv.values()) + list(cache.index_k.values())
    for states in (cache.comp_state, cache.index_state):
        for kv_and_score in states.values():
            pools += list(kv_and_score)
    return pools


def _scratch(pool, cache, pad_slot, pad_block):
    return pool[pad_slot] if pool.shape[0] == cache.n_slots else pool[pad_block]


def test_static_buffers_carry_the_engram_window():
    bufs = DecodeBuffers(max_seqs=4, max_len=64, block_tokens=16, pad_slot=9, pad_block=30, device="cpu",
                         engram_lookback=4)
    assert bufs.engram_rows is None
    sampled = torch.tensor([70, 71])
    bufs.fill(3, [5, 0], [17, 1], [2, 0], [[4, 7], [1]], feed=(sampled, [-1, 1]),
              engram_prefix=[[11, 12, 13], [-1, -1, 20]])
    b = bufs.batch(3)
    assert b.engram.form == "prefix" and b.engram.data.tolist() == [[11, 12, 13], [-1, -1, 20], [-1, -1, -1]]
    assert b.input_ids.tolist() == [5, 71, 0]  # the window's last column: the token fed on the device
    with pytest.raises(ValueError, match="tokens before"):
        bufs.fill(2, [1], [3], [0], [[1]])
    with pytest.raises(ValueError, match="tokens before"):
        bufs.fill(2, [1], [3], [0], [[1]], engram_prefix=[[1, 2]])
    with pytest.raises(ValueError, match="not both"):
        DecodeBuffers(4, 64, 16, 9, 30, "cpu", engram_shape=(2, 6, 32), engram_lookback=4)


def test_static_buffers_pad_and_check():
    bufs = DecodeBuffers(max_seqs=4, max_len=64, block_tokens=16, pad_slot=9, pad_block=30, device="cpu")
    bufs.fill(3, [5, 6], [17, 3], [2, 0], [[4, 7], [1]])
    b = bufs.batch(3)
    assert b.input_ids.tolist() == [5, 6, 0] and b.positions.tolist() == [17, 3, 0]
    assert b.slots.tolist() == [2, 0, 9] and b.start_pos.tolist() == [17, 3, 0]
    assert b.block_table.tolist() == [[4, 7, 30, 30], [1, 30, 30, 30], [30] * 4]
    assert b.logit_rows.tolist() == [0, 1, 2] and b.seq_of.tolist() == [0, 1, 2]
    lay = b.layout(16, 8)
    assert lay.seq_rows(2).shape == (3, 32) and lay.groups(2, False).pool_row.shape == (3,)
    g = lay.groups(2, False)  # position 17 closes group 8; position 3 closes group 1; padding at 0 closes none
    assert g.pool_row.tolist() == [7 * 8 + 0, 1 * 8 + 1, 30 * 8]
    assert g.write_state.tolist() == [9 * 2 + 1, 9 * 2 + 1, 9 * 2 + 0]  # closing tokens go to the scratch slot
    assert lay.ring_write_dst.tolist() == [2 * 8 + 1, 0 * 8 + 3, 9 * 8 + 0]
    with pytest.raises(ValueError, match="blocks"):
        bufs.fill(2, [1], [40], [0], [[1, 2]])  # position 40 needs a third block
    with pytest.raises(ValueError, match="bucket"):
        bufs.fill(5, [1], [0], [0], [[1]])


@pytest.mark.parametrize("name", ["tiny-v4.1", "tiny-v4"])
def test_a_span_reads_what_the_whole_buffers_read(name, tiny_model, batch_invariant_gemms):
    """DecodeBuffers.batch(n, span=s): the step's index tensors span s positions instead of max_len (the engine's
    CUDA graphs per span, mini.engine.cuda_graphs.spans). Buffers four times longer than the sequences need, a step
    at the shortest span that holds them: the same logits and cache rows as the step over the whole max_len, within
    the summation order the longer (masked) rows may change, and the same greedy tokens; a span past max_len is
    refused."""
    model, hasher = tiny_model(name)
    cfg = model.config
    bt, max_len, lengths = CASES[name]
    n_seqs, nb = len(lengths), max_len // bt
    slots, pad_slot, pad_block = list(range(n_seqs)), n_seqs, n_seqs * nb
    blocks = [list(range(i * nb, (i + 1) * nb)) for i in range(n_seqs)]
    histories = [_prompt(cfg, n, seed=30 + i) for i, n in enumerate(lengths)]
    caches = [KVCache(cfg, n_seqs + 1, n_seqs * nb + 1, bt, "cpu", torch.float32) for _ in range(2)]
    prefill = Batch.build([SeqChunk(h, 0, s, b) for h, s, b in zip(histories, slots, blocks)], cfg, "cpu", hasher)
    first = model.forward(prefill, caches[0]).argmax(-1).tolist()
    for src, dst in zip(_pools(caches[0]), _pools(caches[1])):
        dst.copy_(src)
    bufs = _buffers(cfg, hasher, 4 * max_len, bt, pad_slot, pad_block, False)
    for h, t in zip(histories, first):
        h.append(t)
    pos = [len(h) - 1 for h in histories]
    bufs.fill(n_seqs + 1, [h[-1] for h in histories], pos, slots, blocks,
              _engram_rows(model, hasher, histories, pos))
    whole = model.forward(bufs.batch(n_seqs + 1), caches[0])
    span = max_len  # every sequence ends within the blocks it has
    assert bufs.batch(n_seqs + 1, span=span).layout(bt, cfg.window_size).seq_rows(2).shape[1] == span // 2
    short = model.forward(bufs.batch(n_seqs + 1, span=span), caches[1])
    _close(short[:n_seqs], whole[:n_seqs], "logits at the span")
    assert short[:n_seqs].argmax(-1).tolist() == whole[:n_seqs].argmax(-1).tolist()
    for i, (a, b) in enumerate(zip(_pools(caches[0]), _pools(caches[1]))):
        torch.testing.assert_close(b, a, atol=5e-4, rtol=0, msg=f"cache pool {i}")
    with pytest.raises(ValueError, match="span"):
        bufs.batch(2, span=4 * max_len + 1)


def test_spans_grow_fourfold_to_max_len():
    from mini.engine.cuda_graphs import DecodeGraphs, spans

    class Static:
        max_seqs, max_rows, max_len, device = 4, 1, 1 << 20, torch.device("cpu")
    assert spans(1 << 20) == [4096, 16384, 65536, 262144, 1 << 20]
    assert spans(4096) == [4096] and spans(1024) == [1024] and spans(5000) == [4096, 5000]
    graphs = DecodeGraphs(None, None, Static())
    assert graphs.spans == spans(1 << 20)
    assert [graphs.span_for(e) for e in (1, 4096, 4097, 70000, 1 << 20)] == [4096, 4096, 16384, 262144, 1 << 20]
