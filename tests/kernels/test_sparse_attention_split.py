"""The split-key decode path of the sparse MLA attention kernel (`k_split`, flash-decoding): each query's key list
walked in S contiguous runs of whole blocks, merged by log-sum-exp. Parity against the float64 oracle and the
reference op on fresh random data at odd sizes (1, 3, 7 and 17 rows; windows partly filled and wrapping; top-k lists
with -1 holes; lists that are not whole blocks; S = 1, 2, 3, 5 and more pieces than a list has blocks), every
allocation of the wrapper NaN-filled first, so that an unwritten output or partial shows. The CPU tests run under
Triton's interpreter (conftest.py); the gpu ones at V4.1 real shape."""
import pytest
import torch

from tests.kernels.test_sparse_attention import make_case, oracle, rope_for, rotated_oracle

pytestmark = pytest.mark.usefixtures("reference_ops")

# (lengths, starts) of the steps: decode rows at positions inside the first window (partly filled), past it (the
# ring wrapped) and far on; a prefill chunk among them
DECODE_1 = ([1], [13])
DECODE_3 = ([1, 1, 1], [2, 9, 40])
DECODE_17 = ([1] * 17, [0, 1, 3, 5, 6, 7, 8, 11, 16, 23, 31, 40, 57, 64, 77, 90, 121])
DECODE_7 = ([1] * 7, [0, 3, 6, 11, 23, 57, 121])  # (the slower interpreter tests)
MIXED = ([5, 1, 1], [0, 30, 3])
VERIFY_2x3 = ([3, 3], [13, 40])  # a verify step: each sequence's token and 2 drafts (the window wraps under them)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like return NaN-filled floating tensors while the test runs (the wrapper's output and
    its fp32 partials): an element no kernel writes reads NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() and t.numel() else t
    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def _run(case, k_split, dtype=torch.float32, rope_dim=0, prefill_lists=True, block_n=4, **kw):
    from mini.kernels.sparse_attention import sparse_mla_attention
    b, q, kv_new, window, comp, sink, comp_idx, ratio = case
    rope = rope_for(b.positions * 97, rope_dim) if rope_dim else None
    return sparse_mla_attention(q.to(dtype), kv_new.to(dtype), window.to(dtype), sink, b.positions, b.seq_of,
                                b.slots, b.start_pos, q.shape[-1] ** -0.5, comp=comp.to(dtype),
                                block_table=b.block_table, comp_idx=comp_idx, ratio=ratio, rope_out=rope,
                                prefill_lists=prefill_lists, block_h=8, block_n=block_n, num_warps=1,
                                k_split=k_split, **kw)


def _case(flat_batch, steps, H=5, D=32, W=8, ratio=2, rpb=4, topk=7, seed=0):
    torch.manual_seed(seed)
    b, q, kv_new, window, comp, sink, comp_idx = make_case(flat_batch, "cpu", torch.float32, *steps, H, D, W, ratio,
                                                           rpb, topk)
    return b, q, kv_new, window, comp, sink, comp_idx, ratio


@pytest.mark.parametrize("k_split", [1, 2, 3, 5])
@pytest.mark.parametrize("steps,D,rope_dim,d_split", [(DECODE_1, 32, 0, 2), (DECODE_3, 32, 8, 2),
                                                      (DECODE_17, 32, 0, 1), (MIXED, 128, 80, 2),
                                                      (VERIFY_2x3, 32, 8, 2)],
                         ids=["B1", "B3-rope", "B17-d1", "mixed-D128-rope", "verify-2x3-rope"])
def test_split_matches_oracle_interpreter(steps, D, rope_dim, d_split, k_split, interpreter, flat_batch, poisoned):
    """fp32 against the float64 oracle within the one-program kernel's bound (test_sparse_attention_interpreter):
    W 8 + top-k 7 in blocks of 4 gives lists of 2 to 4 blocks, some pieces empty at S = 3 and 5; at D 128 the
    combine's two column chunks, the RoPE across both."""
    case = _case(flat_batch, steps, D=D)
    b, q, kv_new, window, comp, sink, comp_idx, ratio = case
    out = _run(case, k_split, rope_dim=rope_dim, d_split=d_split)
    rope = rope_for(b.positions * 97, rope_dim) if rope_dim else None
    ref = rotated_oracle(q, kv_new, window, comp, sink, b, comp_idx, ratio, q.shape[-1] ** -0.5, rope)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_split_window_only_and_holes_interpreter(interpreter, flat_batch, poisoned):
    """A window-only layer (no compressed entries) and rows whose top-k is all -1 but for a few entries, split in
    more pieces than most lists have blocks."""
    case = _case(flat_batch, DECODE_7, topk=13, seed=3)
    b, q, kv_new, window, comp, sink, comp_idx, ratio = case
    comp_idx[::2, 2:] = -1  # holes: every other row keeps at most two groups
    for idx in (None, comp_idx):
        out = _run((*case[:6], idx, ratio), 5)
        ref = oracle(q, kv_new, window, comp, sink, b, idx, ratio, q.shape[-1] ** -0.5)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_one_piece_lists_keep_the_one_program_bits_interpreter(interpreter, flat_batch, poisoned):
    """A list that fits one piece (the others empty) merges with scales exp2(0) = 1 and exp2(-1e30 - M) = 0: the
    one-program path's bits exactly, the RoPE epilogue included. Blocks of 64 hold every list here."""
    case = _case(flat_batch, DECODE_7, seed=5)
    base = _run(case, 1, rope_dim=8, block_n=64)
    for k_split in (2, 3):
        assert torch.equal(_run(case, k_split, rope_dim=8, block_n=64), base)


@pytest.mark.parametrize("prefill_lists", [True, False])
def test_fixed_split_row_alone_equals_batched_interpreter(prefill_lists, interpreter, flat_batch):
    """With a fixed S a row's pieces depend on its own list only: a decode row alone == among 6 others, bitwise
    (the property the deterministic mode needs, mini.ops.deterministic)."""
    from mini.kernels.sparse_attention import sparse_mla_attention
    b, q, kv_new, window, comp, sink, comp_idx, ratio = _case(flat_batch, DECODE_7, topk=11, seed=7)
    comp_idx[3, 4:] = -1

    def run(rows):
        s = torch.as_tensor(rows)
        return sparse_mla_attention(q[s], kv_new[s], window, sink, b.positions[s], torch.arange(len(rows)),
                                    b.slots[s], b.start_pos[s], q.shape[-1] ** -0.5, comp=comp,
                                    block_table=b.block_table[s], comp_idx=comp_idx[s], ratio=ratio,
                                    prefill_lists=prefill_lists, block_h=8, block_n=4, num_warps=1, k_split=3)
    both = run(list(range(7)))
    for r in (0, 3, 6):
        assert torch.equal(run([r])[0], both[r]), f"row {r}"


def test_split_choice(monkeypatch, interpreter, flat_batch):
    """split_pieces: one wave of programs, no more pieces than blocks, pieces of balanced whole blocks, none where
    the grid half fills the GPU; only decode steps and static verify steps (T = B x rows_per_seq) are split unasked
    (k_split=None), and not the deterministic mode's lists (prefill_lists=False)."""
    from mini.kernels import sparse_attention as sa
    assert [sa.split_pieces(p, 10, 132) for p in (2, 8, 32, 64, 66, 67, 128, 512)] == [10, 10, 4, 2, 2, 1, 1, 1]
    assert sa.split_pieces(2, 3, 132) == 3 and sa.split_pieces(40, 10, 132) == 3  # 10 blocks: 4, 4, 2
    for programs in range(1, 140):
        for blocks in range(1, 12):
            s = sa.split_pieces(programs, blocks, 132)
            assert 1 <= s <= blocks and (s == 1 or programs * s <= 132)
    case = _case(flat_batch, DECODE_3)
    with pytest.raises(ValueError, match="k_split"):
        _run(case, 0)
    calls, combine = [], sa._combine_kernel

    class Spy:  # records the pieces of each combine launched
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append(kw["N_PIECES"]) or combine[grid](*a, **kw)
    monkeypatch.setattr(sa, "_combine_kernel", Spy())
    _run(case, None, prefill_lists=False)
    _run(_case(flat_batch, MIXED), None)
    assert calls == []
    _run(case, None)  # 3 rows x 1 head tile x 2 halves: split in as many pieces as the lists' 4 blocks (W 8 + 7)
    assert calls == [4]
    verify = _case(flat_batch, VERIFY_2x3)
    _run(verify, None)  # 6 rows of 2 sequences, not said to be a static verify step: one program
    _run(verify, None, rows_per_seq=2)  # the wrong width: one program
    assert calls == [4]
    _run(verify, None, rows_per_seq=3)
    assert calls == [4, 4]
    calls.clear()
    _run(case, 4)
    assert calls == [4]


def test_split_bf16_distance_to_reference_op_interpreter(interpreter, flat_batch, poisoned):
    """bf16 (P rounded to bf16 before PV, as on the GPU): the split and the one-program walk each within the bound
    the gpu parity test allows the one-program kernel against mini.ops.attention's reference (relative norm 5e-3)."""
    from mini.ops.attention import sparse_attention
    case = _case(flat_batch, DECODE_7, H=6, D=64, W=16, topk=21, seed=11)
    b, q, kv_new, window, comp, sink, comp_idx, ratio = case
    bf = torch.bfloat16
    ref = sparse_attention(q.to(bf), kv_new.to(bf), window.to(bf), sink, b.positions, b.seq_of, b.slots, b.start_pos,
                           q.shape[-1] ** -0.5, comp=comp.to(bf), block_table=b.block_table, comp_idx=comp_idx,
                           ratio=ratio, rope_out=rope_for(b.positions * 97, 16)).float()
    errs = {}
    for k_split in (1, 3):
        out = _run(case, k_split, dtype=bf, rope_dim=16)
        assert torch.isfinite(out).all()
        errs[k_split] = ((out.float() - ref).norm() / ref.norm()).item()
    print("relative distance to the reference op, one-program vs split:", errs)
    assert max(errs.values()) < 5e-3, errs


@pytest.mark.gpu
@pytest.mark.parametrize("k_split", [None, 2, 3, 5, 10, 16])
@pytest.mark.parametrize("lens,starts,topk,rope_dim", [
    ([1], [4095], 512, 64),
    ([1] * 3, [60, 1000, 32767], 512, 64),  # a window partly filled; groups fewer than the top-k (-1 holes)
    ([1] * 17, [40000 + 997 * i for i in range(17)], 512, 0),
    ([1] * 64, [3 + 517 * i for i in range(64)], 509, 64),  # a list not whole blocks
    ([6], [4090], 512, 64),  # a static verify step: the token and 5 drafts (k_split None: split by rows_per_seq)
    ([6] * 3, [200, 9000, 32760], 512, 64),
], ids=["B1", "B3", "B17", "B64", "verify-B1x6", "verify-B3x6"])
def test_split_real_shape_gpu(lens, starts, topk, rope_dim, k_split, flat_batch, poisoned):
    """V4.1 real shape (64 heads, D 512, W 128, ratio 4): the split walk and the one-program walk each within
    5e-3 (relative norm) of mini.ops.attention's reference, as test_sparse_attention_matches_reference_op asks of
    the one-program kernel, decode rows and verify steps' rows (each sequence's token and its drafts); a fixed S
    keeps a decode row alone == batched."""
    from mini.kernels.sparse_attention import sparse_mla_attention
    from mini.ops.attention import sparse_attention
    H, D, W, ratio, rpb = 64, 512, 128, 4, 64
    torch.manual_seed(len(lens) + topk)
    b, q, kv_new, window, comp, sink, comp_idx = make_case(flat_batch, "cuda", torch.bfloat16, lens, starts, H, D, W,
                                                           ratio, rpb, topk)
    args = (q, kv_new, window, sink, b.positions, b.seq_of, b.slots, b.start_pos, D ** -0.5)
    kw = dict(comp=comp, block_table=b.block_table, comp_idx=comp_idx, ratio=ratio,
              rope_out=rope_for(b.positions, rope_dim) if rope_dim else None)
    ref = sparse_attention(*args, **kw).float()
    base = sparse_mla_attention(*args, **kw, k_split=1)
    split = sparse_mla_attention(*args, **kw, k_split=k_split, rows_per_seq=lens[0])
    assert torch.isfinite(base).all() and torch.isfinite(split).all()
    err_base = ((base.float() - ref).norm() / ref.norm()).item()
    err_split = ((split.float() - ref).norm() / ref.norm()).item()
    print(f"B={len(lens)} k_split={k_split}: one-program {err_base:.3e}, split {err_split:.3e}")
    assert err_base < 5e-3 and err_split < 5e-3, (err_base, err_split)
    if k_split is not None and len(lens) > 1 and lens[0] == 1:
        r = len(lens) // 2
        one = (q[r:r + 1], kv_new[r:r + 1], window, sink, b.positions[r:r + 1], b.seq_of[:1] * 0, b.slots[r:r + 1],
               b.start_pos[r:r + 1], D ** -0.5)
        alone = sparse_mla_attention(*one, **dict(kw, block_table=b.block_table[r:r + 1],
                                                  comp_idx=comp_idx[r:r + 1],
                                                  rope_out=None if kw["rope_out"] is None else kw["rope_out"][r:r + 1]),
                                     k_split=k_split)
        assert torch.equal(alone[0], split[r])


@pytest.mark.parametrize("seed", range(6))
def test_split_fuzz_interpreter(seed, interpreter, flat_batch, poisoned):
    """Seeded configurations nobody chose: heads, head and RoPE widths, window, pool rows, top-k, key block, rows
    (decode rows and short chunks at random positions) and S, against the float64 oracle."""
    g = torch.Generator().manual_seed(1000 + seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=g))]
    H, D, W, block_n = pick(1, 3, 5, 9), pick(16, 32, 64), pick(3, 5, 8, 13), pick(4, 8, 16)
    ratio, rpb, topk = pick(1, 2, 4), pick(2, 4), pick(0, 1, 6, 11)
    rope_dim = pick(0, 2 * int(torch.randint(1, D // 2, (1,), generator=g)))
    B = pick(1, 2, 5)
    lens = [pick(1, 1, 2, 4) for _ in range(B)]
    starts = [pick(0, int(torch.randint(0, 60, (1,), generator=g))) for _ in range(B)]
    k_split = pick(2, 3, 4, 7)
    case = _case(flat_batch, (lens, starts), H=H, D=D, W=W, ratio=ratio, rpb=rpb, topk=max(topk, 1), seed=seed)
    b, q, kv_new, window, comp, sink, comp_idx, ratio = case
    idx = comp_idx if topk else None
    out = _run((*case[:6], idx, ratio), k_split, rope_dim=rope_dim, block_n=block_n)
    rope = rope_for(b.positions * 97, rope_dim) if rope_dim else None
    ref = rotated_oracle(q, kv_new, window, comp, sink, b, idx, ratio, D ** -0.5, rope)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
