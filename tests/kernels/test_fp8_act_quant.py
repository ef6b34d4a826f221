"""One-pass FP8 activation fake quant == mini.formats.fake_quant_fp8, bit for bit."""
import pytest
import torch

from mini.formats import fake_quant_fp8
from mini.kernels.fp8_act_quant import FP8Rows, fp8_act_quant, fp8_act_quant_wire


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
def test_act_quant_gathers_valid_rows_interpreter(block, looped, interpreter):
    _check_gather(7, 2 * 128, block, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("block", [0, 32])
def test_act_quant_gathers_valid_rows_gpu(block, looped):
    _check_gather(301, 5120, block, "cuda")


# ------------------------------------------------------------------------------------- the EP exchange's wire form
def _send_buffer(N, D, block, k, device):
    """One byte row per token as the exchange lays it out (ids, weights, codes, scales, padding to 16 bytes),
    poisoned with 0xA5 so that a byte left unwritten shows; the four fields as views into it."""
    used = 8 * k + D + D // block
    width = used + (-used % 16)
    buf = torch.full((N, width), 0xA5, dtype=torch.uint8, device=device)
    ids = buf.view(torch.int32)[:, :k]
    weights = buf.view(torch.float32)[:, k:2 * k]
    codes, scales = buf[:, 8 * k: 8 * k + D], buf[:, 8 * k + D: used]
    return buf, ids, weights, codes, scales


def _check_wire_encode(T, N, D, block, k, dtype, device):
    from mini.parallel.exchange import encode_fp8
    g = torch.Generator().manual_seed(T * 7 + D)
    x = (torch.randn(T, D, generator=g) * torch.logspace(-9, 4, D)).to(dtype)
    x[:1, :block] = 0  # an all-zero group
    x[-1:, block: 2 * block] = -1e-30  # negative values that round to zero: e4m3 -0 (0x80), as torch's cast
    ids = torch.randint(0, 384, (T, k), generator=g)
    weights = torch.rand(T, k, generator=g)
    buf, ids_out, weights_out, codes, scales = _send_buffer(N, D, block, k, device)
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)
    fp8_act_quant_wire(x, block, codes, scales, ids, weights, ids_out, weights_out)
    want_codes, want_scales = encode_fp8(x, block)
    pad_codes, pad_scales = encode_fp8(torch.zeros(N - T, D, dtype=dtype, device=device), block)
    assert torch.equal(codes[:T], want_codes) and torch.equal(scales[:T], want_scales)
    assert torch.equal(codes[T:], pad_codes) and torch.equal(scales[T:], pad_scales)
    assert T == 0 or (codes[T - 1, block: 2 * block] == 0x80).all()
    assert torch.equal(ids_out[:T], ids.to(torch.int32)) and torch.equal(weights_out[:T], weights)
    assert (ids_out[T:] == -1).all() and (weights_out[T:] == 0).all()  # padding rows route nowhere
    assert (buf[:, 8 * k + D + D // block:] == 0xA5).all(), "the row padding was written"


@pytest.mark.parametrize("T,N,D,block,k,dtype", [(5, 5, 3 * 128, 32, 6, torch.bfloat16),
                                                   (3, 7, 2 * 128, 128, 8, torch.float32),
                                                   (0, 2, 64, 32, 1, torch.bfloat16)])
def test_wire_encode_writes_encode_fp8_bytes_and_routing_interpreter(T, N, D, block, k, dtype, interpreter):
    _check_wire_encode(T, N, D, block, k, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("T,N", [(4096, 4096), (301, 333)])
def test_wire_encode_writes_encode_fp8_bytes_and_routing_gpu(T, N):
    _check_wire_encode(T, N, 5120, 32, 6, torch.bfloat16, "cuda")


def test_wire_encode_refuses_bad_views():
    x = torch.randn(4, 64)
    buf, ids_out, weights_out, codes, scales = _send_buffer(4, 64, 32, 2, "cpu")
    with pytest.raises(ValueError, match="output rows"):
        fp8_act_quant_wire(x, 32, codes[:3], scales[:3])
    with pytest.raises(ValueError, match="together"):
        fp8_act_quant_wire(x, 32, codes, scales, ids=torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="scales must be"):
        fp8_act_quant_wire(x, 32, codes, codes)


def _check_wire_decode(N, D, block, dtype, gather, device):
    from mini.parallel.exchange import decode_fp8
    g = torch.Generator().manual_seed(N + D)
    buf, _, _, codes, scales = _send_buffer(N, D, block, 3, device)
    # every e4m3 byte (NaN codes 0x7F / 0xFF included) under scale bytes 10..254 (products stay fp32-normal: a GPU
    # may flush subnormals; the encoder's scales are >= 2^-22 anyway) and the NaN scale 255
    codes.copy_(torch.arange(N * D).remainder(256).view(N, D).to(torch.uint8))
    scales.copy_(torch.randint(10, 256, (N, D // block), generator=g, dtype=torch.uint8))
    src = FP8Rows(codes, scales, block, dtype)
    want = decode_fp8(codes, scales, block, dtype)
    if gather:
        rows = torch.randint(0, N, (2 * N + 3,), generator=g, dtype=torch.int32).to(device)
        n_valid = torch.tensor([N + 1], dtype=torch.int32, device=device)
        out = torch.full((rows.numel(), D), float("nan"), dtype=dtype, device=device)
        got = fp8_act_quant(src, block, out=out, rows=rows, n_valid=n_valid)
        assert got.data_ptr() == out.data_ptr() and out[N + 1:].isnan().all()  # rows past n_valid untouched
        got, want = got[: N + 1], want[rows[: N + 1].long()]
    else:
        got = fp8_act_quant(src, block)
    assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
    same = ~want.isnan()
    assert torch.equal(got[same], want[same]) and torch.equal(got[same].signbit(), want[same].signbit())


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("block,dtype", [(32, torch.bfloat16), (128, torch.float32)])
def test_wire_decode_equals_decode_fp8_interpreter(block, dtype, gather, looped, interpreter):
    _check_wire_decode(5, 2 * 128, block, dtype, gather, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("gather", [False, True])
def test_wire_decode_equals_decode_fp8_gpu(gather, looped):
    _check_wire_decode(301, 5120, 32, torch.bfloat16, gather, "cuda")


def test_wire_decode_refuses_another_block():
    _, _, _, codes, scales = _send_buffer(2, 64, 32, 1, "cpu")
    with pytest.raises(ValueError, match="block 32 cannot be re-quantized at block 128"):
        fp8_act_quant(FP8Rows(codes, scales, 32, torch.bfloat16), 128)


_SM90_WIRE = """
import sys
sys.path.insert(0, "tests/kernels")
from sm90_build import build
from mini.kernels.fp8_act_quant import _wire_decode_kernel, _wire_encode_kernel
u8 = {"codes_ptr": "*u8", "scales_ptr": "*u8"}
for routing in (True, False):
    build(_wire_encode_kernel, {**u8, "ids_ptr": "*i64", "wts_ptr": "*fp32", "ids_out_ptr": "*i32",
                                "wts_out_ptr": "*fp32"}, dict(BLOCK=32, GROUPS=16, ROWS=4, KP=8, ROUTING=routing))
for gather in (True, False):
    build(_wire_decode_kernel, {**u8, "src_row_ptr": "*i32", "n_valid_ptr": "*i32"},
          dict(BLOCK=32, GROUPS=16, ROWS=4, GATHER=gather))
"""


@pytest.mark.slow
def test_wire_kernels_build_for_sm90():
    """The wire encode / decode kernels compile for Hopper (the hardware e4m3 conversion included), checked on any
    machine: a subprocess without TRITON_INTERPRET, as tests/kernels/test_sm90_build.py does."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _SM90_WIRE], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" ok") == 4, run.stdout
