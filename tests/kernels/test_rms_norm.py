"""Parity of the RMSNorm kernel (mini/kernels/rms_norm.py) with the reference op mini.ops.norm.rms_norm, plus the
optional FP8 fake quant of its output, and the op's dispatch: the fast backend takes the kernel where `supported`
holds and the torch ops elsewhere (their bits), the reference backend never takes it. Fresh random data, odd row
counts and widths, NaN-poisoned outputs. The kernel sums the squares in another order than torch: fp32 outputs
within 1e-5, bf16 outputs within one bf16 step (rarely off at all). CPU: Triton's interpreter at small sizes; gpu:
the compiled kernel at V4.1-Flash's widths (5,120 model, 1,280 q_lora, 512 KV / compressor, 128 index head, 1,024
vision) and V4-Pro's 7,168, one decode row to prefill-sized steps."""
import pytest
import torch

import mini.ops
from mini.formats import fake_quant_fp8
from mini.kernels import rms_norm as kernel_module  # after tests/kernels/conftest.py chose the interpreter or not
from mini.ops.norm import rms_norm

pytestmark = pytest.mark.usefixtures("reference_ops")

EPS = 1e-20


def inputs(shape, dtype, w_dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(w_dtype)
    return x.to(device), w.to(device)


def check(x, w, quant=False, eps=EPS):
    """The kernel against the reference op (the reference backend: torch ops), both into NaN-poisoned buffers."""
    got = kernel_module.rms_norm(x, w, eps, "fp8" if quant else None)
    want = rms_norm(x, w, eps)
    want = fake_quant_fp8(want, 32) if quant else want
    assert got.dtype == x.dtype and got.shape == x.shape
    assert not got.isnan().any()
    if x.dtype == torch.float32 and not quant:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # one rounding step (bf16 step 2^-7 / e4m3 step 2^-3 of the value) where the statistic rounds the other way
        step = 0.13 if quant else 2.0 ** -7
        assert (got != want).float().mean() < 5e-3
        assert ((got.float() - want.float()).abs() <= step * want.float().abs() + 1e-30).all()


@pytest.mark.parametrize("shape,dtype,w_dtype,quant", [
    ((7, 96), torch.float32, torch.float32, False),
    ((3, 5, 160), torch.float32, torch.float32, True),
    ((5, 37), torch.bfloat16, torch.bfloat16, False),  # a width that is not a power of two
    ((2, 3, 200), torch.bfloat16, torch.float32, False),  # fp32 weight on bf16 rows (the compressor's norm)
    ((1, 1280), torch.bfloat16, torch.bfloat16, False),  # one decode row at V4.1's q_lora width
    ((4, 64), torch.float16, torch.bfloat16, False)])
def test_rms_norm_interpreter(shape, dtype, w_dtype, quant, interpreter, poisoned):
    x, w = inputs(shape, dtype, w_dtype, "cpu", seed=sum(shape))
    check(x, w, quant)


def test_rms_norm_eps_and_zero_rows_interpreter(interpreter, poisoned):
    """V4's eps 1e-6 and V4.1's 1e-20; a zero row stays zero (0 * rsqrt(eps)), a 1e-8-scale row is normalised to
    unit RMS under 1e-20 and crushed under 1e-6, as the reference does."""
    x, w = inputs((3, 48), torch.float32, torch.float32, "cpu", seed=1)
    x[0] = 0
    x[1] *= 1e-8
    for eps in (1e-20, 1e-6):
        check(x, w, eps=eps)
    assert torch.equal(kernel_module.rms_norm(x, w, 1e-20)[0], torch.zeros(48))


def test_rows_alone_equal_rows_among_others_interpreter(interpreter):
    """Batch invariance (the deterministic mode's need): a row's result does not depend on the rows beside it."""
    x, w = inputs((19, 80), torch.bfloat16, torch.bfloat16, "cpu", seed=2)
    among = kernel_module.rms_norm(x, w, EPS)
    for r in (0, 7, 18):
        assert torch.equal(kernel_module.rms_norm(x[r:r + 1], w, EPS), among[r:r + 1])


def test_op_takes_the_kernel_only_on_the_fast_backend_where_supported_interpreter(interpreter, monkeypatch):
    """mini.ops.norm.rms_norm: on the fast backend the kernel for supported tensors (the kernel's result), the
    torch ops (the reference backend's bits) for a width over MAX_D, a float64 x or a weight of another width;
    never the kernel on the reference backend. The kernel's wrapper refuses what `supported` refuses."""
    calls = []
    real = kernel_module.rms_norm
    monkeypatch.setattr(kernel_module, "rms_norm", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    ok = inputs((3, 72), torch.bfloat16, torch.bfloat16, "cpu", seed=3)
    refused = [inputs((2, kernel_module.MAX_D + 8), torch.bfloat16, torch.bfloat16, "cpu", seed=4),
               inputs((2, 40), torch.float64, torch.float64, "cpu", seed=5),
               (inputs((2, 40), torch.bfloat16, torch.bfloat16, "cpu", seed=6)[0], torch.ones(20).bfloat16())]
    want = [rms_norm(*ok, EPS)] + [None if x.shape[-1] != w.shape[0] else rms_norm(x, w, EPS) for x, w in refused]
    assert not calls
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    try:
        got = rms_norm(*ok, EPS)
        assert calls == [ok[0].shape]
        assert torch.equal(got, real(*ok, EPS))
        torch.testing.assert_close(got, want[0], rtol=2.0 ** -7, atol=0)
        for (x, w), ref in zip(refused, want[1:]):
            assert not kernel_module.supported(x, w)
            with pytest.raises(ValueError, match="rms_norm kernel"):
                real(x, w, EPS)
            if ref is None:  # the torch ops' own error, as on the reference backend
                with pytest.raises(RuntimeError):
                    rms_norm(x, w, EPS)
            else:
                assert torch.equal(rms_norm(x, w, EPS), ref)
        assert calls == [ok[0].shape]
    finally:
        mini.ops.set_backend("reference", interpret_on_cpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("D,quant", [(5120, False), (5120, True), (1280, False), (1280, True), (512, False),
                                     (128, False), (1024, False), (7168, False), (16384, False), (37, False)])
@pytest.mark.parametrize("rows", [1, 3, 1003])
def test_rms_norm_gpu(D, quant, rows, poisoned):
    x, w = inputs((rows, D), torch.bfloat16, torch.bfloat16, "cuda", seed=D + rows)
    check(x, w, quant)
    if not quant:
        check(x.float(), w.float())
        check(x, w.float())


@pytest.mark.gpu
def test_rows_alone_equal_rows_among_others_gpu():
    x, w = inputs((4096, 5120), torch.bfloat16, torch.bfloat16, "cuda", seed=7)
    among = kernel_module.rms_norm(x, w, EPS)
    for r in (0, 1, 1000, 4095):
        assert torch.equal(kernel_module.rms_norm(x[r:r + 1], w, EPS), among[r:r + 1])
        assert torch.equal(kernel_module.rms_norm(x[r:r + 3], w, EPS), among[r:r + 3])


@pytest.mark.gpu
def test_op_takes_the_kernel_on_cuda_gpu(monkeypatch):
    """The fast backend's op on CUDA tensors is the kernel, inside a CUDA graph too (a decode step's replay)."""
    calls = []
    real = kernel_module.rms_norm
    monkeypatch.setattr(kernel_module, "rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w = inputs((1, 5120), torch.bfloat16, torch.bfloat16, "cuda", seed=8)
    with mini.ops.using_backend("fast"):
        eager = rms_norm(x, w, EPS)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rms_norm(x, w, EPS)
        graph.replay()
    assert len(calls) == 2
    assert torch.equal(eager, real(x, w, EPS)) and torch.equal(out, eager)


def test_strided_rows_are_read_in_place_interpreter(interpreter, poisoned):
    """A column slice of a stacked projection's output (the q latent beside the KV) gives the same bits as its
    contiguous copy, into a contiguous output."""
    wide, w = inputs((5, 1280 + 512), torch.bfloat16, torch.bfloat16, "cpu", seed=3)
    x = wide[:, 512:]
    got = kernel_module.rms_norm(x, w[512:], EPS)
    assert got.is_contiguous() and torch.equal(got, kernel_module.rms_norm(x.contiguous(), w[512:], EPS))
    check(x, w[512:])
