"""The Humming adapter (mini/kernels/humming_experts.py): the in-place layout rewrite undone exactly, the grouped GEMM
bit for bit on data whose fp32 sums are exact (the routed experts through mini.ops.moe: tests/ops/test_moe.py).
The library runs on SM90 only: on a GPU machine without it the GPU tests say so and skip. Sizes keep the number of
kernels to compile small (~17 s each on a fresh machine): N = K, few experts. On CPU, the adapter's own logic
(learning and undoing the layout's moves) runs against a stand-in transform."""
import pytest
import torch

from mini.formats import dequant_mxfp4


@pytest.fixture(scope="module")
def hx():
    from mini.kernels import humming_experts
    if not humming_experts.available():
        pytest.skip("humming-kernels is not importable on an SM90 GPU here (install the wheel, see docs/kernels.md)")
    return humming_experts


def _experts(E, N, K, scale_lo, scale_hi):
    data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda")
    scale = torch.randint(scale_lo, scale_hi + 1, (E, N, K // 32), dtype=torch.uint8, device="cuda")
    return data, scale


def test_moves_are_learned_applied_and_undone_with_a_stand_in_transform(monkeypatch):
    """A stand-in for Humming's transform (fixed random permutations of codes and scale bytes): `convert` must
    give what it gives, in place, `unpack` must recover every expert, and a transform that is not a permutation
    is refused."""
    from mini.kernels import humming_experts as hx
    N, K, E = 64, 128, 6  # E > CHUNK: more than one chunk
    perm_c, perm_s = torch.randperm(N * K), torch.randperm(N * K // 32)

    def stand_in(data, scale):
        m = data.numel() // (N * K // 2)
        codes = hx._nibbles(data.reshape(m, -1))[:, perm_c]
        return hx._pack(codes).reshape(-1), scale.reshape(m, -1)[:, perm_s].reshape(-1)
    monkeypatch.setattr(hx, "_transform", stand_in)
    monkeypatch.setattr(hx, "_layer_config", lambda n, k, e: None)
    hx._moves.cache_clear()
    data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8)
    scale = torch.randint(0, 256, (E, N, K // 32), dtype=torch.uint8)
    data0, scale0, ptr = data.clone(), scale.clone(), data.data_ptr()
    stack = hx.convert(data, scale)
    want_w, want_s = stand_in(data0, scale0)
    assert stack.weight.data_ptr() == ptr and stack.weight.shape == (E, K // 16, 2 * N)
    assert torch.equal(data.reshape(-1), want_w) and torch.equal(scale.reshape(-1), want_s)
    for e in range(E):
        d, s = hx.unpack(stack, e)
        assert torch.equal(d, data0[e]) and torch.equal(s, scale0[e])
    monkeypatch.setattr(hx, "_transform", lambda d, s: (d.reshape(-1) & 0x0F, s.reshape(-1)))  # drops codes
    hx._moves.cache_clear()
    with pytest.raises(RuntimeError, match="does not permute"):
        hx.unpack(stack, 0)
    hx._moves.cache_clear()


@pytest.mark.gpu
def test_convert_rewrites_in_place_and_unpack_undoes_it(hx):
    data, scale = _experts(3, 192, 256, 100, 140)
    data0, scale0 = data.clone(), scale.clone()
    ptr = data.data_ptr(), scale.data_ptr()
    stack = hx.convert(data, scale)
    assert (stack.weight.data_ptr(), stack.scale.data_ptr()) == ptr, "the rewrite must stay in the same buffers"
    assert not torch.equal(data, data0), "the layout changed"
    for e in range(3):
        d, s = hx.unpack(stack, e)
        assert torch.equal(d, data0[e]) and torch.equal(s, scale0[e])


@pytest.mark.gpu
def test_grouped_gemm_is_exact_on_exact_data(hx):
    """Activations j/8 and scales 2^0..2^1 keep every fp32 sum exact: the GEMM must equal the dequantized product
    bit for bit, per expert, on the rows expert_offset gives it; later rows stay unwritten (NaN)."""
    E, N, K = 4, 256, 256
    data, scale = _experts(E, N, K, 127, 128)
    W = dequant_mxfp4(data, scale).double()  # [E, N, K], before the in-place rewrite
    stack = hx.convert(data, scale)
    counts = torch.tensor([5, 0, 130, 1], device="cuda")
    offset = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
    R = int(counts.sum()) + 7
    a = (torch.randint(-16, 17, (R, K), device="cuda") / 8).bfloat16()
    out = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    hx.grouped_gemm(a, stack, offset, int(counts.sum()), out=out)
    for e in range(E):
        lo, hi = int(offset[e]), int(offset[e + 1])
        assert torch.equal(out[lo:hi], (a[lo:hi].double() @ W[e].t()).bfloat16()), f"expert {e}"
    assert out[int(offset[-1]):].isnan().all()



@pytest.mark.gpu
def test_grouped_gemm_decodes_all_codes_and_scales(hx):
    """Every E2M1 code under every E8M0 scale byte (mxfp4_probe.py) through Humming's GEMM with one-hot activations
    into a NaN-poisoned output: bit for bit as the CPU decoder gives it for the bytes the adapter lets through
    (hx.SCALE_BYTES); what the library makes of the others is printed (the adapter keeps them on our kernels)."""
    from mxfp4_probe import N_ROWS, expected, mismatches, probe_weights
    K = 128
    codes, scales = probe_weights(K)
    want = expected(codes, scales)  # [K, N]
    data, scale = codes[None].cuda().contiguous(), scales[None].cuda().contiguous()
    stack = hx.convert(data, scale)
    offset = torch.tensor([0, K], dtype=torch.int32, device="cuda")
    out = torch.full((K + 5, N_ROWS), float("nan"), dtype=torch.bfloat16, device="cuda")
    a = torch.zeros(K + 5, K, device="cuda", dtype=torch.bfloat16)
    a[:K] = torch.eye(K)
    hx.grouped_gemm(a, stack, offset, K, out=out)
    assert out[K:].isnan().all(), "rows past expert_offset[-1] must stay unwritten"
    got = out[:K].cpu()
    # a column is covered when all its blocks' scale bytes are in SCALE_BYTES
    inside = torch.tensor([all(int(b) in hx.SCALE_BYTES for b in row) for row in scales])
    n_bad, first = mismatches(got[:, inside], want[:, inside], codes[inside], scales[inside])
    n_out, first_out = mismatches(got[:, ~inside], want[:, ~inside], codes[~inside], scales[~inside])
    print(f"outside SCALE_BYTES: {n_out} of {int((~inside).sum()) * K} outputs differ: {first_out}")
    assert n_bad == 0, f"{n_bad} outputs differ: {first}"


def test_scales_supported_refuses_bytes_outside():
    """Experts whose scale bytes leave SCALE_BYTES do not go to the library (humming_ready is False)."""
    from mini.kernels import humming_experts as hx
    ok = torch.full((2, 4, 3), 127, dtype=torch.uint8)
    assert hx.scales_supported(ok, ok.view(torch.float8_e8m0fnu))
    for byte in (0, 255):
        if byte not in hx.SCALE_BYTES:
            bad = ok.clone()
            bad[1, 2, 0] = byte
            assert not hx.scales_supported(ok, bad)


def test_decode_tiles_change_only_the_config_they_were_measured_against(monkeypatch):
    """DECODE_TILES: at its (N, K, bucket[, experts]) the heuristic's config takes the measured change, outside the
    deterministic mode, with `tuned`, and only where the heuristic gave the config it was measured against (a
    library update that picks another config keeps its own). Stand-in library modules (the real ones need a GPU)."""
    import json
    import sys
    import types
    from collections import namedtuple

    from mini.kernels import humming_experts as hx
    base = {"block_shape": (8, 128, 64), "warp_shape": (8, 64, 32), "mma_type": "mma", "use_stream_k": True,
            "num_stages": 4}
    heuristic = {"config": dict(base)}
    tune = types.SimpleNamespace(get_heuristics_config=lambda config, **kw: dict(heuristic["config"]))
    config_mod = types.SimpleNamespace(GemmType=types.SimpleNamespace(GROUPED_CONTIGUOUS="grouped_contiguous"))
    monkeypatch.setitem(sys.modules, "humming", types.ModuleType("humming"))
    monkeypatch.setitem(sys.modules, "humming.tune", tune)
    monkeypatch.setitem(sys.modules, "humming.config", config_mod)
    Layer = namedtuple("Layer", "shape_n shape_k num_experts")
    hx._tuning.cache_clear()
    try:
        w13, w2 = Layer(4608, 5120, 48), Layer(5120, 2304, 48)
        got = json.loads(hx._tuning(w13, 16))
        assert got["block_shape"] == [8, 64, 64] and got["warp_shape"] == [8, 64, 32] and not got["use_stream_k"]
        assert got["num_stages"] == 6 and got["num_ctas_per_sm"] == 2
        assert json.loads(hx._tuning(w13, 64))["block_shape"] == [8, 64, 64]
        assert "num_ctas_per_sm" not in json.loads(hx._tuning(w13, 64))  # 2 CTAs per SM at bucket 16 only
        for config, rows, kw in ((w13, 16, {"invariant": True}), (w13, 16, {"tuned": False}), (w13, 128, {}),
                                 (w2, 16, {})):
            assert json.loads(hx._tuning(config, rows, **kw))["block_shape"] == [8, 128, 64]
        heuristic["config"] = {**base, "num_stages": 6, "block_shape": (16, 128, 64)}  # another config: kept
        hx._tuning.cache_clear()
        assert json.loads(hx._tuning(w13, 16))["block_shape"] == [16, 128, 64]
        # w2: the heuristic's wgmma tile of 256 columns becomes w1|w3's mma.sync decode tile
        heuristic["config"] = {**base, "block_shape": (8, 256, 64), "warp_shape": (8, 64, 64), "mma_type": "wgmma"}
        hx._tuning.cache_clear()
        got = json.loads(hx._tuning(w2, 32))
        assert (got["block_shape"], got["warp_shape"], got["mma_type"]) == ([8, 128, 64], [8, 64, 32], "mma")
        assert json.loads(hx._tuning(w2, 128))["mma_type"] == "wgmma"
        # bucket 512: w2's wgmma tile takes 16 rows; w1|w3's mma.sync tile 6 stages, only from the heuristic's 4
        assert json.loads(hx._tuning(w2, 512))["block_shape"] == [16, 256, 64]
        heuristic["config"] = dict(base)
        hx._tuning.cache_clear()
        assert json.loads(hx._tuning(w13, 512))["num_stages"] == 6
        heuristic["config"] = {**base, "num_stages": 5}
        hx._tuning.cache_clear()
        assert json.loads(hx._tuning(w13, 512))["num_stages"] == 5
        # bucket 128: w1|w3 with 6 stages; bucket 1024: the heuristic's own config
        heuristic["config"] = dict(base)
        hx._tuning.cache_clear()
        assert json.loads(hx._tuning(w13, 128))["num_stages"] == 6 and json.loads(hx._tuning(w2, 128)) == {
            **base, "block_shape": [8, 128, 64], "warp_shape": [8, 64, 32], "use_stream_k": False}
        for config in (w13, w2):
            assert json.loads(hx._tuning(config, 1024)) == {**base, "block_shape": [8, 128, 64],
                                                            "warp_shape": [8, 64, 32], "use_stream_k": False}
        # bucket 4096: the heuristic's 96-row wgmma tile (48 local experts) becomes its config for 2,048 rows; its
        # 56-row tile (96 local experts) stays
        wide = {**base, "block_shape": (96, 256, 64), "warp_shape": (96, 32, 64), "mma_type": "wgmma"}
        by_rows = {4096: wide, 2048: {**wide, "block_shape": (48, 256, 64), "num_stages": 5}}
        tune.get_heuristics_config = lambda config, shape_m, **kw: dict(by_rows[shape_m])
        hx._tuning.cache_clear()
        for config in (w13, w2):
            got = json.loads(hx._tuning(config, 4096))
            assert got == json.loads(hx._tuning(config, 2048)) and got["block_shape"] == [48, 256, 64]
            for kw in ({"invariant": True}, {"tuned": False}):
                assert json.loads(hx._tuning(config, 4096, **kw))["block_shape"] == [96, 256, 64]
        by_rows[4096] = {**wide, "block_shape": (56, 256, 64), "warp_shape": (56, 32, 64)}
        hx._tuning.cache_clear()
        assert json.loads(hx._tuning(w13, 4096))["block_shape"] == [56, 256, 64]
        # bucket 1024 at 128 experts (DSpark's draft MoE): its 16-row wgmma tile becomes bucket 2048's config; at
        # 48 experts (a main layer) the same heuristic config stays
        by_rows[1024] = {**wide, "block_shape": (16, 256, 64), "warp_shape": (16, 64, 64)}
        hx._tuning.cache_clear()
        for config in (Layer(4608, 5120, 128), Layer(5120, 2304, 128)):
            assert json.loads(hx._tuning(config, 1024)) == json.loads(hx._tuning(config, 2048))
            assert json.loads(hx._tuning(config, 1024, tuned=False))["block_shape"] == [16, 256, 64]
        assert json.loads(hx._tuning(w13, 1024))["block_shape"] == [16, 256, 64]
    finally:
        hx._tuning.cache_clear()


def _tuned_and_plain(hx, N, K, experts=8, rows=6):
    """At V4.1's [N, K] expert shape, each case's outputs under the decode tile change (`tuned`) and under the
    heuristic's own config, as (tuned, plain). 8 local experts and 6 rows (bucket 16): 6 experts x 1 row and 1
    expert x 4 rows. 96 and 384 (bucket 512, B = 64's decode on the emulated rank): 60 experts touched with 4-24
    rows each in multiples of 4, as that step's routing. 48 and 2,304 (bucket 4096, a B = 64 x 6 verify step on one
    emulated EP8 rank): every expert with 16-96 rows."""
    stack = hx.convert(*_experts(experts, N, K, 120, 121))
    tuned, plain = hx.tuning_for(stack, rows), hx.tuning_for(stack, rows, tuned=False)
    assert tuned != plain
    if rows <= 16:
        cases = ([1, 1, 1, 0, 1, 1, 1, 0], [0, 0, 4, 0, 0, 0, 0, 0])
    else:
        g = torch.Generator().manual_seed(0)
        touched = torch.randperm(experts, generator=g)[:60]
        step = torch.zeros(experts, dtype=torch.int64)
        unit = 4 if rows < 1024 else 16  # a verify step (bucket 4096): ~56 rows an expert, 1-2 row tiles each
        step[touched] = unit * torch.randint(1, 7, (len(touched),), generator=g)
        cases = (step.tolist(),)
    for counts in cases:
        counts = torch.tensor(counts, device="cuda")
        offset = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
        a = torch.randn(int(counts.sum()), K, device="cuda").bfloat16()
        yield (hx.grouped_gemm(a, stack, offset, rows, tuning=tuned),
               hx.grouped_gemm(a, stack, offset, rows, tuning=plain))


@pytest.mark.gpu
def test_decode_tiles_give_the_heuristic_configs_bits_gpu(hx):
    """The decode tile changes keep the heuristic's sums at V4.1's w1|w3 shape (buckets 16, 128 and 512), at w2's
    in bucket 512 (16 rows per wgmma tile instead of 8) and at both in bucket 4096 with 48 experts (bucket 2048's
    config): the same bits under both configs."""
    for args in ((4608, 5120), (4608, 5120, 96, 384), (5120, 2304, 96, 384), (4608, 5120, 96, 96),
                 (4608, 5120, 48, 2304), (5120, 2304, 48, 2304)):
        for got, ref in _tuned_and_plain(hx, *args):
            assert torch.equal(got, ref)


@pytest.mark.gpu
def test_w2_decode_tiles_keep_one_rounding_gpu(hx):
    """w2's decode tile (mma.sync, K split between two warps) against the heuristic's wgmma tile at V4.1's w2
    shape: both one fp32 sum of the exact products and one rounding, in different orders, so almost all outputs
    are equal and the rest a bf16 ulp or so apart."""
    for got, ref in _tuned_and_plain(hx, 5120, 2304):
        got, ref = got.float(), ref.float()
        assert torch.isfinite(got).all()
        assert ((got - ref).abs() <= ref.abs() * 2.0 ** -6 + 1e-3 * ref.abs().max()).all()
        assert (got == ref).float().mean().item() > 0.9
