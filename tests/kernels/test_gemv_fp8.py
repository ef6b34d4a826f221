"""The FP8 decode GEMV (mini/kernels/gemv_fp8.py) against the official blockwise arithmetic
(mini.ops.linear.blockwise_gemm): on CPU under the interpreter with small tiles (splits, N tails, K tails, V4.1's
32-wide and V4's 128-wide blocks, scale tiles 2^-10..2^5 apart so that a misplaced scale shows), on the GPU at
V4.1's projection shapes on the FP8 tensor cores; and mini.ops.linear's dispatch under MINI_GEMV_WEIGHTS=fp8."""
import pytest
import torch

from mini.formats import quantize_fp8
from mini.kernels.gemv import GemvConfig
from mini.kernels.gemv_fp8 import CANDIDATES, gemv_fp8
from mini.ops.linear import QWeight, blockwise_gemm

SMALL = GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1, programs_per_sm=1)
SMALL_K64 = GemvConfig(block_n=16, block_k=64, num_warps=1, num_stages=1, programs_per_sm=1)
SMALL_K128 = GemvConfig(block_n=16, block_k=128, num_warps=1, num_stages=1, programs_per_sm=1)


def _weight(N, K, block, device, seed=0):
    """An FP8 weight as a checkpoint holds it: e4m3 bytes and E8M0 scales per block x block tile, tiles 2^-10..2^5
    apart."""
    g = torch.Generator().manual_seed(seed)
    tiles = torch.exp2(torch.randint(-10, 6, (-(-N // block), K // block), generator=g).float())
    w = torch.randn(N, K, generator=g) / K ** 0.5 * tiles.repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)
    q, scale = quantize_fp8(w, block)
    return q.to(device), scale.to(device)


def _x(T, K, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g) * 2
    x[0, :32] *= 1000  # groups of very different scales
    return x.bfloat16().to(device)


def _check(y, x, q, scale, block, spread_tol):
    """Within `spread_tol` of the sum of |products| of the blockwise reference (the tensor core's block sums and the
    split's order), plus half a bf16 ulp where y is bf16."""
    ref = blockwise_gemm(x, QWeight("fp8", q, scale, block)).double()
    spread = blockwise_gemm(x.abs(), QWeight("fp8", q.float().abs().to(q.dtype), scale, block)).double()
    err = (y.double() - ref).abs()
    rounding = ref.abs() * 2.0 ** -8 if y.dtype == torch.bfloat16 else 0
    assert not torch.isnan(y).any()
    assert (err <= rounding + spread * spread_tol).all(), f"max error {(err / spread.clamp_min(1e-30)).max():.3g}"
    return ref


@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("N,K,block,config", [(37, 320, 32, SMALL), (100, 96, 32, SMALL_K64),
                                              (150, 256, 128, SMALL_K128), (70, 384, 128, SMALL_K128)],
                         ids=["10 pieces, N tail", "K tail in a step", "V4 blocks", "V4 blocks, 3 pieces"])
def test_gemv_fp8_is_the_blockwise_gemm_interpreted(interpreter, T, N, K, block, config):
    q, scale = _weight(N, K, block, "cpu", seed=N)
    x = _x(T, K, "cpu", seed=T)
    out = torch.full((T, N), float("nan"), dtype=torch.float32)
    y = gemv_fp8(x, q, scale, block, out=out, config=config)
    assert y is out
    # the interpreter multiplies the exact values in fp32: only the order of adding blocks differs
    ref = _check(y, x, q, scale, block, 1e-6)
    # the bf16 output: the same sums, rounded once
    assert torch.equal(gemv_fp8(x, q, scale, block, config=config), y.bfloat16())
    assert (gemv_fp8(x, q, scale, block, config=config) == ref.float().bfloat16()).float().mean() > 0.97
    assert torch.equal(gemv_fp8(x, q, scale.view(torch.float8_e8m0fnu), block, config=config), y.bfloat16())


def test_a_misplaced_scale_or_unquantized_x_shows_interpreted(interpreter):
    q, scale = _weight(40, 320, 32, "cpu")
    x = _x(3, 320, "cpu")
    y = gemv_fp8(x, q, scale, 32, config=SMALL)
    wrong = scale.clone()
    wrong[-1, -1] += 1  # one tile's scale doubled: its outputs change
    assert not torch.equal(gemv_fp8(x, q, wrong, 32, config=SMALL), y)
    # x really quantized: against the product with the unquantized activations the results differ
    from mini.formats import dequant_fp8
    assert not torch.equal(y, (x.float() @ dequant_fp8(q, scale, 32, torch.float32).T).bfloat16())


def test_a_row_alone_equals_the_row_among_sixteen_interpreted(interpreter):
    q, scale = _weight(50, 160, 32, "cpu")
    x = _x(16, 160, "cpu")
    assert torch.equal(gemv_fp8(x[5:6], q, scale, 32, config=SMALL), gemv_fp8(x, q, scale, 32, config=SMALL)[5:6])


def test_bad_input_is_refused():
    q, scale = _weight(8, 64, 32, "cpu")
    x = _x(2, 64, "cpu")
    with pytest.raises(ValueError, match="float8_e4m3fn w"):
        gemv_fp8(x, q.float().bfloat16(), scale, 32)
    with pytest.raises(ValueError, match="block must be"):
        gemv_fp8(x, q, scale, 16)
    with pytest.raises(ValueError, match="E8M0 bytes \\[1, 1\\]"):
        gemv_fp8(x, q, scale, 64)  # the scales of 32 x 32 tiles are not those of 64 x 64 ones
    with pytest.raises(ValueError, match="E8M0 bytes"):
        gemv_fp8(x, q, scale.float(), 32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv_fp8(_x(17, 64, "cpu"), q, scale, 32)
    with pytest.raises(ValueError, match="multiple of the block"):
        gemv_fp8(x[:, :48], q[:, :48], scale, 32)
    with pytest.raises(ValueError, match="cannot take"):
        gemv_fp8(x, q, scale, 32, config=GemvConfig(block_k=16))
    assert gemv_fp8(x[:0], q, scale, 32).shape == (0, 8)


# V4.1's FP8 projections at decode [N, K] as the model runs them (stacked where mini.ops.linear.linears stacks)
V41_SHAPES = ((1792, 5120), (36864, 1280), (5120, 8192), (4608, 5120), (5120, 2304), (1280, 5120), (1024, 5120))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", V41_SHAPES)
def test_gemv_fp8_at_v41_shapes_gpu(N, K):
    """Compiled, on the FP8 tensor cores: each block's 32 exact products summed by the MMA (not exactly, as the
    official FP8 GEMM kernels' are not), then scaled and added in fp32; run to run equal; a row's bits do not
    depend on T; a CUDA graph's replay equals the eager call."""
    q, scale = _weight(N, K, 32, "cuda", seed=N)
    for T in (1, 3, 6, 16):
        x = _x(T, K, "cuda", seed=T)
        out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = gemv_fp8(x, q, scale, 32, out=out)
        _check(y, x, q, scale, 32, 2.0 ** -12)
        assert torch.equal(gemv_fp8(x, q, scale, 32), y)
        y32 = gemv_fp8(x, q, scale, 32, out_dtype=torch.float32)
        assert torch.equal(y32.bfloat16(), y)
    x = _x(16, K, "cuda", seed=1)
    assert torch.equal(gemv_fp8(x[7:8], q, scale, 32), gemv_fp8(x, q, scale, 32)[7:8])
    eager = gemv_fp8(x, q, scale, 32)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_fp8(x, q, scale, 32, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_gemv_fp8_candidates_and_tails_gpu(T):
    """Every candidate tiling, N tails, a K tail inside a step, V4's 128-wide blocks."""
    for N, K, block in ((1000, 96, 32), (37, 4128, 32), (4100, 2336, 32), (300, 7168, 128), (129, 384, 128)):
        q, scale = _weight(N, K, block, "cuda", seed=K)
        x = _x(T, K, "cuda", seed=N)
        for cfg in CANDIDATES.values():
            if cfg.block_k % block:
                continue
            out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            _check(gemv_fp8(x, q, scale, block, out=out, config=cfg), x, q, scale, block, 2.0 ** -12)


@pytest.fixture
def fp8_gemv_calls(monkeypatch, interpreter):
    """The fast backend interpreted on CPU with MINI_GEMV_WEIGHTS=fp8; counts the calls reaching gemv_fp8 (small
    tiles)."""
    import mini.kernels.gemv_fp8 as module
    import mini.ops
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "fp8")
    prev = mini.ops.backend()
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    calls = []
    real = module.gemv_fp8

    def counted(x, w, w_scale, block, **kw):
        calls.append((tuple(x.shape), tuple(w.shape)))
        return real(x, w, w_scale, block, config=SMALL, **kw)
    monkeypatch.setattr(module, "gemv_fp8", counted)
    yield calls
    mini.ops.set_backend(prev)


def test_linear_reads_the_fp8_bytes_under_the_switch_interpreted(fp8_gemv_calls):
    """MINI_GEMV_WEIGHTS=fp8: an FP8 projection of at most 16 rows is the FP8 GEMV (within the fast path's tolerance
    of the reference); linears stacks the FP8 bytes and scales of one input's projections (one call, each output
    its projection's); more rows, no fake quant, bf16 weights and the deterministic mode keep the other paths."""
    import mini.ops
    from mini.formats import no_fake_quant
    from mini.ops.linear import linear, linears
    torch.manual_seed(0)
    w = QWeight("fp8", *_weight(64, 160, 32, "cpu"), 32)
    w2 = QWeight("fp8", *_weight(40, 160, 32, "cpu", seed=1), 32)
    x = (torch.randn(2, 3, 160) * 2).bfloat16()
    mini.ops.set_backend("reference")
    ref, ref2 = linear(x, w).double(), linear(x, w2).double()
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    y = linear(x, w)
    assert fp8_gemv_calls == [((6, 160), (64, 160))] and y.shape == (2, 3, 64)
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0 ** -7 + 1e-3).all()
    a, b = linears(x, (w, w2))
    assert fp8_gemv_calls[1:] == [((6, 160), (104, 160))]
    assert torch.equal(a, y) and ((b.double() - ref2).abs() <= ref2.abs() * 2.0 ** -7 + 1e-3).all()
    assert torch.equal(w.data, QWeight("fp8", *_weight(64, 160, 32, "cpu"), 32).data)  # a view of the stack now
    linear(torch.randn(17, 160).bfloat16(), w)  # more rows than the GEMV takes
    with no_fake_quant():
        linear(x, w)
    linear(x, QWeight("bf16", torch.randn(24, 160).bfloat16(), None, 32))
    with mini.ops.deterministic_mode():
        linear(x, w)
    assert len(fp8_gemv_calls) == 2


def test_the_switch_is_checked(monkeypatch):
    from mini.ops.linear import reads_fp8_weights
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "fp16")
    with pytest.raises(ValueError, match="MINI_GEMV_WEIGHTS"):
        reads_fp8_weights()
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "bf16")
    assert not reads_fp8_weights()
