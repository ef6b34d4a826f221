"""One EP rank emulated on one device (mini/testing/emulated_ep.py) and its random rank model's host Engram tables
(mini/testing/rank_model.py), on the tiny model on the CPU."""
import pytest
import torch

from mini.checkpoint import random_state
from mini.config import preset
from mini.ops.moe import MoEWeights, moe
from mini.testing.emulated_ep import SKEW, EmulatedEP
from mini.testing.rank_model import host_engram_tables


@pytest.fixture(scope="module")
def tiny_moe():
    cfg = preset("tiny-v4.1")
    return cfg, MoEWeights.from_state(random_state(cfg, seed=4), "layers.3.ffn", cfg, 3)


def test_emulated_ep_of_one_rank_is_the_plain_moe(tiny_moe):
    cfg, w = tiny_moe
    x, ids = torch.randn(9, cfg.dim), torch.randint(0, cfg.vocab_size, (9,))
    assert torch.equal(EmulatedEP(1, 0)(x, w, cfg, cfg.layers[3], ids), moe(x, w, cfg, cfg.layers[3], ids))


def test_emulated_ep_routes_synthetic_remote_rows_but_returns_own(tiny_moe):
    cfg, w = tiny_moe
    ep = EmulatedEP(4, 0)
    rows = ep.rows_seen(9, "cpu")  # the own rows, then three orders of them
    assert rows.shape == (36,) and rows[:9].tolist() == list(range(9))
    assert all(sorted(rows[i * 9:(i + 1) * 9].tolist()) == list(range(9)) for i in range(1, 4))
    assert not torch.equal(rows[9:18], rows[:9])
    x, ids = torch.randn(9, cfg.dim), torch.randint(0, cfg.vocab_size, (9,))
    # all experts are local here, so the own rows must equal the single-rank result (rows are independent)
    torch.testing.assert_close(ep(x, w, cfg, cfg.layers[3], ids), moe(x, w, cfg, cfg.layers[3], ids),
                               rtol=1e-5, atol=1e-6)


def test_skewed_routing_has_the_documented_load_shape():
    """RoutingSkew at rank4's shape (V4.1-Flash: 384 experts, k 6, 4 x 4,096 rows, this rank holding 0..95): hot
    experts at ~2.5 x the mean, the busiest at 2.4-3.0 x, this rank ~1.07 x its even share (docstring figures)."""
    local, E = range(96), 384
    for layer in (0, 17, 39):
        ids = SKEW.draw(16384, 6, E, local, 4, 0, layer)
        assert ids.shape == (16384, 6)
        assert all(len(set(r)) == 6 for r in ids[:512].tolist())  # k distinct experts per row
        c = torch.bincount(ids.flatten(), minlength=E).double()
        p = SKEW.probabilities(E, local, 4, 0, layer)
        hot = p > p.min()
        assert int(hot.sum()) == 48 and int(hot[:96].sum()) == 16
        assert p.sum().item() == pytest.approx(1.0) and (p.max() / p.mean()).item() == pytest.approx(2.5)
        assert 2.4 <= (c.max() / c.mean()).item() <= 3.0
        assert 2.3 <= (c[hot].mean() / c.mean()).item() <= 2.6
        assert 1.04 <= (c[:96].sum() / c.sum() * 4).item() <= 1.10
    # fixed: the same draw every time; the hot set moves between layers
    assert torch.equal(SKEW.draw(64, 6, E, local, 4, 0, 3), SKEW.draw(64, 6, E, local, 4, 0, 3))
    assert not torch.equal(SKEW.probabilities(E, local, 4, 0, 0), SKEW.probabilities(E, local, 4, 0, 1))


def test_uniform_routing_is_the_gate_over_all_rows_as_before(tiny_moe):
    """The gate now runs over the own rows only and the remote rows take their copies' routing: the same ids and
    weights as gating all rows (what rank4 did before), so the same pairs per expert, and the same output."""
    from mini.ops.moe import gate, routed, shared
    cfg, w = tiny_moe
    plan = cfg.layers[3]
    g = torch.Generator().manual_seed(5)
    x, ids = torch.randn(13, cfg.dim, generator=g), torch.randint(0, cfg.vocab_size, (13,), generator=g)
    ep = EmulatedEP(4, 0)
    rows = ep.rows_seen(13, "cpu")[13:]  # the remote rows
    x_old, ids_old = torch.cat([x, x[rows]]), torch.cat([ids, ids[rows]])
    weights_before, ids_before = gate(x_old, w, cfg, plan, ids_old)
    x_all, weights_now, ids_now = ep.route(x, w, cfg, plan, ids)
    assert torch.equal(x_all, x_old) and torch.equal(ids_now, ids_before)
    torch.testing.assert_close(weights_now, weights_before, rtol=1e-6, atol=0)
    ep.recording = True
    out = ep(x, w, cfg, plan, ids)
    assert ep.pairs[3].tolist() == torch.bincount(ids_before.flatten(), minlength=cfg.n_routed_experts).tolist()
    before = (routed(x_old, w, cfg, weights_before, ids_before)[:13] + shared(x, w)).to(x.dtype)
    torch.testing.assert_close(out, before, rtol=1e-6, atol=1e-7)


def test_skewed_routing_replaces_the_gates_ids_only(tiny_moe):
    cfg, w = tiny_moe
    x, ids = torch.randn(9, cfg.dim), torch.randint(0, cfg.vocab_size, (9,))
    uni, skew = EmulatedEP(4, 0), EmulatedEP(4, 0, "skewed", range(0, 4))
    xu, wu, _ = uni.route(x, w, cfg, cfg.layers[3], ids)
    xs, ws, ids_s = skew.route(x, w, cfg, cfg.layers[3], ids)
    assert torch.equal(xu, xs) and torch.equal(wu, ws)
    assert torch.equal(ids_s, SKEW.draw(36, cfg.n_activated_experts, cfg.n_routed_experts, range(0, 4), 4,
                                                0, 3))
    with pytest.raises(ValueError, match="routing 'zipf'"):
        EmulatedEP(4, 0, "zipf")


def test_host_engram_tables_are_drawn_like_random_state():
    """Real row layout (fp8 values, one E8M0 scale per 32), values as random_state draws Engram rows: finite, each
    32-group's largest |value| fills the fp8 range (power-of-two scale), the dequantized rows ~ standard normal."""
    from mini.ops.engram import dequantize_rows
    cfg = preset("tiny-v4.1")
    tables, info = host_engram_tables(cfg, 3000, 0, "cpu")
    assert len(tables) == len(cfg.engram_layer_ids) and info["pinned"] is False  # no CUDA here
    for vals, scales in tables:
        assert vals.dtype == torch.float8_e4m3fn and vals.shape == (3000, cfg.engram_head_dim)
        assert scales.shape == (3000, cfg.engram_head_dim // 32)
        rows = dequantize_rows(vals.view(torch.uint8), scales.view(torch.uint8), torch.float32)
        assert torch.isfinite(rows).all() and abs(rows.std().item() - 1) < 0.05 and abs(rows.mean().item()) < 0.05
        top = vals.float().abs().unflatten(-1, (-1, 32)).amax(-1)
        assert (top >= 224).all() and (top <= 448).all()  # 448 / 2 < max |x| / scale <= 448, then rounded
    v2, _ = host_engram_tables(cfg, 3000, 0, "cpu")[0][0]
    assert torch.equal(v2.view(torch.uint8), tables[0][0].view(torch.uint8))  # fixed by the seed
