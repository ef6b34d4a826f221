import numpy as np
import pytest
import torch

from mini.ops.norm import rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [1e-20, 1e-6])
def test_rms_norm_matches_float64(dtype, eps):
    x = (torch.randn(7, 3, 131) * 5).to(dtype)
    w = torch.randn(131).to(dtype)
    got = rms_norm(x, w, eps)
    assert got.dtype == dtype and got.shape == x.shape
    xd, wd = x.double().numpy(), w.double().numpy()
    want = wd * xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + eps)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol)


def test_rms_norm_statistics_in_fp32_for_bf16_input():
    # bf16 input whose squares would lose precision in bf16 accumulation: the result must equal the fp32 path
    x = (torch.randn(4, 5120) * 30).bfloat16()
    w = torch.rand(5120).bfloat16() + 0.5
    assert torch.equal(rms_norm(x, w, 1e-20), rms_norm(x.float(), w.float(), 1e-20).bfloat16())


def test_rms_norm_tiny_eps_zero_row_and_scale_invariance():
    x = torch.zeros(2, 64)
    x[1] = torch.randn(64) * 1e-8
    w = torch.ones(64)
    out = rms_norm(x, w, 1e-20)
    assert torch.equal(out[0], torch.zeros(64))
    # with eps 1e-20 even a 1e-8-scale row is normalised to unit RMS (eps 1e-6 would crush it)
    assert abs(out[1].square().mean().item() - 1) < 1e-4
    assert rms_norm(x, w, 1e-6)[1].abs().max() < 1e-4
