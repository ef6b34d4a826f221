import dataclasses
import math

import numpy as np
import pytest
import torch

from mini.config import TINY_V41, V41_FLASH
from mini.formats import dequant_fp8, e8m0_to_float, fake_quant_fp8, quantize_fp8
from mini.ops.engram import DEAD, EngramHasher, EngramWeights, engram, engram_layout, hash_multipliers


def _is_prime(n):
    if n < 2:
        return False
    return all(n % d for d in range(2, math.isqrt(n) + 1))


def _prime_walk(cfg):
    """Spec §2.3 step 5 by trial division: one global walk; each n-gram order restarts at vocab - 1."""
    seen, tables = set(), []
    for _ in cfg.engram_layer_ids:
        cols = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            cur = cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                cols.append(cur)
        tables.append(cols)
    return tables


def test_real_config_tables_and_multipliers():
    layout = engram_layout(V41_FLASH)
    assert layout.num_embeddings == (384_006_168, 384_016_682) == V41_FLASH.engram_num_embeddings
    assert layout.primes[0][:2] == (16000057, 16000079) and layout.primes[1][0] == 16000477
    assert [list(p) for p in layout.primes] == _prime_walk(V41_FLASH)
    assert hash_multipliers(V41_FLASH, 1).tolist() == [76632096046245, 4839876093313, 35959672319349,
                                                      73987337458391]
    assert hash_multipliers(V41_FLASH, 14).tolist() == [67716810739261, 51510806800915, 30921347202721,
                                                       82619226485591]


def test_tiny_preset_table_sizes_recomputed():
    walk = _prime_walk(TINY_V41)
    assert TINY_V41.engram_num_embeddings == tuple(sum(p) for p in walk) == engram_layout(TINY_V41).num_embeddings
    layout = engram_layout(TINY_V41)
    for primes, offsets, rows in zip(layout.primes, layout.offsets, layout.num_embeddings):
        assert offsets[0] == 0 and all(o + p == o2 for o, p, o2 in zip(offsets, primes, offsets[1:]))
        assert offsets[-1] + primes[-1] == rows


def test_multipliers_odd_and_overflow_safe():
    for layer in (1, 2, 7):
        m = hash_multipliers(TINY_V41, layer)
        assert m.dtype == np.int64 and (m % 2 == 1).all()
        assert (m.astype(object) * (TINY_V41.engram_compressed_vocab_size - 1) < 2 ** 63).all()
    with pytest.raises(ValueError):
        hash_multipliers(dataclasses.replace(TINY_V41, engram_compressed_vocab_size=0), 1)


def _token_map(cfg, seed=0):
    """A random many-to-one token map covering every compressed id."""
    rng = np.random.default_rng(seed)
    n = cfg.engram_compressed_vocab_size
    return np.concatenate([np.arange(n), rng.integers(0, n, cfg.vocab_size - n)])[rng.permutation(cfg.vocab_size)]


def _python_hash(cfg, token_map, history, pos, layer_index):
    """Spec §2.3 steps 2-4 for one position with Python integers."""
    layout = engram_layout(cfg)
    mult = [int(v) for v in hash_multipliers(cfg, layout.layer_ids[layer_index])]
    pad = int(token_map[cfg.engram_pad_id])
    toks, blocked = [], False
    for s in range(cfg.engram_max_ngram_size):
        src = history[pos - s] if pos >= s else None
        comp = DEAD if src is None or src < 0 else int(token_map[src])
        blocked = blocked or pos < s or comp == DEAD
        toks.append(pad if blocked else comp)
    rolling, out = toks[0] * mult[0], []
    heads = cfg.engram_n_heads
    for n in range(1, cfg.engram_max_ngram_size):
        rolling ^= toks[n] * mult[n]
        for hd in range(heads):
            col = (n - 1) * heads + hd
            out.append(rolling % layout.primes[layer_index][col] + layout.offsets[layer_index][col])
    return out


def test_hasher_matches_python_rederivation_with_dead_tokens():
    cfg = TINY_V41
    tmap = _token_map(cfg)
    rng = np.random.default_rng(1)
    history = rng.integers(0, cfg.vocab_size, 40).tolist()
    history[5] = history[17] = history[18] = -1  # dead (image) tokens block the look-back across them
    got = EngramHasher(cfg, tmap).hash_ids(history, 0, len(history))
    assert got.dtype == torch.int64 and got.shape == (40, 2, cfg.n_hash_cols)
    for pos in range(40):
        for li in range(2):
            assert got[pos, li].tolist() == _python_hash(cfg, tmap, history, pos, li), (pos, li)
    rows = torch.tensor(engram_layout(cfg).num_embeddings)
    assert (got >= 0).all() and (got < rows.view(1, 2, 1)).all()


def test_hasher_chunks_equal_one_pass():
    cfg = TINY_V41
    hasher = EngramHasher(cfg, _token_map(cfg, 3))
    history = np.random.default_rng(2).integers(0, cfg.vocab_size, 23).tolist()
    whole = hasher.hash_ids(history, 0, 23)
    parts = [hasher.hash_ids(history, a, b) for a, b in ((0, 1), (1, 2), (2, 9), (9, 22), (22, 23))]
    assert torch.equal(torch.cat(parts), whole)
    assert hasher.hash_ids(history, 4, 4).shape == (0, 2, cfg.n_hash_cols)
    with pytest.raises(ValueError):
        hasher.hash_ids(history, 20, 24)


def test_hasher_first_position_is_all_pad_lookback():
    cfg = TINY_V41
    tmap = _token_map(cfg, 4)
    hasher = EngramHasher(cfg, tmap)
    # position 0 of any sequence sees [tok, pad, pad, pad]; so does a token right after a dead one
    a = hasher.hash_ids([7, 9], 0, 1)
    b = hasher.hash_ids([3, -1, 7], 2, 3)
    assert torch.equal(a, b)


def _random_tails(rng, n, k, vocab, dead=0.15, top=0.3):
    """[n, k] windows as hash_last takes them: a history of 1..k+2 tokens (dead ones -1), the last k of it,
    left-filled with -1; a share `top` of the tokens drawn from the last 16 ids of the vocabulary."""
    tails = np.full((n, k), -1, dtype=np.int64)
    for b in range(n):
        h = rng.integers(0, vocab, rng.integers(1, k + 3))
        h = np.where(rng.random(len(h)) < top, rng.integers(vocab - 16, vocab, len(h)), h)
        h = np.where(rng.random(len(h)) < dead, -1, h)[-k:]
        tails[b, k - len(h):] = h
    return tails


@pytest.mark.parametrize("cfg", [dataclasses.replace(TINY_V41, engram_max_ngram_size=m) for m in (2, 3, 4, 5)]
                         + [V41_FLASH], ids=["tiny-n2", "tiny-n3", "tiny-n4", "tiny-n5", "v4.1-flash"])
def test_device_hash_last_equals_numpy(cfg):
    """Every n-gram order (all hash columns), dead tokens, windows of short sequences (-1 fill), the largest token
    ids; V4.1-Flash's compressed vocabulary and multipliers make products close to 2^63."""
    tmap = _token_map(cfg, 5)
    tmap[-16:] = cfg.engram_compressed_vocab_size - 1 - np.arange(16)  # large ids -> the largest compressed ids
    hasher = EngramHasher(cfg, tmap)
    tails = _random_tails(np.random.default_rng(6), 400, hasher.lookback, cfg.vocab_size)
    assert (tails == -1).any() and (tails >= cfg.vocab_size - 16).any() and (tails[:, -1] == -1).any()
    want = hasher.hash_last(tails)
    got = hasher.on_device("cpu").hash_last(torch.from_numpy(tails))
    assert got.dtype == torch.int64 and torch.equal(got, want)
    # the window of a 1-token sequence and of a token right after a dead one: the token then pad only
    lone = torch.tensor([[-1] * (hasher.lookback - 1) + [7], [3] * (hasher.lookback - 2) + [-1, 7]])
    assert torch.equal(hasher.on_device("cpu").hash_last(lone), hasher.hash_ids([7], 0, 1).expand(2, -1, -1))


def test_device_hash_wraps_int64_products_like_numpy():
    """Multipliers past the overflow bound: numpy and torch both wrap the products modulo 2^64, and both take the
    floor modulo of the (then negative) XOR: still bit-equal (the real multipliers never overflow)."""
    cfg = TINY_V41
    hasher = EngramHasher(cfg, _token_map(cfg, 7))
    rng = np.random.default_rng(8)
    hasher.multipliers = rng.integers(2 ** 61, 2 ** 63 - 1, hasher.multipliers.shape, dtype=np.int64) | 1
    tails = _random_tails(rng, 200, hasher.lookback, cfg.vocab_size)
    want = hasher.hash_last(tails)
    big = hasher.token_map[np.maximum(tails, 0)][:, None, :] * hasher.multipliers[None]
    assert (big < 0).any()  # some products did wrap
    assert torch.equal(hasher.on_device("cpu").hash_last(torch.from_numpy(tails)), want)


def test_hasher_rejects_a_map_of_the_wrong_size():
    with pytest.raises(ValueError):
        EngramHasher(TINY_V41, np.arange(TINY_V41.vocab_size) % 10)


# ------------------------------------------------------------------------------------------------ the module
def _engram_state(cfg, prefix, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = engram_layout(cfg).num_embeddings[0]
    hd, dim, hc = cfg.engram_head_dim, cfg.dim, cfg.hc_mult
    table = (torch.randn(rows, hd, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.randint(118, 124, (rows, hd // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    wq, ws = quantize_fp8(torch.randn((hc + 1) * dim, cfg.n_hash_cols * hd, generator=g) * 0.02, cfg.fp8_block)
    return {f"{prefix}engram.embed.weight": table, f"{prefix}engram.embed.scale": scale.view(torch.float8_e8m0fnu),
            f"{prefix}engram.wkv.weight": wq, f"{prefix}engram.wkv.scale": ws.view(torch.float8_e8m0fnu),
            f"{prefix}engram.q_weight": (torch.rand(hc, dim, generator=g) + 0.5).bfloat16(),
            f"{prefix}engram.k_weight": torch.randn(hc, dim, generator=g).bfloat16()}


def _float64_engram(h, ids, st, p, cfg):
    hc, dim = cfg.hc_mult, cfg.dim
    table = st[p + "embed.weight"][ids].double()
    scale = torch.pow(2.0, st[p + "embed.scale"].view(torch.uint8)[ids].double() - 127)
    rows = (table.unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2).flatten(-2)
    w = dequant_fp8(st[p + "wkv.weight"], st[p + "wkv.scale"], cfg.fp8_block).double()
    kv = (fake_quant_fp8(rows.to(h.dtype), cfg.fp8_block).double() @ w.T).to(h.dtype).double()
    key, value = kv[:, :hc * dim].unflatten(-1, (hc, dim)), kv[:, hc * dim:]
    hd = h.double()
    gw = st[p + "q_weight"].double() * st[p + "k_weight"].double()
    dot = (hd * gw * key).sum(-1) / torch.sqrt(hd.square().mean(-1) + cfg.norm_eps) \
        / torch.sqrt(key.square().mean(-1) + cfg.norm_eps) / math.sqrt(dim)
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())
    return hd + gate.unsqueeze(-1) * value.unsqueeze(1), gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_form", ["layers.1.", "layers.1.engram", "layers.1.engram."])
def test_engram_matches_float64_rederivation(dtype, prefix_form):
    cfg = TINY_V41
    st = _engram_state(cfg, "layers.1.")
    w = EngramWeights.from_state(st, prefix_form, cfg)
    hasher = EngramHasher(cfg, _token_map(cfg))
    history = np.random.default_rng(5).integers(0, cfg.vocab_size, 13).tolist()
    ids = hasher.hash_ids(history, 0, 13)[:, 0]
    h = (torch.randn(13, cfg.hc_mult, cfg.dim) * torch.tensor([1.0, 0.1, 10.0, 3.0]).view(1, -1, 1)).to(dtype)
    out = engram(h, ids, w, cfg)
    assert out.dtype == dtype and out.shape == h.shape
    want, gate = _float64_engram(h, ids, st, "layers.1.engram.", cfg)
    assert 0.05 < gate.mean() < 0.95  # the gates are not saturated: the test sees their values
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=tol, atol=tol)


def test_lookup_decodes_every_scale_byte():
    """The lookup's E8M0 scales (a per-device table of the 256 byte values) == e8m0_to_float, NaN byte included."""
    cfg = TINY_V41
    st = _engram_state(cfg, "layers.1.", seed=4)
    st["layers.1.engram.embed.scale"].view(torch.uint8)[:256] = torch.arange(256, dtype=torch.int32)[:, None]
    w = EngramWeights.from_state(st, "layers.1.", cfg)
    ids = torch.arange(256).flip(0).view(16, 16)
    vals = st["layers.1.engram.embed.weight"][ids].float()
    scale = e8m0_to_float(st["layers.1.engram.embed.scale"][ids])
    want = (vals.unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2)
    torch.testing.assert_close(w.lookup(ids, torch.float32, "cpu"), want, equal_nan=True, rtol=0, atol=0)


def test_engram_gate_is_per_copy_and_mask_closes_it():
    cfg = TINY_V41
    st = _engram_state(cfg, "layers.1.", seed=3)
    w = EngramWeights.from_state(st, "layers.1.", cfg)
    ids = torch.randint(0, engram_layout(cfg).primes[0][0], (5, cfg.n_hash_cols))
    h = torch.randn(5, cfg.hc_mult, cfg.dim)
    base = engram(h, ids, w, cfg)
    h2 = h.clone()
    h2[:, 2] *= 1000  # normalisation is per (token, copy): other copies' updates are unchanged
    out2 = engram(h2, ids, w, cfg)
    torch.testing.assert_close(out2[:, [0, 1, 3]], base[:, [0, 1, 3]])
    # the gate is scale invariant and the value shared: the same update (up to fp32 cancellation at 1000x)
    torch.testing.assert_close(out2[:, 2] - h2[:, 2], base[:, 2] - h[:, 2], rtol=0, atol=1e-3)
    mask = torch.tensor([True, False, True, False, True])
    masked = engram(h, ids, w, cfg, token_mask=mask)
    assert torch.equal(masked[~mask], h[~mask]) and torch.equal(masked[mask], base[mask])


@pytest.mark.gpu
def test_device_hash_and_lookup_in_a_cuda_graph_equal_the_host():
    """The device hash and table lookup, captured in a CUDA graph and replayed on new windows, == numpy hash_last
    and the host lookup (bit for bit)."""
    cfg = TINY_V41
    hasher = EngramHasher(cfg, _token_map(cfg, 9))
    dev_hasher = hasher.on_device("cuda")
    st = _engram_state(cfg, "layers.1.", seed=5)
    host_w = EngramWeights.from_state(st, "layers.1.", cfg)
    dev_w = EngramWeights.from_state({k: v.cuda() for k, v in st.items()}, "layers.1.", cfg)
    rng = np.random.default_rng(10)
    window = torch.from_numpy(_random_tails(rng, 37, hasher.lookback, cfg.vocab_size)).cuda()

    def step():
        return dev_w.lookup(dev_hasher.hash_last(window)[:, 0], torch.bfloat16, "cuda")

    step()  # warm-up outside the capture (the E8M0 value table is made here)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = step()
    for _ in range(3):
        tails = _random_tails(rng, 37, hasher.lookback, cfg.vocab_size)
        window.copy_(torch.from_numpy(tails))
        graph.replay()
        ids = hasher.hash_last(tails)
        assert torch.equal(dev_hasher.hash_last(window).cpu(), ids)
        assert torch.equal(rows.cpu(), host_w.lookup(ids[:, 0], torch.bfloat16, "cpu"))
