"""Parity of Engram's gate + update kernel (mini/kernels/engram_gate.py) with the reference op
mini.ops.engram.gated_update, and the op's dispatch: the fast backend takes the kernel where `supported` holds and
the torch ops elsewhere, the reference backend never. Fresh random data with copies at different scales (gates
unsaturated), a zero copy (its dot is 0: the floor's gate), odd token counts and widths, a token mask,
NaN-poisoned outputs. The kernel sums in another order than torch and takes the GPU's fast exp: fp32 outputs
within 1e-5, bf16 outputs within one bf16 step plus that error of the sum's operands (rarely off at all). CPU: Triton's interpreter at small sizes; gpu:
the compiled kernel at V4.1-Flash's Engram shape (hc 4, D 5,120)."""
import pytest
import torch

import mini.ops
from mini.kernels import engram_gate as kernel_module  # after tests/kernels/conftest.py chose the interpreter or not
from mini.ops.engram import GATE_FLOOR, gated_update

pytestmark = pytest.mark.usefixtures("reference_ops")

EPS = 1e-20


def inputs(T, hc, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, hc, D, generator=g) * torch.logspace(-1, 1, hc)[:, None]  # copies at 0.1 .. 10
    h[T // 2, 0] = 0  # a zero copy: dot 0, the floor's gate
    kv = torch.randn(T, (hc + 1) * D, generator=g)
    w = (torch.rand(hc, D, generator=g) + 0.5) * torch.randn(hc, D, generator=g)
    mask = torch.rand(T, generator=g) > 0.3
    return h.to(dtype).to(device), kv.to(dtype).to(device), w.to(device), mask.to(device)


def check(h, kv, w, mask):
    got = kernel_module.engram_gate(h, kv, w, EPS, GATE_FLOOR, mask)
    want = gated_update(h, kv, w, EPS, mask)
    assert got.dtype == h.dtype and got.shape == h.shape
    assert not got.isnan().any()
    if mask is not None:  # a closed gate leaves the stream as it was
        assert torch.equal(got[~mask], h[~mask])
    if h.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the fp32 sum h + gate * value (gate <= 1) within 1e-5 of its operands, as in fp32, then rounded to bf16:
        # one bf16 step of the result (2^-7 of it) plus that error. Where h and gate * value nearly cancel, the error
        # is many steps of the small result: a bound relative to the result alone failed there on the H200 (bf16 at
        # T = 1003, 2 of 3 cases, while fp32 at the same T held 1e-5)
        assert (got != want).float().mean() < 5e-3
        scale = h.float().abs() + kv[:, None, h.shape[1] * h.shape[2]:].float().abs()
        assert ((got.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 2e-5 * scale).all()


@pytest.mark.parametrize("T,hc,D,dtype,masked", [
    (5, 4, 64, torch.float32, False), (7, 4, 96, torch.float32, True), (3, 2, 200, torch.bfloat16, True),
    (1, 4, 1280, torch.bfloat16, False)])
def test_engram_gate_interpreter(T, hc, D, dtype, masked, interpreter, poisoned):
    h, kv, w, mask = inputs(T, hc, D, dtype, "cpu", seed=T * D)
    check(h, kv, w, mask if masked else None)


def test_gates_are_unsaturated_so_the_test_sees_them(interpreter):
    h, kv, w, mask = inputs(7, 4, 96, torch.float32, "cpu", seed=1)
    gate = (kernel_module.engram_gate(h, kv, w, EPS, GATE_FLOOR) - h).flatten(-1) / kv[:, None, 4 * 96:]
    assert 0.1 < gate.mean() < 0.9 and gate.std() > 0.05


def test_rows_alone_equal_rows_among_others_interpreter(interpreter):
    """Batch invariance (the deterministic mode's need): a token's result does not depend on the tokens beside it."""
    h, kv, w, _ = inputs(9, 4, 80, torch.bfloat16, "cpu", seed=2)
    among = kernel_module.engram_gate(h, kv, w, EPS, GATE_FLOOR)
    for r in (0, 4, 8):
        assert torch.equal(kernel_module.engram_gate(h[r:r + 1], kv[r:r + 1], w, EPS, GATE_FLOOR), among[r:r + 1])


def test_op_takes_the_kernel_only_on_the_fast_backend_where_supported_interpreter(interpreter, monkeypatch):
    """gated_update: on the fast backend the kernel for supported tensors (the kernel's result), the torch ops (the
    reference backend's bits) for a float64 stream, a bf16 gate weight or float64 keys and value; never the kernel on the
    reference backend. The kernel's wrapper refuses what `supported` refuses."""
    calls = []
    real = kernel_module.engram_gate
    monkeypatch.setattr(kernel_module, "engram_gate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    h, kv, w, mask = inputs(4, 4, 48, torch.bfloat16, "cpu", seed=3)
    refused = [(h.double(), kv.double(), w, mask), (h, kv, w.bfloat16(), mask), (h, kv.double(), w, mask)]
    want = [gated_update(h, kv, w, EPS, mask)] + [gated_update(*args[:3], EPS, args[3]) for args in refused]
    assert not calls
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    try:
        got = gated_update(h, kv, w, EPS, mask)
        assert calls == [1]
        assert torch.equal(got, real(h, kv, w, EPS, GATE_FLOOR, mask))
        for args, ref in zip(refused, want[1:]):
            assert not kernel_module.supported(*args)
            with pytest.raises(ValueError, match="engram_gate kernel"):
                real(*args[:3], EPS, GATE_FLOOR, args[3])
            assert torch.equal(gated_update(*args[:3], EPS, args[3]), ref)
        assert calls == [1]
    finally:
        mini.ops.set_backend("reference", interpret_on_cpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 1003])
@pytest.mark.parametrize("dtype,masked", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)])
def test_engram_gate_gpu(T, dtype, masked, poisoned):
    h, kv, w, mask = inputs(T, 4, 5120, dtype, "cuda", seed=T)
    check(h, kv, w, mask if masked else None)


@pytest.mark.gpu
def test_rows_alone_equal_rows_among_others_gpu():
    h, kv, w, _ = inputs(2048, 4, 5120, torch.bfloat16, "cuda", seed=4)
    among = kernel_module.engram_gate(h, kv, w, EPS, GATE_FLOOR)
    for r in (0, 1, 1000, 2047):
        assert torch.equal(kernel_module.engram_gate(h[r:r + 1], kv[r:r + 1], w, EPS, GATE_FLOOR), among[r:r + 1])


@pytest.mark.gpu
def test_op_takes_the_kernel_on_cuda_gpu(monkeypatch):
    """The fast backend's op on CUDA tensors is the kernel, inside a CUDA graph too (a decode step's replay)."""
    calls = []
    real = kernel_module.engram_gate
    monkeypatch.setattr(kernel_module, "engram_gate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    h, kv, w, _ = inputs(1, 4, 5120, torch.bfloat16, "cuda", seed=5)
    with mini.ops.using_backend("fast"):
        eager = gated_update(h, kv, w, EPS)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gated_update(h, kv, w, EPS)
        graph.replay()
    assert len(calls) == 2
    assert torch.equal(eager, real(h, kv, w, EPS, GATE_FLOOR)) and torch.equal(out, eager)
