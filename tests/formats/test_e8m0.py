import numpy as np
import pytest
import torch

from formats_numpy_ref import e8m0_value
from mini.formats import e8m0_to_float, float_to_e8m0, pow2_ceil_scale


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_e8m0_every_byte_matches_definition():
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e8m0_to_float(e)
    want = torch.from_numpy(e8m0_value(np.arange(256)).astype(np.float32))
    assert torch.isnan(got[255]) and not torch.isnan(got[:255]).any()
    assert torch.equal(_bits(got[:255]), _bits(want[:255]))
    assert _bits(got[0]).item() == 0x00400000  # 2^-127 is an fp32 subnormal
    assert got[127].item() == 1.0 and got[254].item() == 2.0 ** 127


def test_e8m0_accepts_torch_dtype_and_agrees_with_torch_cast():
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    got, ref = e8m0_to_float(e), e.float()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(_bits(got[:255]), _bits(ref[:255]))


def test_float_to_e8m0_roundtrip_and_rejects_non_powers():
    e = torch.arange(1, 255, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(float_to_e8m0(e8m0_to_float(e)), e)
    for bad in (3.0, 0.0, -2.0):
        with pytest.raises(ValueError):
            float_to_e8m0(torch.tensor([bad]))


def test_pow2_ceil_scale_from_bits():
    x = torch.cat([torch.rand(4000) * 10.0 ** torch.randint(-30, 30, (4000,)).float(),
                   2.0 ** torch.arange(-126, 127).float()])
    got = pow2_ceil_scale(x).double().numpy()
    m, e = np.frexp(x.double().numpy())
    want = np.where(m == 0.5, np.ldexp(1.0, e - 1), np.ldexp(1.0, e))
    np.testing.assert_array_equal(got, want)
