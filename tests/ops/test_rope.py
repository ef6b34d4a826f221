"""RoPE: interleaved pairs on the last dims, per-layer base and YaRN (spec §2.4.2), inverse rotation."""
import math

import pytest
import torch

from mini.config import preset
from mini.ops.rope import apply_rope, layer_frequencies, rope_frequencies, rope_table, yarn_bounds


def test_yarn_bounds_for_the_compressed_layers_base():
    assert yarn_bounds(64, 160000.0, 65536, 32, 1) == (15, 25)


def test_yarn_keeps_high_frequencies_and_divides_low_ones_by_the_factor():
    plain = rope_frequencies(64, 160000.0)
    yarn = rope_frequencies(64, 160000.0, 65536, 16.0, 32, 1)
    assert torch.equal(yarn[:16], plain[:16])  # pairs up to lo = 15: ramp 0
    torch.testing.assert_close(yarn[25:], plain[25:] / 16, rtol=1e-6, atol=0)  # from hi = 25: fully scaled
    i = 20  # halfway up the ramp: (20 - 15) / (25 - 15)
    torch.testing.assert_close(yarn[i], plain[i] / 16 * 0.5 + plain[i] * 0.5)
    assert torch.equal(plain, 1.0 / 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))


def test_layer_frequencies_follow_the_plan():
    cfg = preset("v4.1-flash")
    window_only, compressed = cfg.layers[0], cfg.layers[2]
    assert torch.equal(layer_frequencies(cfg, window_only), rope_frequencies(64, 10000.0))
    assert torch.equal(layer_frequencies(cfg, compressed), rope_frequencies(64, 160000.0, 65536, 16.0, 32, 1))


def test_rotation_is_interleaved_on_the_last_dims_and_inverse_undoes_it():
    g = torch.Generator().manual_seed(0)
    T, H, D, rd = 5, 3, 20, 8
    x = torch.randn(T, H, D, generator=g)
    pos = torch.tensor([0, 1, 7, 300, 65537])
    freqs = rope_frequencies(rd, 10000.0)
    y = apply_rope(x, rope_table(pos, freqs))
    assert torch.equal(y[..., : D - rd], x[..., : D - rd])  # nope dims untouched
    # independent formula: pair (x[2i], x[2i+1]) rotated by angle pos * f_i (an fp32 product, as the reference's
    # table; at large positions its rounding matters)
    ang = (pos[:, None].float() * freqs[None]).double()  # [T, rd/2]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., D - rd::2].double(), x[..., D - rd + 1::2].double()
    torch.testing.assert_close(y[..., D - rd::2].double(), a * c - b * s, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(y[..., D - rd + 1::2].double(), a * s + b * c, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rope(y, rope_table(pos, freqs), inverse=True), x, atol=1e-5, rtol=1e-5)


def test_scores_depend_on_relative_position_only():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 16, generator=g), torch.randn(1, 16, generator=g)
    freqs = rope_frequencies(16, 160000.0, 256, 4.0, 32, 1)

    def score(pq, pk):
        rq = apply_rope(q, rope_table(torch.tensor([pq]), freqs))
        rk = apply_rope(k, rope_table(torch.tensor([pk]), freqs))
        return (rq * rk).sum().item()

    assert math.isclose(score(10, 3), score(110, 103), rel_tol=1e-4)
    assert not math.isclose(score(10, 3), score(10, 4), rel_tol=1e-4)


def test_bf16_input_stays_bf16():
    x = torch.randn(4, 64).to(torch.bfloat16)
    y = apply_rope(x, rope_table(torch.arange(4), rope_frequencies(16, 10000.0)))
    assert y.dtype == torch.bfloat16 and torch.equal(y[:, :48], x[:, :48])


def _chain(x, table, w, quant, block):
    """The unfused producer chain norm_rope_quant stands for."""
    from mini.formats import fake_quant_fp4, fake_quant_fp8
    from mini.ops.norm import rms_norm
    y = apply_rope(rms_norm(x, w, 1e-20) if w is not None else x, table)
    if quant == "fp8":
        return fake_quant_fp8(y, block)
    if quant is not None:
        return fake_quant_fp4(y, block, quant.split("_")[1])
    return y


@pytest.mark.parametrize("shape,norm,quant,block", [((13, 96), True, "fp8", 32), ((13, 3, 64), False, "fp4_ue8m0", 32),
                                                    ((13, 96), False, "fp4_e4m3", 16), ((13, 96), True, None, 32)])
def test_norm_rope_quant_is_the_chain(shape, norm, quant, block):
    from mini.ops.rope import norm_rope_quant
    x = torch.randn(shape) * 3
    table = rope_table(torch.randint(0, 9000, (shape[0],)), rope_frequencies(32, 160000.0, 256, 4.0))
    w = torch.rand(shape[-1]) + 0.5 if norm else None
    assert torch.equal(norm_rope_quant(x, table, w, 1e-20, quant, block), _chain(x, table, w, quant, block))
    with pytest.raises(ValueError):
        norm_rope_quant(x, table, quant="fp8_e5m2")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,norm,quant,block", [((1001, 512), True, "fp8", 32), ((999, 512), False, "fp4_e4m3", 16),
                                                    ((1001, 32, 128), False, "fp4_ue8m0", 32),
                                                    ((999, 128), True, "fp4_ue8m0", 32)])
def test_norm_rope_quant_fast_path_gpu(shape, norm, quant, block):
    """The fused kernel the op dispatches to on CUDA vs the chain: equal up to rare one-step quant flips where the
    kernel's fp32 rotation rounds the other way."""
    import mini.ops
    from mini.ops.rope import norm_rope_quant
    x = (torch.randn(shape, device="cuda") * 3).bfloat16()
    freqs = rope_frequencies(64, 160000.0, 65536, 16.0)
    table = rope_table(torch.randint(0, 100000, (shape[0],), device="cuda"), freqs)
    w = (torch.rand(shape[-1], device="cuda") + 0.5).bfloat16() if norm else None
    prev = mini.ops.backend()
    try:
        mini.ops.set_backend("fast")
        got = norm_rope_quant(x, table, w, 1e-20, quant, block)
        mini.ops.set_backend("reference")
        ref = norm_rope_quant(x, table, w, 1e-20, quant, block)
    finally:
        mini.ops.set_backend(prev)
    assert (got != ref).float().mean() < 2e-3
