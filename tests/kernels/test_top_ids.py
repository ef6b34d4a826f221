"""The one-pass top-k ids kernel (mini/kernels/top_ids.py) against the torch form of the same rule
(mini.ops.indexer.top_groups_ordered without `widths`, the reference backend): equal ids and counts, bit for bit,
on fresh random bf16 rows with ties, ±0, -inf runs (invisible groups), +inf and subnormals, odd widths, k below,
at and above the valid count, outputs poisoned; NaNs (which the top-k takes as above +inf, then drops as invalid);
the op's dispatch. CPU: Triton's interpreter; gpu: compiled, at decode and prefill shapes, NaNs included."""
import pytest
import torch

import mini.ops
from mini.kernels import top_ids as kernel_module  # after tests/kernels/conftest.py chose the interpreter or not
from mini.ops.indexer import top_groups_ordered

pytestmark = pytest.mark.usefixtures("reference_ops")


def scores(T, N, device, seed, nan=False):
    """bf16 [T, N] index scores: relu-like zeros (ties), ±0, +inf, subnormals, and each row's tail of -inf (groups
    not yet visible) of a random length; `nan` adds NaNs of both signs."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, N, generator=g) * 4).clamp_min(-1).bfloat16()
    x[torch.rand(T, N, generator=g) < 0.3] = 0.0
    special = torch.tensor([-0.0, float("inf"), 1e-40, 2.5]).bfloat16()
    where = torch.rand(T, N, generator=g) < 0.1
    x = torch.where(where, special[torch.randint(0, 4, (T, N), generator=g)], x)
    visible = torch.randint(0, N + 1, (T, 1), generator=g)
    x = x.masked_fill(torch.arange(N) >= visible, float("-inf"))
    if nan:
        x[torch.rand(T, N, generator=g) < 0.05] = float("nan")
        x.view(torch.int16)[torch.rand(T, N, generator=g) < 0.02] = -1  # 0xFFFF: a negative NaN
    return x.to(device)


def visible(x):
    """[T] int32: each row's columns before its tail of -inf (what index_scores' n_visible bounds)."""
    finite = torch.arange(1, x.shape[-1] + 1, device=x.device) * (x != float("-inf"))
    return finite.amax(-1).int()


def poisoned(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(-7)
                        if kw.get("dtype") in (torch.int64, torch.int32) else empty(*a, **kw))


# 2049, 3000: three chunks of BLOCK, ids past one; 4096, 5000: one full and two chunks of WIDE_BLOCK
@pytest.mark.parametrize("T,N,k", [(1, 1, 1), (1, 37, 8), (3, 1000, 512), (5, 130, 130), (2, 2049, 64),
                                   (4, 600, 512), (2, 3000, 2500), (3, 4096, 512), (2, 5000, 700)])
@pytest.mark.parametrize("block", [kernel_module.BLOCK, kernel_module.WIDE_BLOCK], ids=["default", "wide"])
def test_ids_equal_the_torch_form_interpreter(interpreter, monkeypatch, T, N, k, block):
    x = scores(T, N, "cpu", seed=N + k)
    want_ids, want_count = top_groups_ordered(x, k)  # the reference backend: torch
    poisoned(monkeypatch)
    for radix in kernel_module.RADIXES:  # the k-th key's searches: the same ids
        ids, count = kernel_module.top_ids(x, min(k, N), block=block, radix=radix)
        assert ids.dtype == torch.int64 and count.dtype == torch.int32
        assert torch.equal(ids, want_ids) and torch.equal(count, want_count), radix
    # given each row's visible columns (exactly, or more: the -inf tail read anyway) it reads only those: same ids
    n_vis = visible(x)
    strided = torch.stack([n_vis, n_vis], dim=1)[:, 0]  # a view with stride 2: taken as its values
    for bound in (n_vis, (n_vis + 3).clamp(max=N), torch.full_like(n_vis, N), strided):
        ids, count = kernel_module.top_ids(x, min(k, N), block=block, n_visible=bound)
        assert torch.equal(ids, want_ids) and torch.equal(count, want_count)


# (block, chunks): 64 x 5 (the last part-full), 64 x 16 (MERGE_MAX's shape at k = 64: 1,024 candidates), 32 x 9
# with k 8, one chunk of 64 at k = 64, 16 x 9 at k = 5
@pytest.mark.parametrize("T,N,k,block", [(3, 300, 16, 64), (2, 1000, 64, 64), (4, 257, 8, 32), (2, 64, 64, 64),
                                         (2, 130, 5, 16)])
def test_split_equals_the_torch_form_interpreter(interpreter, monkeypatch, T, N, k, block):
    """`top_ids(split=True)`: chunks' candidates across programs, then their merge, give the torch form's ids and
    counts, bit for bit, with each radix search and any bound at or past each row's visible columns (chunks wholly
    past it give no candidates). (NaNs: the gpu test; the torch form on the CPU ranks them otherwise.)"""
    x = scores(T, N, "cpu", seed=N + k)
    n_vis = visible(x)
    n_vis[0] = 0  # a row with nothing visible
    x[0] = float("-inf")
    want_ids, want_count = top_groups_ordered(x, k)
    poisoned(monkeypatch)
    for radix in kernel_module.RADIXES[1:]:
        for bound in (n_vis, (n_vis + 3).clamp(max=N), torch.full_like(n_vis, N)):
            ids, count = kernel_module.top_ids(x, k, block=block, n_visible=bound, radix=radix, split=True)
            assert torch.equal(ids, want_ids) and torch.equal(count, want_count), (radix, bound.tolist())


def test_split_refuses_what_it_cannot_take():
    x = scores(2, 300, "cpu", seed=0)
    n_vis = visible(x)
    for kw, what in ((dict(n_visible=None), "n_visible None"), (dict(radix=0), "radix 0"),
                     (dict(block=48), "block 48"), (dict(block=8), "block 8")):
        with pytest.raises(ValueError, match=f"split takes.*{what}"):
            kernel_module.top_ids(x, 16, **{"n_visible": n_vis, "block": 64, **kw}, split=True)
    too_many = scores(1, kernel_module.MERGE_MAX * 2, "cpu", seed=0)
    with pytest.raises(ValueError, match="at most 8192 candidates"):
        kernel_module.top_ids(too_many, 512, block=512, n_visible=visible(too_many), split=True)


def test_visible_columns_must_be_one_integer_a_row():
    x = scores(2, 64, "cpu", seed=0)
    for bad in (torch.ones(3, dtype=torch.int32), torch.ones(2), torch.ones(2, 1, dtype=torch.int32)):
        with pytest.raises(ValueError, match="n_visible must be"):
            kernel_module.top_ids(x, 8, n_visible=bad)


def test_only_the_two_builds_are_taken():
    with pytest.raises(ValueError, match="neither BLOCK"):
        kernel_module.top_ids(scores(1, 64, "cpu", seed=0), 8, block=2048)
    with pytest.raises(ValueError, match="radix 3 is not one of"):
        kernel_module.top_ids(scores(1, 64, "cpu", seed=0), 8, radix=3)


def test_nans_count_as_the_largest_then_drop_interpreter(interpreter):
    """A NaN takes a top-k place (above +inf, as CUDA's keys order it) but is not a valid group: with k = 2 and
    two NaNs, nothing valid is left; with k = 4 the two best numbers remain, in column order."""
    x = torch.tensor([[1.0, float("nan"), 3.0, -2.0, float("nan"), 2.0]]).bfloat16()
    ids, count = kernel_module.top_ids(x, 2)
    assert ids.tolist() == [[-1, -1]] and count.tolist() == [0]
    ids, count = kernel_module.top_ids(x, 4)
    assert ids.tolist() == [[2, 5, -1, -1]] and count.tolist() == [2]


def test_the_op_takes_the_kernel_on_the_fast_backend_interpreter(interpreter, monkeypatch):
    calls = []
    real = kernel_module.top_ids
    monkeypatch.setattr(kernel_module, "top_ids", lambda *a, **kw: calls.append((a[1], kw["block"],
                                                                                  kw["n_visible"] is not None))
                        or real(*a, **kw))
    x = scores(3, 300, "cpu", seed=3)
    want = top_groups_ordered(x, 64)
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    try:
        got = top_groups_ordered(x, 64)
        top_groups_ordered(x.float(), 64)  # fp32 scores: the torch form
        top_groups_ordered(x, 500)  # k above N: min(k, N)
        wide = scores(2, kernel_module.FASTER_MAX_COLS + 1, "cpu", seed=4)
        assert all(torch.equal(a, b) for a, b in zip(top_groups_ordered(wide, 64),
                                                     real(wide, 64)))  # wider: the torch form (same ids)
        # given the visible columns (it walks only those): the wide build up to WIDE_MAX_COLS, beyond the torch form
        for n in (kernel_module.WIDE_MAX_COLS, kernel_module.WIDE_MAX_COLS + 1):
            span = scores(2, n, "cpu", seed=n)
            want_span = real(span, 64)
            assert all(torch.equal(a, b) for a, b in zip(top_groups_ordered(span, 64, visible(span)), want_span))
    finally:
        mini.ops.set_backend("reference")
    BLOCK, WIDE = kernel_module.BLOCK, kernel_module.WIDE_BLOCK
    assert calls == [(64, BLOCK, False), (300, BLOCK, False), (64, WIDE, True)]
    # decode-sized rows, bounded: the wide build at every width up to WIDE_MAX_COLS (one build the warm-up compiles);
    # prefill-sized rows: the 1,024-column build, bounded, up to BOUNDED_MAX_COLS; beyond, or unbounded, torch
    build_for, rows = kernel_module.build_for, kernel_module.WIDE_MAX_ROWS
    assert build_for(rows, 1, True) == build_for(rows, kernel_module.WIDE_MAX_COLS, True) == WIDE
    assert build_for(rows, kernel_module.WIDE_MAX_COLS + 1, True) is None
    assert build_for(rows + 1, 1, True) == build_for(rows + 1, kernel_module.BOUNDED_MAX_COLS, True) == BLOCK
    assert build_for(rows + 1, kernel_module.BOUNDED_MAX_COLS + 1, True) is None
    assert build_for(1, kernel_module.FASTER_MAX_COLS, False) == BLOCK
    assert build_for(1, kernel_module.FASTER_MAX_COLS + 1, False) is None
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not kernel_module.supported(torch.zeros(1, kernel_module.MAX_COLS + 1, dtype=torch.bfloat16), 8)


@pytest.mark.gpu
@pytest.mark.parametrize("T,N,k", [(1, 1024, 512), (64, 1024, 512), (1, 2048, 512), (64, 4096, 512),
                                   (1, 8192, 512), (7, 5000, 512),
                                   (4096, 1024, 512), (3, 16384, 2048), (2, 32768, 512),
                                   (2, 65536, 512)])
def test_ids_equal_the_torch_form_gpu(monkeypatch, T, N, k):
    x = scores(T, N, "cuda", seed=N + T, nan=True)
    want_ids, want_count = top_groups_ordered(x, k)  # the reference backend: torch on CUDA (NaN keys 0x7FFF)
    poisoned(monkeypatch)
    for block in (kernel_module.BLOCK, kernel_module.WIDE_BLOCK):  # both builds
        ids, count = kernel_module.top_ids(x, min(k, N), block=block)
        assert torch.equal(ids, want_ids) and torch.equal(count, want_count), block
    # bounded by each row's visible columns (NaNs only before them, as index_scores' -inf tail overwrites them)
    x = scores(T, N, "cuda", seed=N + T + 1)
    n_vis = visible(x)
    x = x.masked_fill((torch.rand(T, N, device="cuda") < 0.05) & (torch.arange(N, device="cuda") < n_vis[:, None]),
                      float("nan"))
    want_ids, want_count = top_groups_ordered(x, k)
    for block in (kernel_module.BLOCK, kernel_module.WIDE_BLOCK):
        for radix in kernel_module.RADIXES:  # the k-th key's searches (the micro-benchmark's sweep)
            ids, count = kernel_module.top_ids(x, min(k, N), block=block, n_visible=n_vis, radix=radix)
            assert torch.equal(ids, want_ids) and torch.equal(count, want_count), (block, radix)
    if -(-N // kernel_module.WIDE_BLOCK) * k <= kernel_module.MERGE_MAX:  # the split candidate, as the bench runs it
        for radix in kernel_module.RADIXES[1:]:
            ids, count = kernel_module.top_ids(x, k, block=kernel_module.WIDE_BLOCK, n_visible=n_vis, radix=radix,
                                               split=True)
            assert torch.equal(ids, want_ids) and torch.equal(count, want_count), ("split", radix)
