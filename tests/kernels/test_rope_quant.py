"""Parity of the fused (RMSNorm) + RoPE + fake-quant kernel with mini.ops.norm.rms_norm, mini.ops.rope.apply_rope
and mini.formats' fake quantization. Fresh random data, odd row counts, NaN-poisoned outputs; a zero-angle table
(exact identity rotation) checks the in-kernel quantizers bit for bit, including ties and subnormals."""
import pytest
import torch

from mini.formats import fake_quant_fp4, fake_quant_fp8
from mini.ops.norm import rms_norm
from mini.ops.rope import apply_rope, rope_frequencies, rope_table

pytestmark = pytest.mark.usefixtures("reference_ops")

QUANTS = {None: lambda x: x, "fp8": lambda x: fake_quant_fp8(x, 32),
          "fp4_ue8m0": lambda x: fake_quant_fp4(x, 32, "ue8m0"), "fp4_e4m3": lambda x: fake_quant_fp4(x, 16, "e4m3")}


def reference(x, table, inverse, w, quant):
    y = rms_norm(x, w, 1e-20) if w is not None else x
    return QUANTS[quant](apply_rope(y, table, inverse))


def run(x, table, inverse, w, quant, **kw):
    from mini.kernels.rope_quant import rope_quant
    out = torch.full_like(x, float("nan"))
    out.copy_(rope_quant(x, table, inverse, w, 1e-20, quant, 16 if quant == "fp4_e4m3" else 32, **kw))
    assert not out.isnan().any()
    return out


def tie_values(n, d):
    """Scaled values on and around E2M1 / e4m3 rounding ties, subnormal e4m3 magnitudes and zeros."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, 1e-3, 3e-3, 17.0, 31.0, 240.0, 0.0123])
    v = ties[torch.randint(len(ties), (n, d))] * torch.where(torch.rand(n, d) < 0.5, -1.0, 1.0)
    return v * 2.0 ** torch.randint(-3, 4, (n, 1)).float()


@pytest.mark.parametrize("quant", list(QUANTS))
def test_quantizers_exact_interpreter(quant, interpreter):
    x = tie_values(37, 128)
    table = rope_table(torch.zeros(37, dtype=torch.long), rope_frequencies(64, 10000.0))
    assert torch.equal(run(x, table, False, None, quant), QUANTS[quant](x))


@pytest.mark.parametrize("heads,d,inverse,norm,quant", [(1, 96, False, True, "fp8"), (3, 96, True, False, None),
                                                      (3, 96, False, False, "fp4_ue8m0"),
                                                      (1, 96, False, True, "fp4_e4m3"),
                                                      (4, 32, False, False, None)])  # V4 tiny index: all dims rotate
def test_rope_quant_interpreter(heads, d, inverse, norm, quant, interpreter):
    n = 11
    x = torch.randn(n, heads, d) if heads > 1 else torch.randn(n, d)
    table = rope_table(torch.randint(0, 5000, (n,)), rope_frequencies(32, 160000.0, 256, 4.0))
    w = torch.rand(d) + 0.5 if norm else None
    got, ref = run(x, table, inverse, w, quant, block_r=4), reference(x, table, inverse, w, quant)
    if quant is None:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:  # fp32 rotation in another order can move a value across a quantization boundary, rarely
        assert (got != ref).float().mean() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("heads,d,inverse,norm,quant", [
    (1, 512, False, True, "fp8"), (64, 512, True, False, None), (64, 512, False, False, None),
    (32, 128, False, False, "fp4_ue8m0"), (1, 128, False, True, "fp4_ue8m0"), (1, 512, False, False, "fp4_e4m3")])
def test_rope_quant_gpu(heads, d, inverse, norm, quant):
    n = 1001
    x = (torch.randn(n, heads, d, device="cuda") if heads > 1 else torch.randn(n, d, device="cuda")).bfloat16()
    table = rope_table(torch.randint(0, 100000, (n,), device="cuda"), rope_frequencies(64, 160000.0, 65536, 16.0))
    w = (torch.rand(d, device="cuda") + 0.5).bfloat16() if norm else None
    got, ref = run(x, table, inverse, w, quant), reference(x, table, inverse, w, quant)
    assert (got != ref).float().mean() < 2e-3
    # where they differ, by one grid step: at most half the value (FP4 4s vs 6s) or half a scale near zero
    amax = ref.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - ref.float()).abs() <= 0.5 * ref.float().abs() + amax / 10).all()
    xq = tie_values(n, d).cuda().bfloat16()
    zero = rope_table(torch.zeros(n, dtype=torch.long, device="cuda"), rope_frequencies(64, 10000.0))
    assert torch.equal(run(xq, zero, False, None, quant), QUANTS[quant](xq))


@pytest.mark.parametrize("heads,norm,quant", [(1, True, "fp8"), (3, False, None), (3, False, "fp4_ue8m0")])
def test_strided_rows_are_read_in_place_interpreter(heads, norm, quant, interpreter, poisoned):
    """A column slice of a stacked projection's output (rows strided, last dim contiguous) gives the same bits as
    its contiguous copy, into a contiguous output."""
    n, d = 9, 96
    wide = torch.randn(n, heads * d + 40)
    x = wide[:, 40:] if heads == 1 else wide[:, 40:].view(n, heads, d)
    assert not x.is_contiguous()
    table = rope_table(torch.randint(0, 5000, (n,)), rope_frequencies(32, 160000.0, 256, 4.0))
    w = torch.rand(d) + 0.5 if norm else None
    got = run(x, table, False, w, quant, block_r=4)
    assert got.is_contiguous() and torch.equal(got, run(x.contiguous(), table, False, w, quant, block_r=4))
