"""The deterministic mode's sparse attention core (mini.ops.attention._deterministic_kernel, the split in
mini.kernels.flashmla_attention.attend_by_chunk_kind; FlashMLA by default,
MINI_DET_SPARSE_ATTN=triton keeps every query on our kernel): queries of multi-token chunks take FlashMLA over
lists in position order, one-token chunks our Triton kernel. CPU: the lists hold a query's keys in the same order
whatever chunk, batch or physical layout holds them, and the split sends each query where its own chunk says; a
step mixing both kinds runs each kernel over its own rows only (interpreter, FlashMLA's stand-in a per-row
reference), each row == its kind alone. gpu: a sequence's outputs alone == among other sequences (decode tokens,
other chunks, wider top-k lists) and chunked == unchunked, and a mixed step's prefill and decode rows == each
alone, bit for bit."""
import os

import pytest
import torch

import mini.ops
from mini import switches
from mini.kernels import flashmla_attention as fm
from mini.kernels.attention_input import AttentionInput
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

    rows = []

    def triton(q, *args, **kw):
        calls["triton"] += 1
        rows.append(q.shape[0])
        assert kw.get("prefill_lists") is False  # the mode's lists
        return torch.ones_like(q)

    def flashmla(q, kv, rows, count, sink, scale):
        calls["flashmla"] += 1
        return torch.full_like(q, 2.0)

    monkeypatch.setattr(sa, "sparse_mla_attention", triton)
    monkeypatch.setattr(fm, "sparse_prefill", flashmla)
    if "MINI_DET_SPARSE_ATTN" not in os.environ:  # FlashMLA is the mode's default where it takes the shapes
        assert switches.current().det_sparse_attn == "flashmla" and attention.DET_SPARSE_ATTN is None
    monkeypatch.setattr(attention, "DET_SPARSE_ATTN", "flashmla")
    monkeypatch.setattr(fm, "takes_model", lambda q, keys: True)
    monkeypatch.setattr(attention.backends, "sparse_attn", lambda: "flashmla")

    def run(lengths):
        seq_of = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(lengths)])
        T, B, D = seq_of.shape[0], len(lengths), 16
        starts = torch.tensor([10 * b for b in range(B)])
        positions = torch.cat([torch.arange(10 * b, 10 * b + n) for b, n in enumerate(lengths)])
        args = (torch.randn(T, 2, D), torch.randn(T, D), torch.randn(B, W, D), torch.zeros(2), positions, seq_of,
                torch.arange(B), starts, 0.1, None, None, None, 1, None)
        return attention._deterministic_core(AttentionInput(*args), None)[:, 0, 0]

    out = run([1, 5, 1, 3])
    assert out.tolist() == [1.0] + [2.0] * 5 + [1.0] + [2.0] * 3
    assert calls == {"triton": 1, "flashmla": 1} and rows == [2]  # the Triton kernel over the 1-token rows only
    assert run([4, 2]).tolist() == [2.0] * 6 and calls == {"triton": 1, "flashmla": 2}
    assert run([1, 1]).tolist() == [1.0] * 2 and calls == {"triton": 2, "flashmla": 2}
    monkeypatch.setattr(attention.backends, "sparse_attn", lambda: "triton")  # MINI_SPARSE_ATTN=triton
    assert run([4, 2]).tolist() == [1.0] * 6
    monkeypatch.setattr(attention.backends, "sparse_attn", lambda: "auto-flashmla")
    monkeypatch.setattr(fm, "takes_model", lambda q, keys: False)  # e.g. no FlashMLA on this GPU
    assert run([4, 2]).tolist() == [1.0] * 6
    monkeypatch.setattr(fm, "takes_model", lambda q, keys: True)
    monkeypatch.setattr(attention, "DET_SPARSE_ATTN", "triton")  # MINI_DET_SPARSE_ATTN=triton: our kernel always
    assert run([4, 2]).tolist() == [1.0] * 6
    assert calls["flashmla"] == 2


def test_det_sparse_attn_refuses_an_unknown_value():
    """Refused when the switches are read (mini.switches), naming the variable, not at the op's import."""
    with pytest.raises(ValueError, match="MINI_DET_SPARSE_ATTN='flashml'"):
        switches.read({"MINI_DET_SPARSE_ATTN": "flashml"})


def test_reference_rows_do_not_depend_on_the_top_k_lists_width():
    """The reference core in the deterministic mode (the CPU's): a query's output does not depend on how wide its
    step's top-k lists are. A chunk's lists are min(index_topk, its groups) wide, so a verify chunk's or a prefill
    chunk's differ from a decode step's; unpadded, the last softmax block's width followed them and its products
    rounded otherwise on the CPU (found by tests/fuzz/test_fuzz_speculative.py)."""
    g = torch.Generator().manual_seed(3)
    H, D, pos = 4, 64, 45
    q = torch.randn(1, H, D, generator=g)
    kv_new, window = torch.randn(1, D, generator=g), torch.randn(1, W, D, generator=g)
    comp, table = torch.randn(6, RPB, D, generator=g), torch.tensor([[4, 0, 2, 5, 1]])
    ids = torch.tensor([0, 3, 4, 7, 9, 10, 12, 13, 15, 17, 18])
    idx = torch.tensor([0])
    outs = []
    with mini.ops.using_backend("reference"), mini.ops.deterministic_mode():
        for width in (11, 12, 20, 53, 54, 70):
            comp_idx = torch.cat([ids, ids.new_full((width - len(ids),), -1)])[None]
            outs.append(attention.sparse_attention(q, kv_new, window, torch.zeros(H), torch.tensor([pos]), idx, idx,
                                                   torch.tensor([pos]), D ** -0.5, comp, table, comp_idx, 2))
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs)


# ------------------------------------------------------------------------------------------------------ gpu


def _step(seqs, k_width: int, dev="cuda", Wv: int = 128, rpb: int = 64, nb: int = 4, picks: int = 96):
    """seqs: (name, keys [L, D], queries [L, H, D], groups [(L + 1) // 2, D], lo, hi, slot); one step holding each
    sequence's positions [lo, hi), its earlier keys in its ring (window Wv), its groups (2 tokens each) in its own
    pool blocks (nb of rpb rows); every query's top-k ids (at most `picks`) drawn from its (name, position) alone,
    padded with -1 to `k_width`. Returns the op's arguments and each name's row range."""
    D, H, dtype = seqs[0][1].shape[1], seqs[0][2].shape[1], seqs[0][1].dtype
    kv_new, positions, seq_of, slots, starts, q, spans, ids = [], [], [], [], [], [], {}, []
    window = torch.zeros(8, Wv, D, dtype=dtype, device=dev)
    comp = torch.zeros(64, rpb, D, dtype=dtype, device=dev)
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
            pick = torch.randperm(n_valid, generator=gen)[:picks]
            row[:pick.shape[0]] = pick
            ids.append(row)
        spans[name] = (t0, t0 + hi - lo)
        t0 += hi - lo
    cat = torch.cat
    sink = torch.linspace(-1, 1, H, device=dev)
    args = (cat(q), cat(kv_new), window, sink, cat(positions), cat(seq_of), torch.tensor(slots, device=dev),
            torch.tensor(starts, device=dev), D ** -0.5, comp, block_table, torch.stack(ids).to(dev), 2, None)
    return args, spans


def _gpu_step(seqs, k_width: int, dev="cuda"):
    """`_step` at V4.1's sizes (FlashMLA's head width, 64 heads from the queries, window 128, 64-row blocks)."""
    return _step(seqs, k_width, dev)


@pytest.fixture
def flashmla_stand_in(monkeypatch):
    """The deterministic mode's FlashMLA path on CPU (mini/testing/flashmla_stand_in.py)."""
    from mini.testing import flashmla_stand_in
    flashmla_stand_in.install(monkeypatch.setattr)


def test_mixed_step_rows_equal_each_kind_alone_interpreter(monkeypatch, flashmla_stand_in):
    """A step mixing prefill chunks (FlashMLA's stand-in) and decode tokens (the Triton kernel, interpreted): each
    row equals its own kind's run without the other kind, bitwise, and the Triton kernel only sees the decode
    rows (as the decode step of those sequences), with the pool, its block tables and the output RoPE."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test: the gpu test below covers the compiled kernels here")
    import mini.kernels.sparse_attention as sa
    triton_rows = []
    real_triton = sa.sparse_mla_attention

    def counted(q, *a, **kw):
        triton_rows.append(q.shape[0])
        return real_triton(q, *a, **kw)

    monkeypatch.setattr(sa, "sparse_mla_attention", counted)
    D, H, L = 16, 3, 40
    g = torch.Generator().manual_seed(0)

    def seq():
        return (torch.randn(L, D, generator=g), torch.randn(L, H, D, generator=g),
                torch.randn((L + 1) // 2, D, generator=g))

    S, X, Y, Z = seq(), seq(), seq(), seq()
    freqs = torch.tensor([0.3, 0.05])  # output RoPE over the last 4 channels, a function of the position alone

    def run(specs):
        args, spans = _step(specs, 8, "cpu", Wv=8, rpb=8, nb=4, picks=6)
        rope = torch.polar(torch.ones(args[4].shape[0], 2), args[4][:, None].float() * freqs)
        out = attention._deterministic_core(AttentionInput(*args[:-1], rope), None)
        return {name: out[lo:hi] for name, (lo, hi) in spans.items()}

    mixed = run([("X", *X, 29, 30, 3), ("S", *S, 0, 12, 5), ("Z", *Z, 17, 18, 2), ("Y", *Y, 10, 21, 1)])
    assert triton_rows == [2]  # the two decode tokens only
    alone = {**run([("S", *S, 0, 12, 0)]), **run([("Y", *Y, 10, 21, 4)])}
    assert triton_rows == [2]  # steps of multi-token chunks only: no Triton kernel
    alone.update(run([("X", *X, 29, 30, 3)]))
    alone.update({"Z": run([("Z", *Z, 17, 18, 2)])["Z"]})
    assert triton_rows == [2, 1, 1]
    decode_step = run([("Z", *Z, 17, 18, 6), ("X", *X, 29, 30, 0)])  # the decode tokens as a step of their own
    for name in "SYXZ":
        assert not mixed[name].isnan().any()
        assert torch.equal(mixed[name], alone[name]), name
    for name in "XZ":
        assert torch.equal(mixed[name], decode_step[name]), name
    # the stand-in over the position-order lists computes the Triton kernel's attention (MINI_DET_SPARSE_ATTN=triton:
    # every row ours)
    monkeypatch.setattr(attention, "DET_SPARSE_ATTN", "triton")
    ours = run([("X", *X, 29, 30, 3), ("S", *S, 0, 12, 5), ("Z", *Z, 17, 18, 2), ("Y", *Y, 10, 21, 1)])
    assert triton_rows[-1] == 25
    for name in "SY":
        torch.testing.assert_close(mixed[name], ours[name], rtol=1e-5, atol=1e-5)


def test_verify_chunk_rows_equal_their_decode_steps_interpreter(flashmla_stand_in):
    """Speculation under the deterministic mode: a verify chunk (a sequence's token and its drafts, several rows)
    stands for decode steps, so its rows take the decode rows' kernel (ours, interpreted), not FlashMLA's stand-in
    as a prefill chunk's do, and each equals the decode step of its position alone, bitwise, beside a prefill chunk
    in the same step. Without the verify mark the rows are a prefill chunk's (the stand-in): they differ."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test: the gpu tests cover the compiled kernels here")
    D, H, L = 16, 3, 40
    g = torch.Generator().manual_seed(5)
    S, V = [(torch.randn(L, D, generator=g), torch.randn(L, H, D, generator=g),
             torch.randn((L + 1) // 2, D, generator=g)) for _ in range(2)]

    def run(specs, verify=None):
        args, spans = _step(specs, 8, "cpu", Wv=8, rpb=8, nb=4, picks=6)
        inp = AttentionInput(*args[:-1], None)
        rows = StepRows(inp.positions, inp.seq_of, inp.slots, inp.start_pos, window_rows, position_order=True,
                        verify=None if verify is None else torch.tensor(verify))
        out = attention._deterministic_core(inp, rows)
        return {name: out[lo:hi] for name, (lo, hi) in spans.items()}

    step = [("S", *S, 3, 15, 5), ("V", *V, 21, 25, 2)]  # a prefill chunk of 12 rows, a verify chunk of 1 + 3
    verified = run(step, verify=[False, True])["V"]
    decodes = torch.cat([run([("V", *V, p, p + 1, 2)])["V"] for p in range(21, 25)])
    assert not verified.isnan().any() and torch.equal(verified, decodes)
    assert not torch.equal(run(step)["V"], decodes)  # as a prefill chunk: FlashMLA's stand-in


@pytest.mark.gpu
def test_flashmla_rows_alone_equal_among_load_and_chunks_gpu(monkeypatch):
    from mini.kernels import flashmla_attention as fm
    if not torch.cuda.is_available() or not fm.available():
        pytest.skip("needs FlashMLA's SM90 kernels on an H200")
    monkeypatch.setattr(attention, "DET_SPARSE_ATTN", "flashmla")
    used = {"n": 0}
    real = fm.sparse_prefill

    def counted(*a, **kw):
        used["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(fm, "sparse_prefill", counted)
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


@pytest.mark.gpu
def test_flashmla_mixed_step_splits_rows_by_chunk_kind_gpu(monkeypatch):
    """MINI_DET_SPARSE_ATTN=flashmla on the H200: a prefill chunk's rows are bitwise the same with and without a
    decode token in its step, and the decode token's row is bitwise its decode step alone; the Triton kernel runs
    over the decode row only (its row subset), FlashMLA in every step holding the chunk."""
    from mini.kernels import flashmla_attention as fm
    import mini.kernels.sparse_attention as sa
    if not torch.cuda.is_available() or not fm.available():
        pytest.skip("needs FlashMLA's SM90 kernels on an H200")
    monkeypatch.setattr(attention, "DET_SPARSE_ATTN", "flashmla")
    used = {"flashmla": 0, "triton_rows": []}
    real_prefill, real_triton = fm.sparse_prefill, sa.sparse_mla_attention

    def prefill(*a, **kw):
        used["flashmla"] += 1
        return real_prefill(*a, **kw)

    def triton(q, *a, **kw):
        used["triton_rows"].append(q.shape[0])
        return real_triton(q, *a, **kw)

    monkeypatch.setattr(fm, "sparse_prefill", prefill)
    monkeypatch.setattr(sa, "sparse_mla_attention", triton)
    dev, D, H = "cuda", fm.HEAD_DIM, 64
    g = torch.Generator(device=dev).manual_seed(1)

    def seq(L):
        return (torch.randn(L, D, device=dev, generator=g).bfloat16(),
                torch.randn(L, H, D, device=dev, generator=g).bfloat16(),
                torch.randn((L + 1) // 2, D, device=dev, generator=g).bfloat16())

    S, X = seq(500), seq(300)  # at most 256 groups: _gpu_step's 4 blocks of 64 rows
    mini.ops.set_deterministic(True)
    try:
        with mini.ops.using_backend("fast"):
            def run(specs):
                args, spans = _gpu_step(specs, 128)
                out = attention.sparse_attention(*args)
                return {name: out[lo:hi] for name, (lo, hi) in spans.items()}

            chunk_alone = run([("S", *S, 150, 500, 2)])["S"]
            decode_alone = run([("X", *X, 299, 300, 3)])["X"]
            assert used == {"flashmla": 1, "triton_rows": [1]}
            for specs in ([("X", *X, 299, 300, 3), ("S", *S, 150, 500, 2)],
                          [("S", *S, 150, 500, 5), ("X", *X, 299, 300, 0)]):  # either order, other slots
                mixed = run(specs)
                assert torch.equal(mixed["S"], chunk_alone)
                assert torch.equal(mixed["X"], decode_alone)
    finally:
        mini.ops.set_deterministic(False)
    assert used == {"flashmla": 3, "triton_rows": [1, 1, 1]}
