"""RoPE: interleaved pairs on the last dims, per-layer base and YaRN (spec §2.4.2), inverse rotation."""
import math

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
