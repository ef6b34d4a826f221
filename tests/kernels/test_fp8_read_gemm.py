"""The FP8-read GEMM of a few dozen rows (mini/kernels/fp8_read_gemm.py) against an fp64 GEMM of the bf16 copy's
values (mini.formats.dequant_fp8): on CPU under the interpreter with small tiles (splits, N and K tails, odd row
counts, the smallest scale byte taken), on the GPU at V4.1's projection shapes."""
import pytest
import torch

from mini.formats import dequant_fp8, quantize_fp8
from mini.kernels.fp8_read_gemm import (CANDIDATES, DEFAULT, MAX_ROWS, MIN_SCALE_BYTE, Fp8ReadConfig,
                                        fp8_read_gemm, rows_per_program, split_k)

SMALL = Fp8ReadConfig(block_n=16, block_k=64, num_warps=1, num_stages=1, programs_per_sm=1)
SMALL_SWAP = Fp8ReadConfig(block_n=16, block_k=64, num_warps=1, num_stages=1, programs_per_sm=1, swap=True)
V41_SHAPES = ((1792, 5120), (36864, 1280), (5120, 8192), (4608, 5120), (5120, 2304))


def _operands(T, N, K, device, seed=0, tiny_scales=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K, generator=g) * 2).bfloat16()
    w = torch.randn(N, K, generator=g) / K ** 0.5
    w *= torch.exp2(torch.randint(-6, 7, (N, 1), generator=g).float())  # scale rows apart
    q, scale = quantize_fp8(w, 32)
    if tiny_scales:  # the smallest E8M0 byte taken, for the first 32 rows: e4m3's subnormals widen to 2^-126
        scale[0, :] = MIN_SCALE_BYTE
    return x.to(device), q.to(device), scale.to(device)


def _check(y, x, q, scale):
    """Each output is one bf16 rounding of an fp32 sum of the bf16 copy's exact products: within half a bf16 ulp
    of the exact sum plus what another order of the fp32 sum moves (1e-5 of the sum of |products|)."""
    wb = dequant_fp8(q.cpu(), scale.cpu(), 32, torch.bfloat16).double()
    xd = x.cpu().double()
    ref, spread = xd @ wb.T, xd.abs() @ wb.abs().T
    err = (y.cpu().double() - ref).abs()
    assert not torch.isnan(y).any()
    assert (err <= ref.abs() * 2.0 ** -8 + spread * 1e-5).all(), f"max error {err.max().item():.3g}"
    same = (y.cpu() == (x.cpu().float() @ wb.float().T).bfloat16()).float().mean().item()
    assert same > 0.97, same


def test_split_k_covers_k_in_whole_steps():
    for N, K in V41_SHAPES + ((100, 96), (37, 320)):
        for T in (17, 64, 96):
            for cfg in (DEFAULT, SMALL):
                pieces, k_piece = split_k(N, K, T, cfg)
                assert k_piece % cfg.block_k == 0 and pieces * k_piece >= K > (pieces - 1) * k_piece
    assert [rows_per_program(T) for T in (1, 16, 17, 33, 64, 65, MAX_ROWS)] == [16, 16, 32, 64, 64, 64, 64]
    assert split_k(36864, 1280, 64)[0] == 1 and split_k(1792, 5120, 64)[0] > 1  # wide wq_b fills the GPU alone


@pytest.mark.parametrize("T,N,K,tiny", [(17, 100, 96, False), (5, 37, 320, True), (33, 48, 64, False),
                                        (70, 20, 128, True)])
def test_matches_the_bf16_copy_interpreter(interpreter, poisoned, T, N, K, tiny):
    """Split K (3 and 5 pieces of 64), N tails inside a scale block, rows over one and two row blocks (BM 16-64),
    and the smallest E8M0 byte taken; the swapped product (SWAP) gives the same bits here (the interpreter sums in
    one order either way; on the GPU its MMAs may add in another)."""
    x, q, scale = _operands(T, N, K, "cpu", seed=T, tiny_scales=tiny)
    y = fp8_read_gemm(x, q, scale, config=SMALL)
    _check(y, x, q, scale)
    assert torch.equal(fp8_read_gemm(x, q, scale, config=SMALL_SWAP), y)  # the swapped product: the same sums


def test_refuses_what_it_cannot_take():
    x, q, scale = _operands(4, 32, 64, "cpu")
    with pytest.raises(ValueError, match="rows"):
        fp8_read_gemm(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16), q, scale)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_read_gemm(x, q.float(), scale)
    with pytest.raises(ValueError, match="scale"):
        fp8_read_gemm(x, q, scale[:, :1])


def test_switch_sends_17_to_64_rows_here_interpreted(interpreter, fast_interpreted, monkeypatch):
    """MINI_FP8_READ=on: linear and linears (the stacked bytes and scales) of 17-64 rows reach the kernel with the
    FP8 weight, within a bf16 rounding of cuBLAS's on the copy (=off); 16 and 65 rows, the deterministic mode, a
    scale byte below MIN_SCALE_BYTE and the switch off do not."""
    import mini.kernels.fp8_read_gemm as module
    import mini.ops
    from mini.ops.linear import QWeight, linear, linears
    calls, real = [], module.fp8_read_gemm
    monkeypatch.setattr(module, "fp8_read_gemm", lambda x, w, s, **kw: calls.append(x.shape[0]) or real(
        x, w, s, config=SMALL, **kw))
    ws = [QWeight("fp8", *_operands(1, n, 160, "cpu", seed=n)[1:], 32) for n in (64, 24)]
    x = (torch.randn(40, 160) * 2).bfloat16()
    monkeypatch.setenv("MINI_FP8_READ", "on")
    on = [linear(x, w) for w in ws] + list(linears(x, tuple(ws)))
    assert calls == [40] * 3
    monkeypatch.setenv("MINI_FP8_READ", "off")
    off = [linear(x, w) for w in ws] + list(linears(x, tuple(ws)))
    assert calls == [40] * 3
    for a, b in zip(on, off):
        assert ((a.double() - b.double()).abs() <= b.double().abs() * 2.0 ** -7 + 1e-6).all()
    monkeypatch.setenv("MINI_FP8_READ", "on")
    calls.clear()
    linear(x[:17], ws[0])
    linear(torch.randn(64, 160).bfloat16(), ws[0])
    linear(x[:16], ws[0])
    linear(torch.randn(65, 160).bfloat16(), ws[0])
    with mini.ops.deterministic_mode():
        linear(x, ws[0])
    small = QWeight("fp8", ws[0].data, ws[0].scale.clone(), 32)
    small.scale[0, 0] = MIN_SCALE_BYTE - 1
    linear(x, small)
    assert calls == [17, 64]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [17, 32, 64, 96])
@pytest.mark.parametrize("name", list(CANDIDATES))
def test_at_v41_shapes_gpu(T, name):
    for N, K in V41_SHAPES:
        x, q, scale = _operands(T, N, K, "cuda", seed=N + T, tiny_scales=N == 1792)
        _check(fp8_read_gemm(x, q, scale, config=CANDIDATES[name]), x, q, scale)
