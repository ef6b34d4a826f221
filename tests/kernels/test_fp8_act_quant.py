"""One-pass FP8 activation fake quant == mini.formats.fake_quant_fp8, bit for bit."""
import pytest
import torch

from mini.formats import fake_quant_fp8
from mini.kernels.fp8_act_quant import fp8_act_quant


def _check(T, D, block, dtype, device):
    x = (torch.randn(T, D) * torch.logspace(-7, 3, D)).to(dtype).to(device)  # scales from 2^-33 to 2^3, subnormals
    x[0, :block] = 0  # an all-zero group: scale from the 1e-4 floor
    out = fp8_act_quant(x, block, out=torch.full_like(x, float("nan")))
    assert torch.equal(out, fake_quant_fp8(x, block))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [32, 128])
def test_act_quant_matches_formats_interpreter(dtype, block, interpreter):
    _check(5, 3 * 128, block, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [32, 128])
def test_act_quant_matches_formats_gpu(dtype, block):
    _check(301, 5120, block, dtype, "cuda")


def _check_gather(T, D, block, device):
    x = torch.randn(T, D).bfloat16().to(device)
    rows = torch.randint(0, T, (2 * T + 3,), dtype=torch.int32, device=device)
    n_valid = torch.tensor([T + 1], dtype=torch.int32, device=device)  # rows past it stay as they were (NaN)
    out = fp8_act_quant(x, block, out=torch.full((rows.numel(), D), float("nan"), dtype=x.dtype, device=device),
                        rows=rows, n_valid=n_valid)
    want = fake_quant_fp8(x[rows[: T + 1].long()], block) if block else x[rows[: T + 1].long()]
    assert torch.equal(out[: T + 1], want) and out[T + 1:].isnan().all()


@pytest.mark.parametrize("block", [0, 32])
def test_act_quant_gathers_valid_rows_interpreter(block, interpreter):
    _check_gather(7, 2 * 128, block, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("block", [0, 32])
def test_act_quant_gathers_valid_rows_gpu(block):
    _check_gather(301, 5120, block, "cuda")
