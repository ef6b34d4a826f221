"""The Triton quantization toolbox (mini/kernels/quant.py) against plain PyTorch on exhaustive value sets: every
e4m3 value, the midpoints between neighbours (the ties) and a point either side of each, in both signs; every E2M1
tie and neighbour; fake_quant_tile of each kind == mini.formats' fake quant, bit for bit."""
import pytest
import torch
import triton
import triton.language as tl

from mini.formats import E2M1_VALUES, fake_quant_fp4, fake_quant_fp8
from mini.formats.fp4 import e2m1_round as torch_e2m1_round
from mini.kernels.quant import e2m1_round, e4m3_round, fake_quant_tile


@triton.jit
def _apply(x_ptr, out_ptr, n, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    r = e4m3_round(v) if WHICH == 0 else e2m1_round(v)
    tl.store(out_ptr + offs, r, mask=offs < n)


@triton.jit
def _tile(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, QBLOCK: tl.constexpr, KIND: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(out_ptr + offs, fake_quant_tile(tl.load(x_ptr + offs), ROWS, COLS, QBLOCK, KIND))


def _run(x: torch.Tensor, which: int) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    _apply[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), WHICH=which, BLOCK=1024)
    return out


def _e4m3_cases(device) -> torch.Tensor:
    """Every finite e4m3 value up to 448, the midpoints between neighbours and one fp32 ulp either side."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v) & (v >= 0)].unique().sort().values
    mid = (v[1:] + v[:-1]) / 2
    near = torch.cat([mid, torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, mid + 1)])
    x = torch.cat([v, near])
    return torch.cat([x, -x]).to(device)


def _check_e4m3(device):
    x = _e4m3_cases(device)
    want = x.to(torch.float8_e4m3fn).float()  # torch's cast: round to nearest, ties to even
    assert torch.equal(_run(x, 0), want)


def _check_e2m1(device):
    v = E2M1_VALUES.float()
    v = v[v >= 0]
    mid = (v[1:] + v[:-1]) / 2
    x = torch.cat([v, mid, torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, mid + 1)])
    x = torch.cat([x, -x]).to(device)
    assert torch.equal(_run(x, 1), torch_e2m1_round(x))


def _check_tiles(device):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 64, generator=g) * torch.logspace(-6, 3, 64)).to(device)
    x[1, :32] = 0  # an all-zero group: the scale floors
    for kind, code, block, ref in [("fp8", 1, 32, lambda t: fake_quant_fp8(t, 32)),
                                   ("fp4_ue8m0", 2, 32, lambda t: fake_quant_fp4(t, 32, "ue8m0")),
                                   ("fp4_e4m3", 3, 16, lambda t: fake_quant_fp4(t, 16, "e4m3"))]:
        out = torch.full_like(x, float("nan"))
        _tile[(1,)](x, out, ROWS=8, COLS=64, QBLOCK=block, KIND=code)
        assert torch.equal(out, ref(x)), kind


def test_rounding_and_tiles_interpreter(interpreter):
    _check_e4m3("cpu")
    _check_e2m1("cpu")
    _check_tiles("cpu")


@pytest.mark.gpu
def test_rounding_and_tiles_gpu():
    _check_e4m3("cuda")
    _check_e2m1("cuda")
    _check_tiles("cuda")
