"""The decode GEMV (mini/kernels/gemv.py) against an fp32 GEMM of the same bf16 values: on CPU under the
interpreter with small tiles (splits, N and K tails), on the GPU at V4.1's projection shapes with the default."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from mini.kernels.gemv import DEFAULT, MAX_ROWS, GemvConfig, gemv, split_k

import triton


@pytest.fixture
def interpreter(interpreter):
    """The kernel under the interpreter needs Triton >= 3.7's: 3.6's fails on its scalar loads ("only 0-dimensional
    arrays can be converted to Python scalars", the oldest-Triton CI job). The gpu tests cover Triton 3.6 compiled
    (they pass on the H200's image)."""
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run the GEMV (its gpu tests cover 3.6)")
    return interpreter

SMALL = GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1, programs_per_sm=1)
SMALL_ONE_LAUNCH = replace(SMALL, one_launch=True)
# V4.1's decode projections [N, K] (mini bench kernels --only decode_small)
V41_SHAPES = ((1280, 5120), (32768, 1280), (512, 5120), (5120, 8192), (4608, 5120), (5120, 2304), (4096, 1280),
              (1024, 5120))


def _operands(T, N, K, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K, generator=g) * 2).bfloat16()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
    return x.to(device), w.to(device)


def _check(y, x, w):
    """Each output is one bf16 rounding of an fp32 sum of the exact products: within half a bf16 ulp of the fp32
    GEMM, plus what another summation order (and Hopper's truncated fp32 sums) moves: 1e-5 of the sum of |products|."""
    ref = x.double() @ w.double().T
    spread = x.double().abs() @ w.double().abs().T
    err = (y.double() - ref).abs()
    assert not torch.isnan(y).any()
    assert (err <= ref.abs() * 2.0 ** -8 + spread * 1e-5).all(), f"max error {err.max().item():.3g}"
    # and really rounded once: almost every element is the fp32 GEMM's bf16
    same = (y == (x.float() @ w.float().T).bfloat16()).float().mean().item()
    assert same > 0.97, same


def test_split_k_covers_k_in_whole_steps():
    for N, K in V41_SHAPES + ((100, 96), (2200, 320), (7, 32)):
        for cfg in (DEFAULT, SMALL):
            pieces, k_piece = split_k(N, K, cfg)
            assert k_piece % cfg.block_k == 0 and pieces * k_piece >= K > (pieces - 1) * k_piece
    # V4.1: the wide wq_b fills the GPU without a split; the narrow compressor splits K
    assert split_k(32768, 1280)[0] == 1 and split_k(1024, 5120)[0] > 1
    # the interpreted cases below: 3, 10 and 1 pieces
    assert [split_k(N, K, SMALL)[0] for N, K in ((100, 96), (37, 320), (150, 32))] == [3, 10, 1]


@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("N,K", [(100, 96), (37, 320), (150, 32)])
@pytest.mark.parametrize("config", [SMALL, SMALL_ONE_LAUNCH], ids=["two passes", "one launch"])
def test_gemv_matches_fp32_gemm_interpreted(interpreter, T, N, K, config):
    # (100, 96): K not a multiple of BLOCK_K, 3 pieces; (37, 320): 10 pieces, an N tail; (150, 32): one piece
    x, w = _operands(T, N, K, "cpu")
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16)
    y = gemv(x, w, out=out, config=config)
    assert y is out
    _check(y, x, w)
    assert torch.equal(gemv(x, w, config=config), y)  # run to run (one launch: its counters were reset)


@pytest.mark.parametrize("config", [SMALL, SMALL_ONE_LAUNCH], ids=["two passes", "one launch"])
def test_fp32_output_keeps_the_sums_unrounded_interpreted(interpreter, config):
    for N, K in ((37, 320), (150, 32)):  # split and not
        x, w = _operands(3, N, K, "cpu")
        y = gemv(x, w, out=torch.full((3, N), float("nan")), config=config)
        ref = x.double() @ w.double().T
        assert y.dtype == torch.float32
        assert ((y.double() - ref).abs() <= (x.double().abs() @ w.double().abs().T) * 1e-6).all()
        assert torch.equal(gemv(x, w, config=config), y.bfloat16())  # the bf16 output: the same sums, rounded


@pytest.mark.parametrize("config", [SMALL, replace(SMALL, block_k=64), replace(SMALL, block_k=16)],
                         ids=["one group per step", "two groups per step", "quant pass first"])
def test_fused_act_quant_is_the_quant_pass_then_the_gemv_interpreted(interpreter, config):
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.gemv import fuses_act_quant
    x, w = _operands(3, 40, 320, "cpu")
    x[1, 40:72] *= 1000  # groups of very different scales
    y = gemv(x, w, config=config, act_block=32)
    assert torch.equal(y, gemv(fp8_act_quant(x, 32), w, config=config))
    assert fuses_act_quant(32, config) == (config.block_k >= 32)
    assert not torch.equal(y, gemv(x, w, config=config))  # the quant really applied
    with pytest.raises(ValueError, match="multiple of the activation quant block"):
        gemv(x[:, :48], w[:, :48], act_block=32)


def test_one_launch_leaves_its_counters_at_zero_interpreted(interpreter):
    from mini.kernels.gemv import _COUNTERS
    x, w = _operands(2, 37, 320, "cpu")
    gemv(x, w, config=SMALL_ONE_LAUNCH)
    assert not _COUNTERS[x.device].any()
    # its sum is in piece order, the two-pass sum a tree: the same values up to that order
    _check(gemv(x, w, config=SMALL), x, w)


def test_outgrown_counters_stay_allocated():
    """A graph captured with the old counters still points at them: they are never freed."""
    from mini.kernels.gemv import _OUTGROWN, _counters
    small = _counters(torch.device("cpu"), 8)
    big = _counters(torch.device("cpu"), small.numel() + 1)
    assert big.numel() > small.numel() and not big.any()
    assert any(old is small for old in _OUTGROWN) and _counters(torch.device("cpu"), 8) is big


def test_a_row_alone_equals_the_row_among_sixteen_interpreted(interpreter):
    x, w = _operands(16, 50, 160, "cpu")
    y = gemv(x, w, config=SMALL)
    assert torch.equal(gemv(x[5:6], w, config=SMALL), y[5:6])


def test_gemv_takes_strided_operands_interpreted(interpreter):
    x, w = _operands(4, 40, 128, "cpu")
    wide = torch.zeros(4, 256, dtype=torch.bfloat16)
    wide[:, :128] = x
    _check(gemv(wide[:, :128], w, config=SMALL), x, w)


def test_bad_input_is_refused():
    x, w = _operands(MAX_ROWS + 1, 8, 32, "cpu")
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(x, w)
    with pytest.raises(ValueError, match="bf16"):
        gemv(x[:2].float(), w.float())
    with pytest.raises(ValueError, match="w \\[N, K\\]"):
        gemv(x[:2], w[:, :16])
    with pytest.raises(ValueError, match="out must be"):
        gemv(x[:2], w, out=torch.empty(2, 9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        gemv(x[:2], w, out_dtype=torch.float16)
    assert gemv(x[:0], w).shape == (0, 8)


def _fp8_weight(N, K, block, device, seed=0):
    """(e4m3 [N, K], E8M0 bytes [ceil(N / block), ceil(K / block)]): each scale block its own magnitude (scale
    bytes from 2^-126 to 2^8, e4m3 values down to its subnormals), so every dequantized value's bits are at stake."""
    from mini.formats import quantize_fp8
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.exp2(torch.randint(-12, 4, (N, K), generator=g).float())
    q, scale = quantize_fp8(w, block)
    scale = (scale.to(torch.int32) + torch.randint(-6, 7, scale.shape, generator=g)).clamp(1, 135).to(torch.uint8)
    scale.view(-1)[0] = 1  # 2^-126: its products are fp32 subnormals (e4m3 q < 1), rounded to bf16 as the copy
    return q.to(device), scale.to(device)


ROW_SMALL = GemvConfig(block_n=16, block_k=64, num_warps=1, num_stages=1, programs_per_sm=1, cuda_cores=True)


@pytest.mark.parametrize("N,K,w_block,config", [
    (100, 96, 32, ROW_SMALL), (37, 320, 32, ROW_SMALL), (70, 256, 128, replace(ROW_SMALL, block_n=32)),
    (45, 80, 32, replace(ROW_SMALL, block_k=32)), (150, 64, 32, replace(ROW_SMALL, block_k=128)),
    (37, 320, 32, replace(ROW_SMALL, one_launch=True)), (45, 80, 32, replace(ROW_SMALL, block_k=32, one_launch=True))])
def test_fp8_row_build_sums_the_exact_products_interpreted(interpreter, N, K, w_block, config):
    """The one-row FP8 read on the CUDA cores (`cuda_cores`): fp32 sums of the bf16 copy's exact products in its own
    order (splits over K, N and K tails, a partial scale block, scale blocks narrower and wider than BLOCK_K),
    act quant fused or not; a config-less call at T = 1 takes it."""
    from mini.formats import dequant_fp8
    from mini.kernels.fp8_act_quant import fp8_act_quant
    q, scale = _fp8_weight(N, K, w_block, "cpu", seed=N)
    x = (torch.randn(1, K, generator=torch.Generator().manual_seed(K)) * 2).bfloat16()
    copy = dequant_fp8(q, scale, w_block, torch.bfloat16)
    for act in (0, 16):
        out = torch.full((1, N), float("nan"), dtype=torch.bfloat16)
        y = gemv(x, q, out=out, config=config, act_block=act, scale=scale, w_block=w_block)
        assert y is out
        _check(y, fp8_act_quant(x, act) if act else x, copy)
    assert torch.equal(gemv(x, q, scale=scale, w_block=w_block, config=config),
                       gemv(x, q, scale=scale, w_block=w_block, config=config))
    if config.one_launch:  # (37, 320): 5 pieces; (45, 80): 3 pieces of one 32-wide step
        from mini.kernels.gemv import _COUNTERS
        assert not _COUNTERS[x.device].any()  # each N block's last program reset its counter


MMA_SMALL = GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1, programs_per_sm=1, fp8_mma=True)


@pytest.mark.parametrize("T,N,K,w_block,config", [
    (2, 100, 96, 32, MMA_SMALL), (6, 37, 320, 32, MMA_SMALL), (16, 70, 256, 128, replace(MMA_SMALL, block_n=32)),
    (5, 150, 64, 32, replace(MMA_SMALL, programs_per_sm=8)), (1, 40, 96, 32, MMA_SMALL),
    (4, 300, 96, 32, replace(MMA_SMALL, block_n=256, num_warps=8))])
def test_fp8_mma_build_sums_the_exact_products_interpreted(interpreter, poisoned, T, N, K, w_block, config):
    """The FP8 read of several rows on the tensor cores (`fp8_mma`; the interpreter sums its MMA exactly): x's FP8
    codes and the weight's, block by block with both scales, the bf16 copy's exact products summed in fp32 in its
    order (splits over K, N tails, 32- and 128-wide blocks, one row); a config-less call at 2-16 rows takes it."""
    from mini.formats import dequant_fp8
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.gemv import MMA_DEFAULT
    q, scale = _fp8_weight(N, K, w_block, "cpu", seed=N)
    x = (torch.randn(T, K, generator=torch.Generator().manual_seed(K)) * 2).bfloat16()
    x[0, :w_block] *= 300  # groups of very different scales
    copy = dequant_fp8(q, scale, w_block, torch.bfloat16)
    y = gemv(x, q, config=config, act_block=w_block, scale=scale, w_block=w_block)
    _check(y, fp8_act_quant(x, w_block), copy)
    assert torch.equal(gemv(x[-1:], q, config=config, act_block=w_block, scale=scale, w_block=w_block), y[-1:])
    if T > 1:  # the default at 2-16 rows, its own tiles
        _check(gemv(x, q, act_block=w_block, scale=scale, w_block=w_block), fp8_act_quant(x, w_block), copy)
        assert MMA_DEFAULT.fp8_mma


def _codes(x, block):
    """x's FP8 codes and E8M0 bytes in `block` groups (the act quant's wire form), as gemv takes them."""
    from mini.kernels.fp8_act_quant import FP8Rows, fp8_act_quant_wire
    codes = torch.full(x.shape, 0x7F, dtype=torch.uint8, device=x.device)  # NaN codes until written
    scales = torch.full((x.shape[0], x.shape[1] // block), 255, dtype=torch.uint8, device=x.device)
    fp8_act_quant_wire(x, block, codes, scales)
    return FP8Rows(codes, scales, block, torch.bfloat16)


@pytest.mark.parametrize("T,N,K,w_block,config", [
    (2, 100, 96, 32, MMA_SMALL), (6, 37, 320, 32, MMA_SMALL), (16, 70, 256, 128, replace(MMA_SMALL, block_n=32)),
    (1, 40, 96, 32, MMA_SMALL), (4, 300, 96, 32, replace(MMA_SMALL, block_n=256, num_warps=8))])
def test_fp8_mma_read_of_x_codes_gives_the_fused_reads_bits_interpreted(interpreter, poisoned, T, N, K, w_block,
                                                                       config):
    """x given as its FP8 codes (FP8Rows) takes the same read with the codes as they are: the bits of the read that
    quantizes bf16 x in its loads (splits, N tails, 32- and 128-wide blocks, one row, 256 rows a program), also
    into a NaN-filled output, and with the default build (config None) at any 1-16 rows."""
    q, scale = _fp8_weight(N, K, w_block, "cpu", seed=N + 1)
    x = (torch.randn(T, K, generator=torch.Generator().manual_seed(K + 1)) * 2).bfloat16()
    x[-1, :w_block] *= 1e-3  # groups of very different scales
    fused = gemv(x, q, config=config, act_block=w_block, scale=scale, w_block=w_block)
    xr = _codes(x, w_block)
    out = torch.full((T, N), float("nan"), dtype=torch.bfloat16)
    assert gemv(xr, q, out=out, config=config, scale=scale, w_block=w_block) is out
    assert torch.equal(out, fused)
    from mini.kernels.gemv import MMA_DEFAULT
    assert torch.equal(gemv(xr, q, scale=scale, w_block=w_block, act_block=w_block),
                       gemv(x, q, config=MMA_DEFAULT, act_block=w_block, scale=scale, w_block=w_block))


def test_fp8_mma_read_of_x_codes_refuses_what_it_cannot_take():
    q, scale = _fp8_weight(64, 96, 32, "cpu")
    xr = _codes(torch.randn(3, 96).bfloat16(), 32)
    with pytest.raises(ValueError, match="with its scale"):
        gemv(xr, q, w_block=32)
    with pytest.raises(ValueError, match="with its scale"):
        gemv(xr, q.float().bfloat16(), scale=scale, w_block=32)
    with pytest.raises(ValueError, match=r"x's block = w_block"):
        gemv(_codes(torch.randn(3, 96).bfloat16(), 16), q, scale=scale, w_block=32)
    with pytest.raises(ValueError, match=r"x's block = w_block"):
        gemv(xr, q, scale=scale, w_block=32, config=ROW_SMALL)
    with pytest.raises(ValueError, match=r"x's block = w_block"):
        gemv(xr, q, scale=scale, w_block=32, act_block=16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(_codes(torch.randn(17, 96).bfloat16(), 32), q, scale=scale, w_block=32)
    with pytest.raises(ValueError, match=r"e4m3 w \[N, 96\]"):
        gemv(xr, q[:, :64], scale=scale[:, :2], w_block=32)


def test_fp8_mma_build_refuses_what_it_cannot_take():
    q, scale = _fp8_weight(64, 96, 32, "cpu")
    x = torch.randn(3, 96).bfloat16()
    with pytest.raises(ValueError, match="act_block = w_block"):
        gemv(x, q, scale=scale, w_block=32)  # x not quantized: its codes are what the MMA takes
    with pytest.raises(ValueError, match="act_block = w_block"):
        gemv(x, q, scale=scale, w_block=32, act_block=16)
    q16, scale16 = _fp8_weight(64, 96, 16, "cpu")
    with pytest.raises(ValueError, match="a power of two >= 32"):
        gemv(x, q16, scale=scale16, w_block=16, act_block=16)  # narrower than the FP8 MMA's K
    with pytest.raises(ValueError, match="one-row FP8 read"):
        gemv(torch.randn(1, 192).bfloat16(), q, scale=scale, w_block=32, act_block=32, config=MMA_SMALL, groups=2)
    with pytest.raises(ValueError, match="no scale"):
        gemv(x, q.float().bfloat16(), config=MMA_SMALL, act_block=32)


def test_gluon_build_refuses_what_it_cannot_take():
    """The Gluon build of the FP8 read (`gluon_k_width`) runs on CUDA only, at one stage, 16-row tiles and MMA
    tiles within a scale block: a CPU tensor or another tiling is refused with a clear error, never run by the
    interpreter."""
    from mini.kernels.gemv import MMA_REGISTERS
    q, scale = _fp8_weight(64, 96, 32, "cpu")
    x = torch.randn(3, 96).bfloat16()
    assert MMA_REGISTERS.gluon_k_width and MMA_REGISTERS.fp8_mma
    with pytest.raises(ValueError, match="CUDA only"):
        gemv(x, q, scale=scale, w_block=32, act_block=32, config=MMA_REGISTERS)
    with pytest.raises(ValueError, match="at one stage"):  # blocks carried ahead: measured slower, gone
        gemv(x, q, scale=scale, w_block=32, act_block=32, config=replace(MMA_REGISTERS, num_stages=2))
    with pytest.raises(ValueError, match="16 bytes a lane, 32-wide blocks"):  # an MMA tile spanning two blocks
        gemv(x, q, scale=scale, w_block=32, act_block=32, config=replace(MMA_REGISTERS, gluon_k_width=16))
    with pytest.raises(ValueError, match="2 ahead"):  # 2 and 3 blocks ahead: measured no faster, gone
        gemv(x, q, scale=scale, w_block=32, act_block=32, config=replace(MMA_REGISTERS, gluon_ahead=2))


def test_gluon_read_loads_ahead_only_what_its_words_can_take():
    """`blocks_ahead`: the Gluon read's loads ahead (W and bf16 x as int32 words) are taken at 8 bytes of a row a
    lane, 32-wide scale blocks and operands whose rows start on 4-byte boundaries; anything else takes the loop that
    loads each block as it works on it (the same products in the same order), never a misaligned word load."""
    from mini.kernels.gemv import MMA_CANDIDATES, MMA_REGISTERS, blocks_ahead
    q, _ = _fp8_weight(64, 96, 32, "cpu")
    wide = torch.randn(3, 98).bfloat16()
    x = wide[:, :96].contiguous()
    assert blocks_ahead(MMA_REGISTERS, x, q, 32, False) == 1
    assert blocks_ahead(MMA_CANDIDATES["regs 128 4/SM"], x, q, 32, False) == 0
    assert blocks_ahead(MMA_REGISTERS, x, q, 128, False) == 0  # V4's 128-wide blocks: its build would spill
    assert blocks_ahead(replace(MMA_REGISTERS, gluon_k_width=4), x, q, 32, False) == 0
    assert blocks_ahead(MMA_REGISTERS, wide[:, 1:97], q, 32, False) == 0  # x's rows start 2 bytes off a word
    assert blocks_ahead(MMA_REGISTERS, torch.randn(3, 97).bfloat16()[:, :96], q, 32, False) == 0  # odd row stride
    qw = torch.zeros(64, 100, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert blocks_ahead(MMA_REGISTERS, x, qw[:, 2:98], 32, False) == 0  # W's rows off a word
    assert blocks_ahead(MMA_REGISTERS, x, qw[:, 4:100], 32, False) == 1
    assert blocks_ahead(MMA_REGISTERS, wide[:, 1:97], q, 32, True) == 1  # codes are loaded as they are


def test_fp8_read_refuses_what_it_cannot_take():
    q, scale = _fp8_weight(64, 96, 32, "cpu")
    x = torch.randn(1, 96).bfloat16()
    with pytest.raises(ValueError, match="e4m3 w with its scale"):
        gemv(x, q.view(torch.uint8), scale=scale, w_block=32)
    with pytest.raises(ValueError, match=r"E8M0 scale \[2, 3\]"):
        gemv(x, q, scale=scale[:, :2], w_block=32)
    with pytest.raises(ValueError, match="E8M0 scale"):
        gemv(x, q, scale=scale.float(), w_block=32)
    with pytest.raises(ValueError, match="takes one row of x"):
        gemv(x.expand(2, 96), q, scale=scale, w_block=32, config=ROW_SMALL)  # more rows: the tensor cores' read
    with pytest.raises(ValueError, match="BLOCK_N 16"):
        gemv(x, q, scale=scale, w_block=24, config=ROW_SMALL)  # rows of one program across two scale rows
    with pytest.raises(ValueError, match="no scale"):
        gemv(x, q.float().bfloat16(), config=ROW_SMALL)  # the CUDA-core build reads FP8 only


def _replay_equals_eager(x, q, scale):
    """The FP8 read's default build for x's rows, captured in a CUDA graph into a NaN-filled output: one replay
    gives the eager call's bits."""
    eager = gemv(x, q, act_block=32, scale=scale, w_block=32)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, q, out=out, act_block=32, scale=scale, w_block=32)
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", V41_SHAPES + ((1792, 5120), (36864, 1280)))
def test_fp8_read_at_v41_shapes_gpu(N, K):
    """On the H200, the one-row FP8 read at V4.1's projection shapes (and the stacked ones), every candidate: the
    exact products' fp32 sums (against the bf16 copy's values), run to run the same, and replayed from a CUDA graph
    the same."""
    from mini.formats import dequant_fp8
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.gemv import ROW_CANDIDATES
    q, scale = _fp8_weight(N, K, 32, "cuda", seed=N)
    copy = dequant_fp8(q, scale, 32, torch.bfloat16).cpu()
    x = (torch.randn(1, K, device="cuda") * 2).bfloat16()
    for cfg in ROW_CANDIDATES.values():
        y = gemv(x, q, out=torch.full((1, N), float("nan"), dtype=torch.bfloat16, device="cuda"), config=cfg,
                 act_block=32, scale=scale, w_block=32)
        _check(y.cpu(), fp8_act_quant(x, 32).cpu(), copy)
        assert torch.equal(y, gemv(x, q, config=cfg, act_block=32, scale=scale, w_block=32)), cfg
    _replay_equals_eager(x, q, scale)
    from mini.kernels.gemv import _COUNTERS
    assert all(not c.any() for c in _COUNTERS.values())  # the one-launch sums' last programs reset their counters


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", V41_SHAPES + ((1792, 5120), (36864, 1280)))
def test_fp8_mma_read_at_v41_shapes_gpu(N, K):
    """On the GPU, the tensor cores' FP8 read of 2-16 rows at V4.1's projection shapes, every candidate: against
    the exact products' sum (the bf16 copy's values) within a bf16 rounding plus what the FP8 MMA's own sum of a
    block's 32 products drops (it keeps fewer bits than fp32; on an H100 at most 7.5e-4 of the sum of |products|,
    docs/perf/044: bounded here by 2^-9), almost every output the bf16 copy's GEMV's (97% there); run to run, alone
    against among 16 rows, with x's codes given (FP8Rows), and replayed from a graph the same."""
    from mini.formats import dequant_fp8
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.gemv import MMA_CANDIDATES
    q, scale = _fp8_weight(N, K, 32, "cuda", seed=N)
    copy = dequant_fp8(q, scale, 32, torch.bfloat16)
    for T in (2, 6, 16):
        x = (torch.randn(T, K, device="cuda") * 2).bfloat16()
        xq = fp8_act_quant(x, 32)
        xr = _codes(x, 32)
        ref = xq.double() @ copy.double().T
        spread = xq.double().abs() @ copy.double().abs().T
        copy_y = gemv(x, copy, act_block=32)
        for cfg in MMA_CANDIDATES.values():
            out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            y = gemv(x, q, out=out, config=cfg, act_block=32, scale=scale, w_block=32)
            err = (y.double() - ref).abs()
            assert not y.isnan().any() and (err <= ref.abs() * 2.0 ** -8 + spread * 2.0 ** -9).all(), \
                (cfg, (err / spread).max().item())
            assert (y == copy_y).float().mean() > 0.9, (cfg, (y == copy_y).float().mean().item())
            assert torch.equal(y, gemv(x, q, config=cfg, act_block=32, scale=scale, w_block=32)), cfg
            assert torch.equal(gemv(x[-1:], q, config=cfg, act_block=32, scale=scale, w_block=32), y[-1:]), cfg
            assert torch.equal(gemv(xr, q, config=cfg, scale=scale, w_block=32), y), cfg  # x's codes given
    _replay_equals_eager(x, q, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,G", ((8192, 4096, 8), (5120, 8192, 1), (300, 96, 1)))
def test_gluon_fp8_read_of_unquantized_x_gpu(N, K, G):
    """The Gluon build with x as it is (act_block 0; V4.1's wo_a in its 8 groups of 1,024 rows, wo_b's shape, an N
    tail), every Gluon candidate: each group's rows against the bf16 copy's exact products summed in fp32 and
    rounded once (_check), into a NaN-filled output, run to run and alone against among 16 rows the same."""
    from mini.formats import dequant_fp8
    from mini.kernels.gemv import MMA_CANDIDATES
    q, scale = _fp8_weight(N, K, 32, "cuda", seed=N)
    copy = dequant_fp8(q, scale, 32, torch.bfloat16).cpu()
    rows = N // G
    for T in (2, 6, 16):
        x = (torch.randn(T, G * K, device="cuda") * 2).bfloat16()
        for label, cfg in MMA_CANDIDATES.items():
            if not cfg.gluon_k_width or (G > 1 and rows % cfg.block_n):
                continue
            out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            y = gemv(x, q, out=out, config=cfg, scale=scale, w_block=32, groups=G)
            for g in range(G):
                _check(y[:, g * rows:(g + 1) * rows].cpu(), x[:, g * K:(g + 1) * K].cpu(),
                       copy[g * rows:(g + 1) * rows])
            assert torch.equal(y, gemv(x, q, config=cfg, scale=scale, w_block=32, groups=G)), label
            assert torch.equal(gemv(x[-1:], q, config=cfg, scale=scale, w_block=32, groups=G), y[-1:]), label


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", V41_SHAPES + ((1792, 5120), (36864, 1280), (8192, 4096), (300, 96), (256, 32)))
def test_gluon_read_loading_ahead_gives_the_same_bits_gpu(N, K):
    """The Gluon read loading a block ahead (`gluon_ahead`: W and x carried as int32 words; the default) sums the
    same products in the same order as the build that loads each block in its loop: bit for bit its outputs, into
    NaN-filled outputs, at V4.1's shapes, an N tail and one-block K pieces, with x quantized in the loads, as its
    codes, as it is (and in groups: wo_a's), and with x off a word boundary (then the build without words)."""
    from mini.kernels.gemv import MMA_CANDIDATES
    q, scale = _fp8_weight(N, K, 32, "cuda", seed=N + K)
    for T in (2, 6, 8, 16):
        wide = (torch.randn(T, K + 1, device="cuda") * 2).bfloat16()
        x, x_off = wide[:, :K].contiguous(), wide[:, 1:]
        runs = [dict(x=x, act_block=32), dict(x=_codes(x, 32)), dict(x=x), dict(x=x_off, act_block=32)]
        if N % 1024 == 0 and N // 1024 > 1:
            G = N // 1024
            runs.append(dict(x=torch.randn(T, G * K, device="cuda").bfloat16(), groups=G))
        for run in runs:
            base = gemv(**run, w=q, config=MMA_CANDIDATES["regs 128 4/SM"], scale=scale, w_block=32)
            for label, cfg in MMA_CANDIDATES.items():
                if cfg.gluon_ahead:
                    out = torch.full(base.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
                    y = gemv(**run, w=q, out=out, config=cfg, scale=scale, w_block=32)
                    assert torch.equal(y, base), (label, T, sorted(run))


@pytest.mark.gpu
def test_fp8_switch_takes_the_gluon_build_gpu(monkeypatch):
    """MINI_GEMV_WEIGHTS=fp8 (the default): on CUDA linear at 2-8 rows, wo_a's grouped_linear and the shared
    expert's w2 (through linear.gluon_read) reach the Gluon build, within the bounds of its parity tests; one row
    keeps the CUDA-core read, 9-16 rows the Triton build (where the Gluon build measured slower); =fp8_triton the
    Triton build at 2-8 rows too."""
    import mini.kernels.gemv as module
    from mini.formats import dequant_fp8
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.ops.linear import QWeight, grouped_linear, gluon_read, linear
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "fp8")
    configs, real = [], module.gemv
    monkeypatch.setattr(module, "gemv", lambda *a, **kw: configs.append(kw.get("config")) or real(*a, **kw))
    q, scale = _fp8_weight(256, 192, 32, "cuda", seed=3)
    w = QWeight("fp8", q, scale.view(torch.float8_e8m0fnu), 32)
    copy = dequant_fp8(q, scale, 32, torch.bfloat16)
    x = (torch.randn(6, 192, device="cuda") * 2).bfloat16()
    y = linear(x, w)
    assert configs == [module.MMA_REGISTERS]
    xq = fp8_act_quant(x, 32).double()
    ref, spread = xq @ copy.double().T, xq.abs() @ copy.double().abs().T
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + spread * 1e-5).all()
    _check(gluon_read(x, w).cpu(), x.cpu(), copy.cpu())  # x as it is (w2's h: already quantized)
    q2, scale2 = _fp8_weight(256, 96, 32, "cuda", seed=4)  # wo_a's form: 2 groups of 128 rows x 96
    copy2 = dequant_fp8(q2, scale2, 32, torch.bfloat16)
    w2 = QWeight("fp8", q2, scale2.view(torch.float8_e8m0fnu), 32)
    yg = grouped_linear(x.view(6, 2, 96), copy2.view(2, 128, 96), w2)
    assert configs[-1] == module.MMA_REGISTERS
    for g in range(2):
        _check(yg[:, g * 128:(g + 1) * 128].cpu(), x[:, g * 96:(g + 1) * 96].cpu(), copy2[g * 128:(g + 1) * 128].cpu())
    linear(x[:1], w)
    assert configs[-1] is None  # one row: the CUDA-core read's default
    x16 = x.repeat(3, 1)[:module.MMA_REGISTERS_ROWS + 1]
    linear(x16, w)
    assert configs[-1] is None and gluon_read(x16, w) is None  # past its rows: the Triton build's default
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "fp8_triton")  # the A/B's other side: the Triton build at 2-16 rows
    linear(x, w)
    assert configs[-1] is None and gluon_read(x, w) is None


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", V41_SHAPES)
def test_gemv_at_v41_shapes_gpu(N, K):
    for T in (1, 3, 16):
        x, w = _operands(T, N, K, "cuda", seed=T)
        out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        y = gemv(x, w, out=out)
        _check(y.cpu(), x.cpu(), w.cpu())
        assert torch.equal(gemv(x, w), y)  # run to run: no atomics
        # within a bf16 ulp of cuBLAS's own bf16 output (+ the two fp32 sums' difference, near cancellations)
        ref = F.linear(x, w).double()
        spread = x.double().abs() @ w.double().abs().T
        assert ((y.double() - ref).abs() <= ref.abs() * 2.0 ** -7 + spread * 2e-5).all()
    x, w = _operands(16, N, K, "cuda", seed=1)
    assert torch.equal(gemv(x[7:8], w), gemv(x, w)[7:8])  # a row's bits do not depend on T
    from mini.kernels.fp8_act_quant import fp8_act_quant
    assert torch.equal(gemv(x, w, act_block=32), gemv(fp8_act_quant(x, 32), w))  # the quant in the loads
    y32 = gemv(x, w, out_dtype=torch.float32)  # unrounded: the same sums as the bf16 output
    assert torch.equal(y32.bfloat16(), gemv(x, w))
    spread = x.double().abs() @ w.double().abs().T
    assert ((y32.double() - x.double() @ w.double().T).abs() <= spread * 1e-5).all()


@pytest.mark.gpu
def test_gemv_replayed_in_a_cuda_graph_gpu():
    """A decode step replays its GEMVs from a CUDA graph: the replay == the eager call, every replay (the one-launch
    build's counters reset inside the graph)."""
    from mini.kernels.gemv import CANDIDATES
    x, w = _operands(4, 1024, 5120, "cuda")
    for cfg in CANDIDATES.values():
        eager = gemv(x, w, config=cfg)
        out = torch.full_like(eager, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemv(x, w, out=out, config=cfg)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 16])
def test_gemv_candidates_and_tails_gpu(T):
    from mini.kernels.gemv import CANDIDATES
    for N, K in ((1000, 96), (37, 4128), (4100, 2336)):
        x, w = _operands(T, N, K, "cuda")
        for cfg in CANDIDATES.values():
            out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            _check(gemv(x, w, out=out, config=cfg).cpu(), x.cpu(), w.cpu())


@pytest.fixture
def gemv_calls(monkeypatch):
    """Counts the linear layers that reach the GEMV (the wrapper still computes)."""
    import mini.kernels.gemv as module
    calls = []
    real = module.gemv

    def counted(x, w, **kw):
        calls.append(tuple(x.shape))
        small = SMALL if "scale" not in kw else ROW_SMALL if x.shape[0] == 1 else MMA_SMALL
        return real(x, w, config=small, **kw)
    monkeypatch.setattr(module, "gemv", counted)
    return calls


def test_linear_takes_the_gemv_up_to_its_row_limit_interpreted(interpreter, fast_interpreted, gemv_calls,
                                                                 monkeypatch):
    import mini.ops
    from mini.formats import no_fake_quant, quantize_fp8
    from mini.ops import linear as linear_module
    from mini.ops.linear import QWeight, linear
    torch.manual_seed(0)
    q, s = quantize_fp8(torch.randn(72, 160) * 0.05, 32)
    w = QWeight("fp8", q, s.view(torch.float8_e8m0fnu), 32)
    x = (torch.randn(2, 3, 160) * 2).bfloat16()
    assert linear_module.GEMV_MAX_TOKENS == 16  # on since the H200's A/B (docs/perf/015)
    monkeypatch.setattr(linear_module, "GEMV_MAX_TOKENS", 0)  # off: F.linear after the quant pass
    cublas_path = linear(x, w)
    assert gemv_calls == []
    monkeypatch.setattr(linear_module, "GEMV_MAX_TOKENS", 6)
    y = linear(x, w)
    assert gemv_calls == [(6, 160)] and y.shape == (2, 3, 72)
    mini.ops.set_backend("reference")
    ref = linear(x, w).double()
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    # test_linear.py's fast-path tolerance, and the same activation quantization as the F.linear fast path
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0 ** -7 + 1e-3).all()
    assert ((y.double() - cublas_path.double()).abs() <= cublas_path.double().abs() * 2.0 ** -7 + 1e-6).all()
    with no_fake_quant():  # the GEMV without its quant
        assert torch.equal(linear(x[0], w), gemv(x[0], w.prepare(torch.bfloat16), config=SMALL))
    linear(torch.randn(7, 160).bfloat16(), w)  # more rows than the limit: F.linear
    bf16_w = QWeight("bf16", torch.randn(24, 160).bfloat16(), None, 32)
    _check(linear(x[0], bf16_w), x[0], bf16_w.data)  # bf16 weights too
    assert gemv_calls == [(6, 160), (3, 160), (3, 160)]
    with mini.ops.deterministic_mode():  # keeps its batch-invariant GEMMs
        linear(x, w)
    assert gemv_calls == [(6, 160), (3, 160), (3, 160)]


def test_linears_run_projections_of_one_input_as_one_gemv_interpreted(interpreter, fast_interpreted, gemv_calls):
    """mini.ops.linear.linears: FP8 projections of one input are one GEMV over their stacked copies (one call, x
    quantized once), each output its projection's within the fast path's tolerance; a different kind runs alone;
    the reference backend gives linear's bits."""
    import mini.ops
    from mini.formats import quantize_fp8
    from mini.ops.linear import QWeight, linear, linears
    torch.manual_seed(1)
    ws = [QWeight("fp8", *(lambda q, s: (q, s.view(torch.float8_e8m0fnu)))(*quantize_fp8(torch.randn(n, 160) * 0.1,
                                                                                         32)), 32)
          for n in (40, 24)]
    x = torch.randn(3, 160).bfloat16()
    a, b = linears(x, tuple(ws))
    assert gemv_calls == [(3, 160)] and a.shape == (3, 40) and b.shape == (3, 24)
    # the copies are views into the one stack: the weight is held once
    assert ws[1].prepare(torch.bfloat16).data_ptr() == ws[0].prepare(torch.bfloat16).data_ptr() + 40 * 160 * 2
    for y, w in zip((a, b), ws):
        alone = linear(x, w)
        assert ((y.double() - alone.double()).abs() <= alone.double().abs() * 2.0 ** -7 + 1e-3).all()
    gemv_calls.clear()
    bf16_w = QWeight("bf16", torch.randn(8, 160).bfloat16(), None, 32)
    linears(x, (ws[0], bf16_w))
    assert gemv_calls == [(3, 160), (3, 160)]
    mini.ops.set_backend("reference")
    for y, w in zip(linears(x, tuple(ws)), ws):
        assert torch.equal(y, linear(x, w))


def test_fp8_weights_switch_reads_the_bytes_interpreted(interpreter, fast_interpreted, monkeypatch):
    """MINI_GEMV_WEIGHTS=fp8 (the default): at one row linear and linears (their bytes and scales stacked, each
    weight's its views) reach the GEMV with the FP8 weight, within a bf16 rounding of the bf16 copy's GEMV (=bf16);
    at 2-16 rows too (the tensor cores' read), but with =fp8_row the copy; above the row limit, without the act
    quant and in the deterministic mode, the copy."""
    import mini.kernels.gemv as module
    import mini.ops
    from mini.formats import no_fake_quant
    from mini.ops.linear import QWeight, linear, linears
    reads, real = [], module.gemv
    monkeypatch.setattr(module, "gemv", lambda x, w, **kw: reads.append(w.dtype) or real(
        x, w, config=SMALL if "scale" not in kw else ROW_SMALL if x.shape[0] == 1 else MMA_SMALL, **kw))
    ws = [QWeight("fp8", *_fp8_weight(n, 160, 32, "cpu", seed=n), 32) for n in (64, 24)]
    x = (torch.randn(1, 160) * 2).bfloat16()
    fp8 = [linear(x, w) for w in ws] + list(linears(x, tuple(ws)))
    assert reads == [torch.float8_e4m3fn] * 3
    assert ws[1].data.data_ptr() == ws[0].data.data_ptr() + 64 * 160  # the stack holds the bytes once
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "bf16")
    bf16 = [linear(x, w) for w in ws] + list(linears(x, tuple(ws)))
    assert reads[3:] == [torch.bfloat16] * 3
    for a, b in zip(fp8, bf16):
        assert ((a.double() - b.double()).abs() <= b.double().abs() * 2.0 ** -7 + 1e-6).all()
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "fp8")
    reads.clear()
    x3 = (torch.randn(3, 160) * 2).bfloat16()
    three = linear(x3, ws[0])
    assert reads == [torch.float8_e4m3fn]
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "fp8_triton")  # the Triton build at 2-16 rows: on CPU =fp8's read
    assert torch.equal(linear(x3, ws[0]), three) and reads[-1] == torch.float8_e4m3fn
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "fp8_row")
    assert linear(x[:1], ws[0]) is not None and reads[-1] == torch.float8_e4m3fn  # one row: still the bytes
    copy3 = linear(x3, ws[0])
    assert ((three.double() - copy3.double()).abs() <= copy3.double().abs() * 2.0 ** -7 + 1e-6).all()
    monkeypatch.setenv("MINI_GEMV_WEIGHTS", "fp8")
    reads.clear()
    linear(torch.randn(17, 160).bfloat16(), ws[0])
    with mini.ops.deterministic_mode():
        linear(x, ws[0])
    assert reads == []  # F.linear
    with no_fake_quant():
        linear(x3, ws[0])
    assert reads == [torch.bfloat16]
    big = QWeight("fp8", ws[0].data, ws[0].scale.clone(), 32)
    big.scale[0, 0] = module.MAX_SCALE_BYTE + 1  # s = 2^40: past the FP8 read's range -> the bf16 copy
    linear(x, big)
    assert reads == [torch.bfloat16] * 2


def test_tuned_shapes_take_a_candidate_build():
    """`config_for`: the measured shapes (TUNED) take one of the benchmarked candidates, every other the default."""
    from mini.kernels.gemv import CANDIDATES, TUNED, config_for
    assert TUNED and all(c in CANDIDATES.values() for c in TUNED.values())
    assert config_for(5120, 8192) is TUNED[(5120, 8192)] and config_for(1280, 5120) is DEFAULT


def test_grouped_fp8_row_read_is_each_groups_projection_interpreted(interpreter):
    """The one-row FP8 read with `groups`: each group's rows against its own K columns of x, the bf16 copy's exact
    products summed in fp32 (against the copy's GEMV of that group)."""
    from mini.formats import dequant_fp8
    G, r, K = 2, 64, 96
    q, scale = _fp8_weight(G * r, K, 32, "cpu", seed=5)
    x = (torch.randn(1, G * K, generator=torch.Generator().manual_seed(6)) * 2).bfloat16()
    copy = dequant_fp8(q, scale, 32, torch.bfloat16)
    y = gemv(x, q, out=torch.full((1, G * r), float("nan"), dtype=torch.bfloat16), config=ROW_SMALL, scale=scale,
             w_block=32, groups=G)
    for g in range(G):
        _check(y[:, g * r:(g + 1) * r], x[:, g * K:(g + 1) * K], copy[g * r:(g + 1) * r])


def test_grouped_gemv_refuses_groups_it_cannot_take():
    from mini.kernels.gemv import takes_groups
    q, scale = _fp8_weight(48, 64, 16, "cpu")
    x = torch.randn(1, 128).bfloat16()
    with pytest.raises(ValueError, match=r"x \[T, 2 K\]"):
        gemv(x[:, :64], q, scale=scale, w_block=16, config=ROW_SMALL, groups=2)  # x holds one group's columns
    with pytest.raises(ValueError, match="whole BLOCK_N = 16 blocks"):
        gemv(x, q, scale=scale, w_block=16, config=ROW_SMALL, groups=2)  # 24 rows a group: a program spans two
    with pytest.raises(ValueError, match="no scale"):
        gemv(x, q.float().bfloat16()[:32], config=SMALL, groups=2)  # the bf16 copy's GEMV takes no groups
    assert takes_groups(8192, 8) and takes_groups(64, 2)  # V4.1's wo_a; tiny-v4.1's (r = 32)
    assert not takes_groups(48, 2) and not takes_groups(64, 3)


def test_grouped_linear_dispatch_interpreted(interpreter, fast_interpreted, monkeypatch):
    """mini.ops.linear.grouped_linear (wo_a): on the fast path one row reads the FP8 bytes through the grouped GEMV,
    within a bf16 rounding of the official einsum; more rows, a weight without FP8 bytes, the deterministic mode
    and the reference backend take the einsum (the bmm on CUDA)."""
    import mini.kernels.gemv as module
    import mini.ops
    from mini.ops.linear import QWeight, grouped_linear
    reads, real = [], module.gemv
    monkeypatch.setattr(module, "gemv", lambda x, w, **kw: reads.append((x.shape[0], w.dtype, kw["groups"])) or real(
        x, w, config=ROW_SMALL if "scale" in kw else SMALL, **kw))
    monkeypatch.setattr(module, "takes_groups", lambda N, G: True)  # the small build takes 32-row groups
    G, r, k = 2, 32, 64
    fp8 = QWeight("fp8", *_fp8_weight(G * r, k, 32, "cpu", seed=3), 32)
    wo_a = fp8.dequantize(torch.bfloat16).view(G, r, k)
    o = (torch.randn(17, G, k, generator=torch.Generator().manual_seed(4)) * 2).bfloat16()

    def official(x):
        return torch.einsum("tgd,grd->tgr", x.double(), wo_a.double()).flatten(1)
    for T, want in ((1, [(1, torch.float8_e4m3fn, G)]), (5, []), (16, [])):
        reads.clear()
        y = grouped_linear(o[:T], wo_a, fp8)
        assert reads == want and y.shape == (T, G * r)
        ref = official(o[:T])
        assert ((y.double() - ref).abs() <= ref.abs() * 2.0 ** -7 + 1e-6).all(), T
    reads.clear()
    assert torch.equal(grouped_linear(o[:1], wo_a), torch.einsum("tgd,grd->tgr", o[:1], wo_a).flatten(1))
    with mini.ops.deterministic_mode():
        grouped_linear(o[:1], wo_a, fp8)
    mini.ops.set_backend("reference")
    assert torch.equal(grouped_linear(o[:3], wo_a, fp8), torch.einsum("tgd,grd->tgr", o[:3], wo_a).flatten(1))
    assert reads == []


@pytest.mark.gpu
def test_grouped_gemv_at_v41_wo_a_gpu():
    """V4.1's wo_a [8 x 1024, 4096] on the GPU: the one-row grouped FP8 read, each group's exact products' fp32 sums,
    run to run and from a CUDA graph replay the same bits."""
    from mini.formats import dequant_fp8
    G, r, K = 8, 1024, 4096
    q, scale = _fp8_weight(G * r, K, 32, "cuda", seed=8)
    copy = dequant_fp8(q, scale, 32, torch.bfloat16).cpu()
    x = (torch.randn(1, G * K, device="cuda") * 2).bfloat16()
    y = gemv(x, q, out=torch.full((1, G * r), float("nan"), dtype=torch.bfloat16, device="cuda"), scale=scale,
             w_block=32, groups=G)
    for g in range(G):
        _check(y[:, g * r:(g + 1) * r].cpu(), x[:, g * K:(g + 1) * K].cpu(), copy[g * r:(g + 1) * r])
    assert torch.equal(y, gemv(x, q, scale=scale, w_block=32, groups=G))
    out = torch.full_like(y, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, q, out=out, scale=scale, w_block=32, groups=G)
    graph.replay()
    assert torch.equal(out, y)
