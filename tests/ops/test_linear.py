import pytest
import torch
import torch.nn.functional as F

from mini.formats import dequant_fp8, dequant_mxfp4, fake_quant_fp8, no_fake_quant, quantize_fp8, quantize_mxfp4
from mini.ops.linear import QWeight, linear


def _fp8_state(out, inp, block, name="proj"):
    q, s = quantize_fp8(torch.randn(out, inp) * 0.05, block)
    return {f"{name}.weight": q, f"{name}.scale": s.view(torch.float8_e8m0fnu)}


def _mxfp4_state(out, inp, name="proj"):
    packed, s = quantize_mxfp4(torch.randn(out, inp) * 0.05)
    return {f"{name}.weight": packed.view(torch.int8), f"{name}.scale": s.view(torch.float8_e8m0fnu)}


def _reference(x, w_dense, block):
    """float64 GEMM of the FP8-fake-quantized activation with the dequantized weight."""
    return fake_quant_fp8(x.float(), block).double() @ w_dense.double().T


def test_from_state_kinds():
    st = {**_fp8_state(40, 64, 32, "a"), **_mxfp4_state(40, 64, "b"), "c.weight": torch.randn(5, 7).bfloat16(),
          "d.weight": torch.randn(5, 7)}
    a, b = QWeight.from_state(st, "a", 32), QWeight.from_state(st, "b", 128)
    c, d = QWeight.from_state(st, "c", 32), QWeight.from_state(st, "d", 32)
    assert (a.kind, b.kind, c.kind, d.kind) == ("fp8", "mxfp4", "bf16", "bf16")
    assert a.scale is st["a.scale"] and b.scale is st["b.scale"] and c.scale is None
    assert (b.out_features, b.in_features, b.block) == (40, 64, 128)
    st2 = {"e.weight": st["a.weight"]}
    with pytest.raises(KeyError):
        QWeight.from_state(st2, "e", 32)
    with pytest.raises(ValueError):
        QWeight("fp8", st["a.weight"], None, 32)


def test_prepare_caches_the_dequantized_weight():
    w = QWeight.from_state(_fp8_state(70, 96, 32), "proj", 32)
    first = w.prepare(torch.float32)
    assert w.prepare(torch.float32) is first
    moved = w.to("cpu")
    assert moved.kind == "fp8" and torch.equal(moved.prepare(), first) and moved.prepare() is not first
    assert torch.equal(first, dequant_fp8(w.data, w.scale, 32))
    assert torch.equal(w.prepare(torch.bfloat16).float(), first)


@pytest.mark.parametrize("block,out,inp", [(32, 70, 96), (128, 131, 256), (32, 33, 1056)])
def test_fp8_linear_fp32_mode(block, out, inp):
    w = QWeight.from_state(_fp8_state(out, inp, block), "proj", block)
    x = torch.randn(2, 9, inp) * 3
    y = linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (2, 9, out)
    want = _reference(x, dequant_fp8(w.data, w.scale, block), block)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # the activation quantization is really applied: an unquantized GEMM differs by more than the tolerance
    plain = x.double() @ dequant_fp8(w.data, w.scale, block).double().T
    assert (plain - want).abs().max() > 100 * (y.double() - want).abs().max()


def test_fp8_linear_bf16_activations():
    w = QWeight.from_state(_fp8_state(96, 160, 32), "proj", 32)
    x = (torch.randn(17, 160) * 2).bfloat16()
    y = linear(x, w)
    assert y.dtype == torch.bfloat16
    want = _reference(x, dequant_fp8(w.data, w.scale, 32), 32)
    # fp32 accumulation, one rounding to bf16: within one bf16 ulp of the exact result
    assert ((y.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-30).all()


@pytest.mark.parametrize("act_block", [32, 128])
def test_mxfp4_linear(act_block):
    w = QWeight.from_state(_mxfp4_state(48, 256), "proj", act_block)
    x = torch.randn(5, 256)
    y = linear(x, w)
    want = _reference(x, dequant_mxfp4(w.data, w.scale), act_block)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_bf16_weight_is_a_plain_linear_in_the_activation_dtype():
    st = {"p.weight": torch.randn(24, 40).bfloat16()}
    w = QWeight.from_state(st, "p", 32)
    xb = torch.randn(3, 40).bfloat16()
    assert torch.equal(linear(xb, w), F.linear(xb, st["p.weight"]))
    xf = torch.randn(3, 40)
    y = linear(xf, w)
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(xf, st["p.weight"].float()))


def test_width_must_be_a_multiple_of_the_activation_block():
    w = QWeight("bf16", torch.randn(4, 4), None, 32)
    assert linear(torch.randn(2, 4), w).shape == (2, 4)
    q, s = quantize_fp8(torch.randn(8, 48), 32)
    with pytest.raises(ValueError):
        linear(torch.randn(2, 48), QWeight("fp8", q, s, 32))


def test_no_fake_quant_switch_gives_the_plain_gemm():
    w = QWeight.from_state(_fp8_state(40, 64, 32), "proj", 32)
    x = torch.randn(3, 64)
    with no_fake_quant():
        y = linear(x, w)
    torch.testing.assert_close(y, x @ w.prepare().T)


@pytest.mark.gpu
def test_fast_path_matches_reference_on_cuda():
    from mini.ops import set_backend, backend
    w = QWeight.from_state(_fp8_state(333, 1280, 32), "proj", 32)
    x = (torch.randn(77, 1280) * 2).bfloat16()
    prev = backend()
    try:
        set_backend("reference")
        ref = linear(x, w)
        set_backend("fast")
        wc = w.to("cuda")
        fast = linear(x.cuda(), wc).cpu()
    finally:
        set_backend(prev)
    assert ((fast.double() - ref.double()).abs() <= ref.double().abs() * 2.0 ** -7 + 1e-3).all()


@pytest.mark.gpu
def test_fast_path_honours_no_fake_quant():
    from mini.ops import set_backend, backend
    w = QWeight.from_state(_fp8_state(64, 96, 32), "proj", 32).to("cuda")
    x = torch.randn(5, 96, device="cuda").bfloat16()
    prev = backend()
    try:
        set_backend("fast")
        with no_fake_quant():
            y = linear(x, w)
    finally:
        set_backend(prev)
    torch.testing.assert_close(y.float(), (x.float() @ w.prepare().T).bfloat16().float(), rtol=1e-2, atol=1e-2)


def test_head_logits_is_the_fp32_linear_off_the_fast_path():
    """The official head, F.linear(x.float(), fp32 weight): a bf16 head is widened (exactly) first; on the CPU the
    model keeps the head in fp32, as before."""
    from mini.ops.linear import head_logits
    x, head = torch.randn(5, 96).bfloat16(), torch.randn(333, 96).bfloat16()
    want = F.linear(x.float(), head.float())
    assert torch.equal(head_logits(x, head), want) and torch.equal(head_logits(x, head.float()), want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [0, 1, 7, 256])
def test_head_logits_fast_path_sums_the_same_exact_products_gpu(rows):
    """On CUDA the bf16 head runs a bf16 tensor-core GEMM with fp32 output: the products x_i * w_i are exact in
    fp32 either way, so against float64 it must be as close as the fp32 GEMM is (summation order only), and its
    output poisoned beforehand never leaks NaN."""
    from mini.ops import backend, set_backend
    from mini.ops.linear import head_logits
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 5120, device="cuda", generator=g).bfloat16()
    head = (torch.randn(4099, 5120, device="cuda", generator=g) * 0.02).bfloat16()
    prev = backend()
    try:
        set_backend("fast")
        fast = head_logits(x, head)
    finally:
        set_backend(prev)
    exact = x.double() @ head.double().T
    fp32 = F.linear(x.float(), head.float())
    assert fast.dtype == torch.float32 and fast.shape == (rows, 4099) and not fast.isnan().any()
    if rows == 0:  # a step without logit rows (at b0f5be4 the view of the empty result failed on the H200)
        return
    tol = 4 * (fp32.double() - exact).abs().max().item() + 1e-6
    assert (fast.double() - exact).abs().max().item() <= tol


@pytest.mark.gpu
def test_model_keeps_a_bf16_head_on_cuda_and_its_logits_match_the_fp32_head_gpu():
    from mini.model import load_model
    from mini.ops import backend, set_backend
    prev = backend()
    try:
        set_backend("fast")
        model, cfg, _ = load_model("tiny-v4.1", device="cuda", dtype=torch.bfloat16)
        assert model.head.dtype == torch.bfloat16
        x = torch.randn(9, cfg.dim, device="cuda").bfloat16()
        from mini.ops.linear import head_logits
        fast = head_logits(x, model.head)
        set_backend("reference")
        ref = head_logits(x, model.head)
    finally:
        set_backend(prev)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
