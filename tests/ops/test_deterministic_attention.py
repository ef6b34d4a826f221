"""The deterministic mode's sparse attention core with MINI_DET_SPARSE_ATTN=flashmla (mini.ops.attention
._deterministic_core): queries of multi-token chunks take FlashMLA over lists in position order, one-token chunks
our Triton kernel. CPU: the lists hold a query's keys in the same order whatever chunk, batch or physical layout
holds them, and the split sends each query where its own chunk says. gpu: a sequence's outputs alone == among
other sequences (decode tokens, other chunks, wider top-k lists) and chunked == unchunked, bit for bit."""
import pytest
import torch

import mini.ops
from mini.kernels.flashmla_attention import TOPK_MULTIPLE, StepRows
from mini.ops import attention
from mini.ops.attention import window_rows

W, RPB = 8, 4  # window, pool rows per block (CPU tests)


def _key(p: int, D: int) -> torch.Tensor:
    return torch.tensor([float(p)] + [0.0] * (D - 1))


def _lists(chunk_lo: int, chunk_hi: int, others: int, position_order: bool, physical: list[int]):
    """One step: `others` fresh tokens of another sequence (positions 0..), then positions [chunk_lo, chunk_hi) of
    the sequence under test (its earlier keys in its ring); its groups in pool blocks `physical`. Returns, for the
    test sequence's queries, the key identities of each list (window key = its position, group g = 1000 + g)."""
    D = 4
    kv_new = torch.stack([_key(-1, D)] * others + [_key(p, D) for p in range(chunk_lo, chunk_hi)])
    positions = torch.cat([torch.arange(others), torch.arange(chunk_lo, chunk_hi)])
    seq_of = torch.cat([torch.zeros(others, dtype=torch.long), torch.ones(chunk_hi - chunk_lo, dtype=torch.long)])
    slots, start_pos = torch.tensor([0, 1]), torch.tensor([0, chunk_lo])
    window = torch.full((2, W, D), -5.0)
    for p in range(max(0, chunk_lo - W), chunk_lo):  # the ring holds the last W keys before the chunk
        window[1, p % W] = _key(p, D)
    comp = torch.full((8, RPB, D), -7.0)
    block_table = torch.tensor([[7, 7, 7], physical])
    for g in range(3 * RPB):
        comp[physical[g // RPB], g % RPB] = _key(1000 + g, D)
    g = torch.Generator().manual_seed(1)
    ids = torch.full((positions.shape[0], 6), -1, dtype=torch.long)
    for t, p in enumerate(positions.tolist()):
        n_valid = (p + 1) // 2  # groups of 2 tokens
        if seq_of[t] == 1 and n_valid:
            gen = torch.Generator().manual_seed(p)  # a query's ids depend on the query only
            ids[t, :min(6, n_valid)] = torch.randperm(n_valid, generator=gen)[:6]
    del g
    rows_obj = StepRows(positions, seq_of, slots, start_pos, window_rows, position_order=position_order)
    kv, rows, count = rows_obj.scratch_keys(kv_new, window, comp, block_table, ids, TOPK_MULTIPLE)
    out = {}
    for t in range(others, positions.shape[0]):
        r = rows[t, :int(count[t])].long()
        assert (r >= 0).all() and (rows[t, int(count[t]):] < 0).all()
        out[int(positions[t])] = kv[r, 0].tolist()
    return out


def test_position_order_lists_do_not_depend_on_chunks_batch_or_blocks():
    whole = _lists(0, 21, 0, True, [0, 1, 2])
    for lo, others, physical in ((13, 0, [0, 1, 2]), (13, 5, [5, 3, 1]), (16, 3, [2, 6, 4]), (20, 0, [1, 0, 3])):
        part = _lists(lo, 21, others, True, physical)
        for p, keys in part.items():
            assert keys == whole[p], (lo, others, p)
    # without position order the window keys follow the scratch rows (fresh vs ring, where the ring wraps)
    old_whole, old_part = _lists(0, 21, 0, False, [0, 1, 2]), _lists(13, 21, 0, False, [0, 1, 2])
    assert any(old_part[p] != old_whole[p] for p in old_part)


def test_each_query_takes_the_kernel_of_its_own_chunk(monkeypatch):
    """Chunks of 1, 5, 1 and 3 tokens: FlashMLA (faked: 2) for the 5- and 3-token chunks' queries, the Triton
    kernel (faked: 1) for the others; a step of multi-token chunks only never runs the Triton kernel."""
    import mini.kernels.sparse_attention as sa
    calls = {"triton": 0, "flashmla": 0}

    def triton(q, *args, **kw):
        calls["triton"] += 1
        assert kw.get("prefill_lists") is False  # the mode's lists
        return torch.ones_like(q)

    def flashmla(q, kv, rows, count, sink, scale):
        calls["flashmla"] += 1
        return torch.full_like(q, 2.0)

    monkeypatch.setattr(sa, "sparse_mla_attention", triton)
    monkeypatch.setattr(attention, "sparse_prefill", flashmla)
    monkeypatch.setattr(attention, "DET_SPARSE_ATTN", "flashmla")
    monkeypatch.setattr(attention, "_flashmla_takes", lambda q, keys: True)
    monkeypatch.setattr(attention.backends, "sparse_attn", lambda: "flashmla")

    def run(lengths):
        seq_of = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(lengths)])
        T, B, D = seq_of.shape[0], len(lengths), 16
        starts = torch.tensor([10 * b for b in range(B)])
        positions = torch.cat([torch.arange(10 * b, 10 * b + n) for b, n in enumerate(lengths)])
        args = (torch.randn(T, 2, D), torch.randn(T, D), torch.randn(B, W, D), torch.zeros(2), positions, seq_of,
                torch.arange(B), starts, 0.1, None, None, None, 1, None)
        return attention._deterministic_core(args, None)[:, 0, 0]

    out = run([1, 5, 1, 3])
    assert out.tolist() == [1.0] + [2.0] * 5 + [1.0] + [2.0] * 3
    assert calls == {"triton": 1, "flashmla": 1}
    assert run([4, 2]).tolist() == [2.0] * 6 and calls == {"triton": 1, "flashmla": 2}
    assert run([1, 1]).tolist() == [1.0] * 2 and calls == {"triton": 2, "flashmla": 2}
    monkeypatch.setattr(attention, "DET_SPARSE_ATTN", "triton")  # the default: our kernel for every query
    assert run([4, 2]).tolist() == [1.0] * 6


# ------------------------------------------------------------------------------------------------------ gpu


def _gpu_step(seqs, k_width: int, dev="cuda"):
    """seqs: (name, keys [L, D], queries [L, H, D], groups [(L + 1) // 2, D], lo, hi, slot); one step holding each
    sequence's positions [lo, hi), its earlier keys in its ring, its groups (2 tokens each) in its own pool blocks; every query's top-k ids drawn from its
    (name, position) alone, padded with -1 to `k_width`. Returns the op's arguments and each name's row range."""
    from mini.kernels.flashmla_attention import HEAD_DIM
    D, Wv, H, rpb = HEAD_DIM, 128, 64, 64
    kv_new, positions, seq_of, slots, starts, q, spans, ids = [], [], [], [], [], [], {}, []
    window = torch.zeros(8, Wv, D, dtype=torch.bfloat16, device=dev)
    comp = torch.zeros(64, rpb, D, dtype=torch.bfloat16, device=dev)
    nb = 4
    block_table = torch.full((len(seqs), nb), -1, dtype=torch.int32, device=dev)
    t0 = 0
    for b, (name, keys, queries, groups, lo, hi, slot) in enumerate(seqs):
        kv_new.append(keys[lo:hi])
        q.append(queries[lo:hi])
        positions.append(torch.arange(lo, hi, device=dev))
        seq_of.append(torch.full((hi - lo,), b, device=dev))
        slots.append(slot)
        starts.append(lo)
        for p in range(max(0, lo - Wv), lo):
            window[slot, p % Wv] = keys[p]
        blocks = [(8 * slot + 3 * j + 1) % 64 for j in range(nb)]  # a layout of its own per slot
        block_table[b] = torch.tensor(blocks, dtype=torch.int32)
        for g in range(groups.shape[0]):
            comp[blocks[g // rpb], g % rpb] = groups[g]
        for p in range(lo, hi):
            n_valid = (p + 1) // 2
            row = torch.full((k_width,), -1, dtype=torch.int64)
            gen = torch.Generator().manual_seed(hash((name, p)) % (1 << 31))
            pick = torch.randperm(n_valid, generator=gen)[:96]
            row[:pick.shape[0]] = pick
            ids.append(row)
        spans[name] = (t0, t0 + hi - lo)
        t0 += hi - lo
    cat = torch.cat
    sink = torch.linspace(-1, 1, H, device=dev)
    args = (cat(q), cat(kv_new), window, sink, cat(positions), cat(seq_of), torch.tensor(slots, device=dev),
            torch.tensor(starts, device=dev), D ** -0.5, comp, block_table, torch.stack(ids).to(dev), 2, None)
    return args, spans


@pytest.mark.gpu
def test_flashmla_rows_alone_equal_among_load_and_chunks_gpu(monkeypatch):
    from mini.kernels import flashmla_attention as fm
    if not torch.cuda.is_available() or not fm.available():
        pytest.skip("needs FlashMLA's SM90 kernels on an H200")
    monkeypatch.setattr(attention, "DET_SPARSE_ATTN", "flashmla")
    used = {"n": 0}
    real = attention.sparse_prefill

    def counted(*a, **kw):
        used["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(attention, "sparse_prefill", counted)
    dev, D, H = "cuda", fm.HEAD_DIM, 64
    g = torch.Generator(device=dev).manual_seed(0)

    def seq(L):
        return (torch.randn(L, D, device=dev, generator=g).bfloat16(),
                torch.randn(L, H, D, device=dev, generator=g).bfloat16(),
                torch.randn((L + 1) // 2, D, device=dev, generator=g).bfloat16())

    S, X, Y = seq(400), seq(300), seq(500)
    mini.ops.set_deterministic(True)
    try:
        with mini.ops.using_backend("fast"):
            def run(specs, k_width):
                args, spans = _gpu_step(specs, k_width)
                return attention.sparse_attention(*args), spans

            alone, sp = run([("S", *S, 0, 400, 0)], 128)
            a0 = alone[sp["S"][0]:sp["S"][1]]
            # among a decode token of X, a 200-token chunk of Y (its ring holding earlier keys), wider id lists
            among, sp = run([("X", *X, 299, 300, 3), ("S", *S, 0, 400, 5), ("Y", *Y, 250, 450, 1)], 256)
            assert torch.equal(among[sp["S"][0]:sp["S"][1]], a0)
            # S in two chunks: the second chunk's queries equal the whole prompt's (position-order lists)
            second, sp = run([("S", *S, 150, 400, 2)], 128)
            assert torch.equal(second[sp["S"][0]:sp["S"][1]], a0[150:])
            # its second chunk among others too
            mixed, sp = run([("Y", *Y, 449, 450, 1), ("S", *S, 150, 400, 6), ("X", *X, 0, 120, 4)], 128)
            assert torch.equal(mixed[sp["S"][0]:sp["S"][1]], a0[150:])
    finally:
        mini.ops.set_deterministic(False)
    assert used["n"] == 4  # FlashMLA ran in every step (the others' multi-token rows included)
