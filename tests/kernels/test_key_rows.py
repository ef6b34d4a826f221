"""The row lists of a decode-shaped step's keys in a KeyStore (mini/kernels/key_rows.py) and FlashMLA's in-place
read of them (mini.kernels.flashmla_attention.attend_in_place). On CPU: the kernel under Triton's interpreter equals
its torch form, and the rows point at exactly the keys mini.ops.attention.scratch_keys lists for each query (the
plain definition), for decode and verify steps at odd sizes (windows partly filled and wrapped, top-k with -1
holes, window-only layers). On the GPU at V4.1's shape: the in-place kernel against the reference op, eager and
replayed from a CUDA graph."""
import pytest
import torch

from mini.kernels.attention_input import AttentionInput, KeyStore
from tests.kernels.test_sparse_attention import make_case, rope_for

# (lengths, starts): decode rows (a window partly filled, a wrapped one), verify steps (a token and its drafts)
DECODE = ([1, 1, 1, 1], [0, 5, 9, 40])
VERIFY = ([3, 3], [2, 30])
VERIFY_1 = ([6], [13])


def _store(window, comp, fresh_rows):
    """A KeyStore holding copies of `window` and `comp` (ring and pool views, as KVCache lays them out)."""
    D = window.shape[-1]
    n_win, n_comp = window.shape[0] * window.shape[1], comp.shape[0] * comp.shape[1]
    rows = torch.full((n_win + n_comp + fresh_rows, D), float("nan"), dtype=window.dtype, device=window.device)
    store = KeyStore(rows, rows[n_win + n_comp:])
    ring = rows[:n_win].view_as(window)
    pool = rows[n_win:n_win + n_comp].view_as(comp)
    ring.copy_(window)
    pool.copy_(comp)
    return store, ring, pool


def _case(flat_batch, steps, device="cpu", dtype=torch.float32, H=3, D=16, W=8, ratio=2, rpb=4, topk=7, seed=0):
    torch.manual_seed(seed)
    return make_case(flat_batch, device, dtype, *steps, H, D, W, ratio, rpb, topk)


@pytest.mark.parametrize("steps,width", [(DECODE, 1), (VERIFY, 3), (VERIFY_1, 6)], ids=["decode", "verify", "verify1"])
@pytest.mark.parametrize("with_pool", [True, False])
@pytest.mark.parametrize("multiple", [1, 16])
def test_key_rows_are_the_listed_keys_interpreter(steps, width, with_pool, multiple, interpreter, flat_batch):
    from mini.kernels.key_rows import key_rows, key_rows_reference
    from mini.ops.attention import scratch_keys
    b, q, kv_new, window, comp, sink, comp_idx = _case(flat_batch, steps, W=5 if width == 6 else 8)
    comp_idx[::2, 3:] = -1  # holes
    idx = comp_idx if with_pool else None
    W = window.shape[1]
    store, ring, pool = _store(window, comp, 32)
    store.fresh[:kv_new.shape[0]] = kv_new
    args = (b.positions, b.seq_of, b.slots, b.start_pos, W, store.row_of(ring), store.row_of(store.fresh),
            b.block_table if with_pool else None, idx, comp.shape[1], store.row_of(pool), multiple)
    rows = key_rows(*args)
    assert torch.equal(rows, key_rows_reference(*args))
    assert rows.shape[1] % multiple == 0
    kv, want, count = scratch_keys(kv_new, window, b.positions, b.seq_of, b.slots, b.start_pos, comp,
                                   b.block_table, idx)
    proj = torch.randn(kv.shape[1], dtype=torch.float64)
    for t in range(rows.shape[0]):
        got_keys = store.rows[rows[t][rows[t] >= 0].long()].double()
        want_keys = kv[want[t][want[t] >= 0].long()].double()
        assert got_keys.shape == want_keys.shape, f"query {t}: {got_keys.shape[0]} keys, want {want_keys.shape[0]}"
        assert torch.isfinite(got_keys).all()  # no row of the store's unwritten (NaN) rows
        assert torch.equal(got_keys[(got_keys @ proj).argsort()], want_keys[(want_keys @ proj).argsort()])


def test_serves_in_place_needs_views_of_the_store_and_a_decode_shape(flat_batch):
    """`serves_in_place` refuses: no store, a step that is not decode-shaped, keys outside the store, more rows than
    the fresh rows (on CPU it refuses anyway: the library runs on SM90 only)."""
    from mini.kernels import flashmla_attention as flashmla
    b, q, kv_new, window, comp, sink, comp_idx = _case(flat_batch, VERIFY)
    store, ring, pool = _store(window, comp, 32)
    base = (q, kv_new, ring, sink, b.positions, b.seq_of, b.slots, b.start_pos, 0.1, pool, b.block_table, comp_idx)
    assert AttentionInput(*base, rows_per_seq=3, store=store).decode_shaped
    assert not AttentionInput(*base, rows_per_seq=2, store=store).decode_shaped
    for inp in (AttentionInput(*base, rows_per_seq=3), AttentionInput(*base, rows_per_seq=1, store=store),
                AttentionInput(*base[:2], window, *base[3:], rows_per_seq=3, store=store),
                AttentionInput(*base, rows_per_seq=3, store=KeyStore(store.rows, store.fresh[:4])),
                AttentionInput(*base, rows_per_seq=3, store=store)):  # CPU: not the library's
        assert not flashmla.serves_in_place(inp)


def test_few_rows_stay_on_our_split_kernel():
    """`few_rows` is where our kernel splits its key lists (split_pieces > 1 at 64 heads on 132 SMs: up to 33 rows):
    those steps never take FlashMLA in place (one CTA per row and 64 heads)."""
    from mini.kernels.flashmla_attention import few_rows
    from mini.kernels.sparse_attention import split_pieces
    cpu = torch.device("cpu")  # answers the H200's 132 SMs
    for T in (1, 6, 33, 34, 64, 384):
        assert few_rows(T, 64, cpu) == (split_pieces(2 * T, 10, 132) > 1), T
    assert few_rows(33, 64, cpu) and not few_rows(34, 64, cpu) and few_rows(16, 128, cpu) and not few_rows(17, 128, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,starts", [([1] * 64, [3 + 517 * i for i in range(64)]), ([6] * 8, [4090] * 8),
                                         ([6] * 16, [200 + 911 * i for i in range(16)]),
                                         ([1] * 40, list(range(0, 400, 10)))],
                         ids=["decode-B64", "verify-B8x6", "verify-B16x6", "decode-B40-early"])
@pytest.mark.parametrize("with_pool", [True, False])
def test_in_place_flashmla_matches_reference_gpu(lens, starts, with_pool, flat_batch):
    """V4.1 shape (64 heads, D 512, W 128, ratio 4, top-512): FlashMLA over the KeyStore within 5e-3 (relative
    norm) of mini.ops.attention's reference, as the Triton kernel is held to; the same bits replayed from a CUDA
    graph as eagerly (fresh rows poisoned between)."""
    from mini.kernels import flashmla_attention as flashmla
    from mini.ops.attention import _unrotate, sparse_attention
    if not flashmla.available():
        pytest.skip("sgl-flash-mla does not import on an SM90 GPU here (scripts/gpu.sh installs .whl/gpu)")
    H, D, W, ratio, rpb = 64, 512, 128, 4, 64
    torch.manual_seed(len(lens))
    b, q, kv_new, window, comp, sink, comp_idx = make_case(flat_batch, "cuda", torch.bfloat16, lens, starts, H, D,
                                                           W, ratio, rpb, 512)
    store, ring, pool = _store(window, comp, 8 * len(lens) + 8)
    rope = rope_for(b.positions, 64)
    idx = comp_idx if with_pool else None
    inp = AttentionInput(q, kv_new, ring, sink, b.positions, b.seq_of, b.slots, b.start_pos, D ** -0.5,
                         pool if with_pool else None, b.block_table if with_pool else None, idx, ratio, rope,
                         rows_per_seq=lens[0], store=store)
    assert flashmla.serves_in_place(inp)
    assert flashmla.few_rows(6, H, q.device) and not flashmla.few_rows(q.shape[0], H, q.device)
    ref = sparse_attention(*inp.args()).float()
    out = flashmla.attend_in_place(inp, _unrotate)
    assert torch.isfinite(out).all()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 5e-3, err
    graph = torch.cuda.CUDAGraph()
    flashmla.attend_in_place(inp, _unrotate)  # warm (the kernels' first launches outside the capture)
    with torch.cuda.graph(graph):
        replayed = flashmla.attend_in_place(inp, _unrotate)
    store.fresh.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
