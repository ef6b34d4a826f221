import numpy as np
import pytest
import torch

from formats_numpy_ref import e2m1_round, e2m1_value, e4m3_round, e8m0_value, pow2_ceil
from mini.formats import (E2M1_VALUES, dequant_mxfp4, e2m1_codes, e2m1_round as mini_e2m1_round, fake_quant_fp4,
                          pack_fp4, quantize_mxfp4, unpack_fp4_codes)

TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
TIE_RESULTS = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # round half to even code (spec §5)


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_fp4_all_codes_and_scales():
    """Every byte (two codes) under every E8M0 exponent decodes bit-exactly (row e uses exponent e)."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)  # [256, 256] -> 512 values/row
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1).repeat(1, 16)  # [256, 512/32]
    got = dequant_mxfp4(packed.view(torch.int8), scale.view(torch.float8_e8m0fnu))
    byte = np.arange(256)
    codes = np.stack([byte & 0xF, byte >> 4], -1).reshape(-1)  # low nibble first
    with np.errstate(invalid="ignore", over="ignore"):
        want = (e2m1_value(codes)[None, :] * e8m0_value(np.arange(256))[:, None]).astype(np.float32)
    want = torch.from_numpy(want)
    nan = torch.isnan(want)
    assert nan[255].all() and not nan[:255].any()
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got[:255]), _bits(want[:255]))  # signed zeros, subnormals, infinities included
    # byte b holds elements 2b (low nibble) and 2b+1 (high nibble); code 8 is -0 under any finite scale
    assert got[:255, 0:2].eq(0).all() and not torch.signbit(got[:255, 0:2]).any()  # byte 0x00: +0, +0
    assert got[:255, 16].eq(0).all() and torch.signbit(got[:255, 16]).all()  # byte 0x08, low nibble: -0
    assert torch.signbit(got[:255, 2 * 0x80 + 1]).all()  # byte 0x80, high nibble: -0
    assert got[0, 2 * 0x77].item() == 6 * 2.0 ** -127 and got[254, 2 * 0x77].item() == float("inf")


def test_unpack_order_low_nibble_first_and_pack_inverse():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (5, 32)
    assert torch.equal(packed & 0xF, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    assert torch.equal(unpack_fp4_codes(packed.view(torch.int8)), codes)
    assert torch.equal(unpack_fp4_codes(packed.view(torch.float4_e2m1fn_x2)), codes)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_round_to_nearest_even_on_every_tie(sign):
    x = sign * torch.tensor(TIES)
    assert torch.equal(mini_e2m1_round(x), sign * torch.tensor(TIE_RESULTS))
    # just off a tie goes to the nearer value
    up, down = torch.nextafter(x.abs(), torch.tensor(10.0)), torch.nextafter(x.abs(), torch.tensor(0.0))
    hi = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    lo = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    assert torch.equal(mini_e2m1_round(sign * up), sign * hi)
    assert torch.equal(mini_e2m1_round(sign * down), sign * lo)


def test_e2m1_codes_exact_values_and_signed_zero():
    for code in range(16):
        v = E2M1_VALUES[code]
        assert e2m1_codes(v.unsqueeze(0)).item() == code
    assert e2m1_codes(torch.tensor([-0.0, -0.1])).tolist() == [8, 8]  # sign of zero survives rounding
    x = torch.randn(10000) * 3
    x = x.clamp(-6, 6)
    np.testing.assert_array_equal(mini_e2m1_round(x).numpy(), e2m1_round(x.double().numpy()))


def _np_fake_quant_fp4(x, block, scale):
    g = x.astype(np.float64).reshape(*x.shape[:-1], -1, block)
    amax = np.abs(g).max(-1, keepdims=True)
    if scale == "e4m3":
        s = e4m3_round(np.float32(np.maximum(amax, 6 * 2.0 ** -9)) / np.float32(6.0))
    else:
        s = pow2_ceil(np.float32(np.maximum(amax, 6 * 2.0 ** -126)) * np.float32(1 / 6))
    return (e2m1_round(np.clip(g / s, -6, 6)) * s).reshape(x.shape)


def _fp4_inputs(rows, width, block):
    x = torch.randn(rows, width) * 10.0 ** torch.randint(-6, 4, (rows, width // block, 1)).float().repeat_interleave(
        block, -1).flatten(-2)
    x[0, :block] = 0  # all-zero group: the scale clamp keeps it finite
    x[1, :block] = 1e-9 * torch.randn(block)  # below every clamp
    x[2, :block] = torch.tensor(TIES * (block // 7 + 1))[:block] * (2 if block == 16 else 1)  # exact ties
    return x


@pytest.mark.parametrize("block,scale", [(16, "e4m3"), (32, "ue8m0"), (32, "e4m3")])
def test_fake_quant_fp4_matches_numpy(block, scale):
    x = _fp4_inputs(13, 7 * block, block)
    got = fake_quant_fp4(x, block, scale)
    want = _np_fake_quant_fp4(x.numpy(), block, scale)
    np.testing.assert_array_equal(got.double().numpy(), want)
    assert torch.equal(got[0, :block], torch.zeros(block))
    xb = x.bfloat16()
    got_b = fake_quant_fp4(xb, block, scale)
    assert got_b.dtype == torch.bfloat16
    np.testing.assert_array_equal(got_b.double().numpy(), _np_fake_quant_fp4(xb.float().numpy(), block, scale))


def test_fake_quant_fp4_clamp_constants():
    zeros = torch.zeros(1, 16)
    tiny = torch.full((1, 32), 2.0 ** -140)
    # e4m3 scale of an all-zero or tiny group is e4m3(2^-9) = 2^-9 (the smallest e4m3 subnormal), not 0
    assert fake_quant_fp4(zeros, 16, "e4m3").abs().sum() == 0
    x = torch.tensor([[2.0 ** -9 * 0.75] + [0.0] * 15])  # x/s = 0.75 -> 1.0 (tie, even) under the clamp floor
    assert fake_quant_fp4(x, 16, "e4m3")[0, 0].item() == 2.0 ** -9
    # ue8m0: amax clamps at 6*2^-126, so the scale is 2^-126 and 2^-140 rounds to 0
    assert fake_quant_fp4(tiny, 32, "ue8m0").abs().sum() == 0
    with pytest.raises(ValueError):
        fake_quant_fp4(zeros, 16, "e5m2")


def test_quantize_mxfp4_matches_numpy_and_roundtrips():
    w = torch.randn(9, 96) * 10.0 ** torch.randint(-3, 3, (9, 3, 1)).float().repeat_interleave(32, -1).flatten(-2)
    packed, e = quantize_mxfp4(w)
    assert packed.shape == (9, 48) and e.shape == (9, 3)
    got = dequant_mxfp4(packed, e)
    want = _np_fake_quant_fp4(w.numpy(), 32, "ue8m0")
    np.testing.assert_array_equal(got.double().numpy(), want)
    assert torch.equal(dequant_mxfp4(*quantize_mxfp4(got)), got)  # decoded values are fixed points
