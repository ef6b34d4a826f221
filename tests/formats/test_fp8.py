import numpy as np
import pytest
import torch

from formats_numpy_ref import e4m3_round, e4m3_value, e8m0_value, pow2_ceil
from mini.formats import dequant_fp8, fake_quant_fp8, quantize_fp8


def _random_e4m3(shape):
    b = torch.randint(0, 256, shape, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b & 0xF0, b)  # no NaN codes in weights
    return b.to(torch.uint8)


@pytest.mark.parametrize("block,shape", [(32, (70, 45)), (32, (32, 96)), (128, (300, 130)), (128, (129, 257))])
def test_fp8_weight_dequant_non_multiple_shapes(block, shape):
    w = _random_e4m3(shape)
    sshape = (-(-shape[0] // block), -(-shape[1] // block))
    e = torch.randint(100, 150, sshape, dtype=torch.int32).to(torch.uint8)
    got = dequant_fp8(w.view(torch.float8_e4m3fn), e.view(torch.float8_e8m0fnu), block)
    s = e8m0_value(e.numpy()).repeat(block, 0)[: shape[0]].repeat(block, 1)[:, : shape[1]]
    want = (e4m3_value(w.numpy()) * s).astype(np.float32)
    np.testing.assert_array_equal(got.numpy(), want)
    assert dequant_fp8(w, e, block, torch.bfloat16).float().equal(got)  # exact in bf16 as well
    fp32_scale = torch.from_numpy(e8m0_value(e.numpy()).astype(np.float32))
    assert dequant_fp8(w, fp32_scale, block).equal(got)  # fp32 scales are taken as values


def test_e4m3_decode_all_bytes():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = b.view(torch.float8_e4m3fn).float().double().numpy()
    want = e4m3_value(np.arange(256))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])


@pytest.mark.parametrize("block", [32, 128])
def test_quantize_fp8_roundtrip(block):
    w = torch.randn(77, 2 * block + 5) * 0.02
    w[:block, :block] *= 1e4  # blocks with very different ranges
    q, e = quantize_fp8(w, block)
    assert q.dtype == torch.float8_e4m3fn and e.shape == (-(-77 // block), 3)
    back = dequant_fp8(q, e, block)
    rel = ((back - w).abs() / w.abs().clamp_min(1e-30)).max()
    assert rel <= 2.0 ** -4  # e4m3 has 3 mantissa bits: half a ulp relative, plus subnormal corners
    assert back.abs().max() <= w.abs().max() * (1 + 2.0 ** -4)
    assert torch.equal(dequant_fp8(*quantize_fp8(back, block), block), back)


def _np_fake_quant_fp8(x, block):
    g = x.astype(np.float64).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(1e-4))
    s = pow2_ceil(np.float32(amax) * np.float32(1.0 / 448.0))  # the kernel multiplies by an fp32 1/448
    return (e4m3_round(g / s) * s).reshape(x.shape)


def _act_inputs(rows, width, block):
    mag = 10.0 ** torch.randint(-8, 5, (rows, width // block, 1)).float()
    x = (torch.randn(rows, width // block, block) * mag).flatten(-2)
    x[0, :block] = 0
    x[1, :block] = 1e-7 * torch.randn(block)  # amax below the 1e-4 floor
    # exact e4m3 ties under the scale 1: 1 + 1/16 lies between 1 and 1.125, 2^-7 + 2^-10 between subnormals
    x[2, :block] = torch.tensor([448.0, 1.0625, 1.1875, 2.0 ** -7 + 2.0 ** -10, -1.0625, 3.0 ** 5] * block)[:block]
    return x


@pytest.mark.parametrize("block", [32, 128])
def test_act_fake_quant_matches_numpy(block):
    x = _act_inputs(11, 3 * block, block)
    got = fake_quant_fp8(x, block)
    np.testing.assert_array_equal(got.double().numpy(), _np_fake_quant_fp8(x.numpy(), block))
    assert torch.equal(got[0, :block], torch.zeros(block))
    assert got[2, 1].item() == 1.0 and got[2, 2].item() == 1.25  # ties to even mantissa
    xb = x.bfloat16()
    got_b = fake_quant_fp8(xb, block)
    assert got_b.dtype == torch.bfloat16
    np.testing.assert_array_equal(got_b.double().numpy(), _np_fake_quant_fp8(xb.float().numpy(), block))
    assert torch.equal(fake_quant_fp8(got, block), got)  # idempotent


def test_act_fake_quant_scale_is_power_of_two_ceiling():
    x = torch.tensor([[1280.0] + [0.0] * 31])  # amax/448 = 2.86 -> scale 4; 1280/4 = 320 is exact in e4m3
    assert fake_quant_fp8(x, 32)[0, 0].item() == 1280.0
    # amax/448 just over 8: the scale is 16, so 2^-6 / 16 = 2^-10 ties between 0 and the smallest subnormal
    # 2^-9 and rounds to 0 (with a scale of 8 it would survive exactly)
    x = torch.tensor([[448.0 * 8 + 1, 2.0 ** -6] + [0.0] * 30])
    assert fake_quant_fp8(x, 32)[0, :2].tolist() == [448.0 * 8, 0.0]
