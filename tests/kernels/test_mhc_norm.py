"""Parity of the fused mHC + RMSNorm kernel with mini.ops.mhc (mixes, collapse) and mini.ops.norm.rms_norm, plus
the optional FP8 fake quant of the normed output (mini.formats.fake_quant_fp8). Fresh random data, odd token
counts, NaN-poisoned outputs."""
import pytest
import torch
import triton
import triton.language as tl

from mini.formats import fake_quant_fp8
from mini.kernels.mhc_norm import _dot_pieces, fn_pieces  # after tests/kernels/conftest.py chose the interpreter or not
from mini.ops.mhc import collapse, mixes
from mini.ops.norm import rms_norm

pytestmark = pytest.mark.usefixtures("reference_ops")

HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-20


def make(T, D, device, dtype):
    h = torch.randn(T, HC, D, device=device).to(dtype)
    fn = torch.randn((2 + HC) * HC, HC * D, device=device) * 0.05
    scale = torch.rand(3, device=device) + 0.5
    base = torch.randn((2 + HC) * HC, device=device)
    w = (torch.rand(D, device=device) + 0.5).to(dtype)
    pre_prev = torch.rand(T, HC, device=device)
    return h, fn, scale, base, w, pre_prev


def reference(h, fn, scale, base, w, pre_prev, quant):
    pre, post, comb = mixes(h, fn, scale, base, hc_mult=HC, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    y = rms_norm(collapse(h, pre if pre_prev is None else pre_prev), w, NORM_EPS)
    return (fake_quant_fp8(y, 32) if quant else y), pre, post, comb


def check(h, fn, scale, base, w, pre_prev, quant, **kw):
    from mini.kernels.mhc_norm import mhc_norm
    y, pre, post, comb = mhc_norm(h, fn, scale, base, w, pre_in=pre_prev, iters=ITERS, hc_eps=HC_EPS,
                                  norm_eps=NORM_EPS, quant="fp8" if quant else None, **kw)
    ry, rpre, rpost, rcomb = reference(h, fn, scale, base, w, pre_prev, quant)
    for got in (y, pre, post, comb):
        assert torch.isfinite(got).all()
    # m sums hc*D = 20480 fp32 products in another order, with cancellation: ~1e-5 relative after the sigmoids
    torch.testing.assert_close(pre, rpre, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(post, rpost, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(comb, rcomb, rtol=5e-4, atol=2e-5)
    # y: one bf16 ulp where fp32 sums in another order round the other way, or one e4m3 step (up to 1/8 of the
    # smaller neighbour) with the FP8 quant. Without a given pre (V4), the collapse uses the kernel's own pre
    # (~2e-5 relative off): near-cancelled elements then differ by that much of the row's scale.
    # Two bf16 roundings (collapse, norm) can each flip: 2e-2 relative.
    tol = 0.13 if quant else (2e-2 if y.dtype == torch.bfloat16 else 1e-5)
    row = ry.float().square().mean(-1, keepdim=True).sqrt()
    atol = (2e-3 if pre_prev is None else 1e-5) * row
    if quant:
        # a 1x32 block whose amax rounds across a power of two gets twice the scale s on one side: its smallest
        # values then land on the other grid, up to a few subnormal e4m3 steps (s * 2^-9) apart
        amax = ry.float().unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
        atol = atol + (4 * 2 * amax / 448 * 2.0 ** -9).expand(*amax.shape[:-1], 32).flatten(-2)
    assert ((y.float() - ry.float()).abs() <= tol * ry.float().abs() + atol).all()
    if y.dtype == torch.bfloat16 and not quant:  # a pre off by 3e-5 flips ~2% of the elements (checked on CPU)
        assert (y != ry).float().mean() < (0.03 if pre_prev is None else 0.01)
    if y.dtype == torch.bfloat16 and quant:  # each bf16 flip can move an FP8 rounding too: 3.1% seen on the H200
        assert (y != ry).float().mean() < 0.06


@pytest.mark.parametrize("delayed,quant", [(True, False), (False, True)])
def test_mhc_norm_interpreter(delayed, quant, interpreter):
    # fp32 stream (the fp32 dot): the interpreter casts fp32 -> bf16 by truncation, the GPU rounds to nearest
    # even. D = 96 in two split-K chunks of 64 columns, the second one partial; 5 tokens in 4-token blocks
    h, fn, scale, base, w, pre_prev = make(5, 96, "cpu", torch.float32)
    check(h, fn, scale, base, w, pre_prev if delayed else None, quant, block_t=4, block_k=64, split=2,
          finish_block_t=2, block_d=64)


@pytest.mark.parametrize("delayed,layout", [(True, "side_by_side"), (False, "side_by_side"), (True, "copies"),
                                            (False, "copies")])
def test_mhc_norm_interpreter_bf16_stream(delayed, layout, interpreter):
    """The bf16 stream's path (fn's three bf16 pieces), three split-K chunks of 64, 64 and 22 columns in steps of 16
    (the last step partial), with the copies side by side in one tile or one tile each. The mixes keep the GPU
    tolerances; y only within two truncations (the interpreter rounds fp32 -> bf16 towards 0)."""
    from mini.kernels.mhc_norm import mhc_norm
    h, fn, scale, base, w, pre_prev = make(7, 150, "cpu", torch.bfloat16)
    pre_in = pre_prev if delayed else None
    y, pre, post, comb = mhc_norm(h, fn, scale, base, w, pre_in=pre_in, iters=ITERS, hc_eps=HC_EPS,
                                  norm_eps=NORM_EPS, block_t=4, block_k=16, split=3, finish_block_t=4, block_d=64,
                                  layout=layout)
    ry, rpre, rpost, rcomb = reference(h, fn, scale, base, w, pre_in, False)
    torch.testing.assert_close(pre, rpre, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(post, rpost, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(comb, rcomb, rtol=5e-4, atol=2e-5)
    row = ry.float().square().mean(-1, keepdim=True).sqrt()
    atol = (2e-3 if pre_in is None else 1e-5) * row
    assert ((y.float() - ry.float()).abs() <= 2.0 ** -6 * ry.float().abs() + atol).all()


COPIES = dict(layout="copies")


@pytest.mark.gpu
@pytest.mark.parametrize("T,D,delayed,quant,tiles", [(333, 5120, True, False, {}), (333, 5120, True, True, {}),
                                                     (333, 5120, False, False, {}), (77, 1000, True, False, {}),
                                                     (77, 5120, True, False, dict(split=40)),
                                                     (333, 5120, True, False, COPIES), (333, 5120, True, True, COPIES),
                                                     (333, 5120, False, False, COPIES),
                                                     (77, 1000, True, False, COPIES),
                                                     (77, 5120, True, False, dict(COPIES, num_stages=2, split=40)),
                                                     (333, 5120, True, True, dict(block_t=128, split=80)),
                                                     (333, 5120, True, True, dict(block_t=256, split=160))])
def test_mhc_norm_gpu(T, D, delayed, quant, tiles):
    # D = 1000: the last split-K chunk and the last column tiles are partial; split 40: 128-column chunks of one
    # program each, and layout "copies": what `tools/mhc_split.py` times; 128- and 256-token blocks: what
    # `mini bench kernels --only decode_small` times at 256 and 384 rows
    h, fn, scale, base, w, pre_prev = make(T, D, "cuda", torch.bfloat16)
    check(h, fn, scale, base, w, pre_prev if delayed else None, quant, **tiles)


def test_fn_pieces_sum_exactly_to_fn():
    """hi + mid + lo == fn in float64 (no bit of fn lost), each piece a bf16 value, fn transposed into K-major rows
    with zero columns past NM; two pieces alone would lose fn's last bits."""
    fn = torch.randn(24, 4 * 37) * torch.exp2(torch.randint(-20, 20, (24, 4 * 37)).float())
    pieces = fn_pieces(fn)
    assert pieces.dtype == torch.bfloat16 and pieces.shape == (3, 4 * 37, 32)
    assert torch.equal(pieces.double().sum(0)[:, :24], fn.double().T)
    assert not pieces[:, :, 24:].any()
    assert (pieces[:2].double().sum(0)[:, :24] != fn.double().T).float().mean() > 0.5


def test_pieces_are_cached_per_weight_tensor():
    from mini.kernels.mhc_norm import _PIECES, _pieces_of
    fn = torch.randn(24, 64)
    first = _pieces_of(fn)
    assert _pieces_of(fn) is first and torch.equal(first, fn_pieces(fn))
    other = fn.clone()  # same values, another tensor: its own entry
    assert _pieces_of(other) is not first
    key = id(fn)
    del fn, first
    assert key not in _PIECES  # dropped with its weight


@triton.jit
def _split_dot_kernel(x_ptr, p_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, OP: tl.constexpr):
    r, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    x = tl.load(x_ptr + r[:, None] * K + k[None, :])
    p = p_ptr + k[:, None] * N + n[None, :]
    hi, mid, lo = tl.load(p), tl.load(p + K * N), tl.load(p + 2 * K * N)
    tl.store(out_ptr + r[:, None] * N + n[None, :], _dot_pieces(x, hi, mid, lo, tl.zeros([M, N], tl.float32), OP))


def check_split_dot(device, M, K, N, op):
    """x (bf16) @ f (fp32) through the three pieces gives every product exactly: with one nonzero per row of x, each
    output is x*hi + x*mid + x*lo, three exact products summed in the fp32 accumulator. x*hi + x*mid can span 25
    bits, so the sum may round twice (towards zero on the tensor cores: 1.1 ulp seen on the H200), within 2^-22
    relative. A split that dropped the third piece (fn's last 8 bits) would be ~2^-17 off instead."""
    x = torch.zeros(M, K)
    x[torch.arange(M), torch.randperm(K)[:M]] = torch.randn(M)
    x = x.to(device).bfloat16()
    f = torch.randn(K, N, device=device) * torch.exp2(torch.randint(-20, 20, (K, N), device=device).float())
    pieces = fn_pieces(f.T)[:, :, :N].contiguous()  # fn_pieces takes fn as [N, K]
    out = torch.full((M, N), float("nan"), device=device)
    _split_dot_kernel[(1,)](x, pieces, out, M=M, K=K, N=N, OP=op)
    exact = x.double() @ f.double()
    bound = 2.0 ** -22 * exact.abs()
    assert ((out.double() - exact).abs() <= bound).all()
    two_pieces = pieces[:2].double().sum(0)
    assert ((x.double() @ two_pieces - exact).abs() > bound).float().mean() > 0.5


def test_split_dot_interpreter(interpreter):
    check_split_dot("cpu", 16, 32, 8, tl.float32)  # the interpreter's bf16 dot is broken: fp32 tiles, same values


@pytest.mark.gpu
def test_split_dot_gpu():
    check_split_dot("cuda", 64, 128, 32, tl.bfloat16)


def test_mhc_norm_refuses_an_unknown_layout_or_copies_of_fp32():
    from mini.kernels.mhc_norm import mhc_norm
    h, fn, scale, base, w, pre_prev = make(3, 64, "cpu", torch.float32)
    kw = dict(pre_in=pre_prev, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    with pytest.raises(ValueError, match="layout 'rows'"):
        mhc_norm(h.bfloat16(), fn, scale, base, w, layout="rows", **kw)
    with pytest.raises(ValueError, match="bf16 stream"):
        mhc_norm(h, fn, scale, base, w, layout="copies", **kw)


def test_mhc_norm_copies_writes_every_output_interpreter(interpreter, monkeypatch):
    """Every buffer the wrapper allocates (outputs and split-K partials) starts as NaN: the one-tile-per-copy pass
    and the finishing pass must write all of it (9 tokens in blocks of 4, D = 96 in chunks of 48 and 48)."""
    from mini.kernels.mhc_norm import mhc_norm
    h, fn, scale, base, w, pre_prev = make(9, 96, "cpu", torch.bfloat16)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    out = mhc_norm(h, fn, scale, base, w, pre_in=pre_prev, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS,
                   block_t=4, block_k=16, split=2, finish_block_t=4, block_d=32, layout="copies")
    monkeypatch.undo()
    for got in out:
        assert not got.isnan().any()
    ref = reference(h, fn, scale, base, w, pre_prev, False)
    torch.testing.assert_close(out[1], ref[1], rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("T", [1, 3, 16, 65])
@pytest.mark.parametrize("delayed", [True, False])
def test_mhc_norm_small_steps_interpreter(T, delayed, interpreter, monkeypatch):
    """The tiles chosen by T (`partial_tiles`): up to 16 tokens one 16-token block, D = 150 cut into one chunk per
    16-column step (10 chunks: more than the finishing pass's 8 partials per loop step, the last step partial);
    65 tokens two 64-token blocks. NaN-poisoned buffers; the mixes within the GPU tolerances of the reference."""
    from mini.kernels.mhc_norm import mhc_norm, partial_tiles
    assert partial_tiles(T, 150, 16, invariant=False) == ((16 if T <= 16 else 64), 10)
    h, fn, scale, base, w, pre_prev = make(T, 150, "cpu", torch.bfloat16)
    pre_in = pre_prev if delayed else None
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    y, pre, post, comb = mhc_norm(h, fn, scale, base, w, pre_in=pre_in, iters=ITERS, hc_eps=HC_EPS,
                                  norm_eps=NORM_EPS, block_d=64)
    monkeypatch.undo()
    for got in (y, pre, post, comb):
        assert not got.isnan().any()
    ry, rpre, rpost, rcomb = reference(h, fn, scale, base, w, pre_in, False)
    torch.testing.assert_close(pre, rpre, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(post, rpost, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(comb, rcomb, rtol=5e-4, atol=2e-5)
    row = ry.float().square().mean(-1, keepdim=True).sqrt()
    atol = (2e-3 if pre_in is None else 1e-5) * row
    assert ((y.float() - ry.float()).abs() <= 2.0 ** -6 * ry.float().abs() + atol).all()


@pytest.mark.parametrize("T", [1, 3])
def test_mhc_norm_many_partials_interpreter(T, interpreter, monkeypatch):
    """D = 2,560: 160 chunks of one 16-column step at decode sizes, so the finishing pass takes one token per
    program and 160 partials (of a 256-wide tile) in one load, and walks D in 2,048-column steps (the second
    partial). NaN-poisoned buffers; the mixes within the GPU tolerances of the reference, y within the
    interpreter's truncations."""
    from mini.kernels.mhc_norm import finish_tiles, mhc_norm, partial_tiles
    assert partial_tiles(T, 2560, 16, False) == (16, 160) and finish_tiles(160, False) == (1, 2048)
    h, fn, scale, base, w, pre_prev = make(T, 2560, "cpu", torch.bfloat16)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    y, pre, post, comb = mhc_norm(h, fn, scale, base, w, pre_in=pre_prev, iters=ITERS, hc_eps=HC_EPS,
                                  norm_eps=NORM_EPS, quant="fp8")
    monkeypatch.undo()
    for got in (y, pre, post, comb):
        assert not got.isnan().any()
    ry, rpre, rpost, rcomb = reference(h, fn, scale, base, w, pre_prev, False)
    torch.testing.assert_close(pre, rpre, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(post, rpost, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(comb, rcomb, rtol=5e-4, atol=2e-5)
    ry = fake_quant_fp8(ry, 32)
    amax = ry.float().unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    atol = (4 * 2 * amax / 448 * 2.0 ** -9).expand(*amax.shape[:-1], 32).flatten(-2)
    assert ((y.float() - ry.float()).abs() <= 0.13 * ry.float().abs() + atol).all()


@pytest.mark.parametrize("T,quant", [(1, "fp8"), (5, None)])
def test_normalisation_in_its_own_programs_gives_the_same_bits_interpreter(T, quant, interpreter, monkeypatch):
    """At decode V4.1's delayed collapse normalises each column step in its own program beside the mixes'
    (`finish_pieces`): every output bit-equal to the one-program walk, every element written (NaN-poisoned)."""
    from mini.kernels import mhc_norm as module
    assert module.finish_pieces(1, 160, 64, True, False, 132) == 3  # the last piece partial
    assert module.finish_pieces(1, 160, 64, False, False, 132) == 1  # V4: the collapse needs this block's pre
    assert module.finish_pieces(1, 160, 64, True, True, 132) == 1  # the deterministic mode
    assert module.finish_pieces(67, 160, 64, True, False, 132) == 1  # the token blocks fill the GPU
    h, fn, scale, base, w, pre_prev = make(T, 160, "cpu", torch.bfloat16)
    kw = dict(pre_in=pre_prev, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, quant=quant, block_d=64)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    pieces = module.mhc_norm(h, fn, scale, base, w, **kw)
    monkeypatch.setattr(module, "finish_pieces", lambda *a: 1)
    one = module.mhc_norm(h, fn, scale, base, w, **kw)
    for a, b in zip(pieces, one):
        assert not a.isnan().any() and torch.equal(a, b)


def test_finish_tiles():
    """The finishing pass: 8 x 512 in the deterministic mode and at few partials; fewer tokens per program and
    wider column steps as the partials grow (tokens x splits stays <= 256)."""
    from mini.kernels.mhc_norm import finish_tiles
    for n in (1, 8, 10, 160):
        assert finish_tiles(n, invariant=True) == (8, 512)
    assert [finish_tiles(n, invariant=False) for n in (8, 10, 20, 40, 80, 160)] == [
        (8, 512), (8, 512), (8, 512), (4, 1024), (2, 2048), (1, 2048)]


def test_partial_tiles_follow_t_only_outside_the_deterministic_mode():
    """V4.1's D = 5120 in 16-column steps: the 4,096-token tiles (64-token blocks, 8 chunks) at every T when
    invariant; by T otherwise, ~160 programs at decode sizes and the 4,096-token tiles from 1,025 tokens."""
    from mini.kernels.mhc_norm import INVARIANT_TILES, partial_tiles
    for T in (1, 3, 16, 17, 64, 65, 256, 1000, 4096, 16384):
        assert partial_tiles(T, 5120, 16, invariant=True) == INVARIANT_TILES == (64, 8)
    assert partial_tiles(1, 5120, 16, invariant=False) == (16, 160)
    assert partial_tiles(16, 5120, 16, invariant=False) == (16, 160)
    assert partial_tiles(64, 5120, 16, invariant=False) == (64, 160)
    assert partial_tiles(256, 5120, 16, invariant=False) == (64, 40)
    assert partial_tiles(4096, 5120, 16, invariant=False) == (64, 8)
    assert partial_tiles(1000, 5120, 16, invariant=False) == (64, 10)
    assert partial_tiles(1, 64, 16, invariant=False) == (64, 8)  # 4 steps: no more chunks than the 4,096's
    # few kernel builds (the warm-up compiles each): chunks of 2, 4, 8, 16, 32 steps or the 4,096-token tiles
    assert len({partial_tiles(T, 5120, 16, invariant=False) for T in range(1, 4097)}) == 7


def test_mhc_norm_invariant_rows_alone_equal_batched_interpreter(interpreter, monkeypatch):
    """invariant=True (what mini.ops.mhc passes in the deterministic mode): a token's outputs alone (T = 1) and
    among 129 tokens are the same bits. With ~16 programs as the target (scaled down from 160 so that the choice
    moves at an interpreter-sized T), the default tiles differ: 16-token blocks in 10 chunks alone, 64-token blocks
    in 8 chunks among 129, and the mixes' fp32 sums move (checked, so the comparison can fail)."""
    import mini.kernels.mhc_norm as kernel
    monkeypatch.setattr(kernel, "SMALL_STEP_PROGRAMS", 16)
    assert kernel.partial_tiles(1, 150, 16, False) == (16, 10) and kernel.partial_tiles(129, 150, 16, False) == (64, 8)
    h, fn, scale, base, w, pre_prev = make(129, 150, "cpu", torch.bfloat16)
    rows = (0, 77, 128)

    def alone_vs_batched(invariant):
        kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, block_d=64, invariant=invariant)
        batched = kernel.mhc_norm(h, fn, scale, base, w, pre_in=pre_prev, **kw)
        alone = [kernel.mhc_norm(h[i:i + 1], fn, scale, base, w, pre_in=pre_prev[i:i + 1], **kw) for i in rows]
        return [torch.equal(a[j][0], batched[j][i]) for a, i in zip(alone, rows) for j in range(4)]
    assert all(alone_vs_batched(True))
    assert not all(alone_vs_batched(False))


def test_deterministic_mode_passes_invariant_tiles(monkeypatch):
    """mini.ops.mhc's fast path asks for the invariant tiles exactly while the deterministic mode is on."""
    import mini.kernels.mhc_norm as kernel
    import mini.ops
    from mini.ops import mhc
    seen = []
    monkeypatch.setattr(kernel, "mhc_norm", lambda *a, **kw: seen.append(kw["invariant"]) or (None,) * 4)
    monkeypatch.setattr(mhc, "use_fast", lambda *t: True)
    h, fn, scale, base, w, pre_prev = make(3, 64, "cpu", torch.bfloat16)
    kw = dict(hc_mult=HC, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    for on in (False, True):
        with mini.ops.deterministic_mode(on):
            mhc.pre_norm(h, fn, scale, base, w, pre_prev, **kw)
            mhc.mixes(h, fn, scale, base, **kw)
    assert seen == [False, False, True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 16, 65])
@pytest.mark.parametrize("delayed,quant", [(True, False), (True, True), (False, False)])
def test_mhc_norm_small_steps_gpu(T, delayed, quant):
    """Decode sizes at V4.1's D with the tiles chosen by T (160 chunks at T <= 64)."""
    h, fn, scale, base, w, pre_prev = make(T, 5120, "cuda", torch.bfloat16)
    check(h, fn, scale, base, w, pre_prev if delayed else None, quant)


@pytest.mark.gpu
def test_mhc_norm_invariant_rows_alone_equal_batched_gpu():
    """The deterministic mode's tiles at V4.1 shape: a token alone == among 1, 16 and 333 tokens, bit for bit."""
    from mini.kernels.mhc_norm import mhc_norm
    h, fn, scale, base, w, pre_prev = make(333, 5120, "cuda", torch.bfloat16)
    kw = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, invariant=True, quant="fp8")
    batched = mhc_norm(h, fn, scale, base, w, pre_in=pre_prev, **kw)
    for n in (1, 16):
        some = mhc_norm(h[:n], fn, scale, base, w, pre_in=pre_prev[:n], **kw)
        for a, b in zip(some, batched):
            assert torch.equal(a, b[:n])
