"""KV compressor: chunked (with open-group state across steps, several sequences per step) == one-shot ==
a direct per-group formula, for V4.1 ratio 2 / ratio 1 and V4 ratio 4 (overlap + APE) / ratio 128."""
import pytest
import torch

from mini.config import preset
from mini.model.batch import Batch, SeqChunk
from mini.model.cache import state_shape
from mini.ops.compressor import CompressorWeights, compress
from mini.ops.norm import rms_norm

D, HD, EPS = 48, 16, 1e-6


def _weights(ratio, overlap, ape, g):
    coff = 2 if overlap else 1
    return CompressorWeights(
        ratio, overlap, torch.randn(coff * HD, D, generator=g) / D ** 0.5,
        None if ratio == 1 else torch.randn(coff * HD, D, generator=g),
        torch.randn(ratio, coff * HD, generator=g) if ape else None, 1 + 0.1 * torch.randn(HD, generator=g))


def _projections(x, w):
    """fp64 kv and score (APE added) of every token of a sequence."""
    xd = x.double()
    if w.ratio == 1:
        return xd @ w.wkv.double().T, None
    score = xd @ w.wgate.double().T
    if w.ape is not None:
        score = score + w.ape.double()[torch.arange(len(x)) % w.ratio]
    return xd @ w.wkv.double().T, score


def _oracle(kv, score, w, j):
    """Group j's latent straight from the sequence's projections."""
    r = w.ratio
    if r == 1:
        return rms_norm(kv[j], w.norm, EPS)
    own = slice(j * r, (j + 1) * r)
    if not w.overlap:
        k, s = kv[own], score[own]
    else:  # previous group's tokens on channels [:HD], this group's on [HD:]
        k, s = kv[own, HD:], score[own, HD:]
        if j > 0:
            prev = slice((j - 1) * r, j * r)
            k, s = torch.cat([kv[prev, :HD], k]), torch.cat([score[prev, :HD], s])
    return rms_norm((k * s.softmax(0)).sum(0), w.norm, EPS)


def _run(xs, w, steps, cfg, block_tokens):
    """steps: lists of (seq, start, end); returns {(seq, j): latent}."""
    rows, width = state_shape(cfg, w.ratio, HD) if w.ratio > 1 else (1, HD)
    state = (torch.full((3, rows, width), float("nan")), torch.full((3, rows, width), float("nan")))
    out = {}
    for step in steps:
        chunks = [SeqChunk([1] * end, start, slot=2 - s, blocks=list(range(8))) for s, start, end in step]
        batch = Batch.build(chunks, cfg, "cpu")
        groups = batch.layout(block_tokens, cfg.window_size).groups(w.ratio, w.overlap)
        x = torch.cat([xs[s][start:end] for s, start, end in step])
        lat = compress(x, w, batch.positions, groups, *state, EPS) if w.ratio > 1 else compress(
            x, w, batch.positions, groups, None, None, EPS)
        assert lat.shape == (len(groups.group), HD) and torch.isfinite(lat).all()
        for i, (b, j) in enumerate(zip(groups.seq.tolist(), groups.group.tolist())):
            out[(step[b][0], j)] = lat[i]
    return out


@pytest.mark.parametrize("version,ratio,overlap,ape", [
    ("tiny-v4.1", 2, False, False), ("tiny-v4.1", 1, False, False),
    ("tiny-v4", 4, True, True), ("tiny-v4", 128, False, True)])
def test_chunked_equals_one_shot_equals_formula(version, ratio, overlap, ape):
    g = torch.Generator().manual_seed(ratio)
    cfg = preset(version).replace(engram_layer_ids=(), engram_num_embeddings=())  # no hasher needed
    w = _weights(ratio, overlap, ape, g)
    L = 300
    xs = [torch.randn(L, D, generator=g, dtype=torch.float64).float() for _ in range(2)]
    one_shot = _run(xs, w, [[(0, 0, L), (1, 0, L)]], cfg, 128)
    # the two sequences advance in different, odd chunkings within the same steps
    cuts = [[0, 5, 6, 9, 137, 139, 140, 141, 270, 300], [0, 1, 3, 131, 132, 133, 250, 251, 255, 300]]
    steps = [[(s, cuts[s][k], cuts[s][k + 1]) for s in range(2)] for k in range(len(cuts[0]) - 1)]
    chunked = _run(xs, w, steps, cfg, 128)
    assert set(one_shot) == set(chunked) == {(s, j) for s in range(2) for j in range(L // ratio)}
    proj = [_projections(x, w) for x in xs]
    for (s, j), lat in one_shot.items():
        torch.testing.assert_close(chunked[(s, j)], lat, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lat.double(), _oracle(*proj[s], w, j), atol=1e-5, rtol=1e-5)


def test_bf16_weights_are_kept_and_promoted_on_use():
    g = torch.Generator().manual_seed(3)
    state = {"c.wkv.weight": torch.randn(32, D, generator=g).bfloat16(),
             "c.wgate.weight": torch.randn(32, D, generator=g).bfloat16(), "c.norm.weight": torch.ones(HD * 2)}
    w = CompressorWeights.from_state(state, "c", 4, True, torch.float32)
    assert w.wkv.dtype == w.wgate.dtype == torch.bfloat16  # promoted exactly when used
    w32 = CompressorWeights.from_state({**state, "c.wkv.weight": state["c.wkv.weight"].float()}, "c", 4, True,
                                       torch.float32)
    assert w32.wkv.dtype == torch.float32
    x = torch.randn(5, D, generator=g)
    from mini.ops.compressor import _linear_fp32
    assert torch.equal(_linear_fp32(x, w.wkv), torch.nn.functional.linear(x, w32.wkv))


@pytest.mark.gpu
def test_fp32_projection_of_bf16_values_on_tensor_cores_gpu():
    """bf16 x and weights: the bf16 GEMM with an fp32 result sums the same exact products as the fp32 GEMM."""
    from mini.ops.compressor import _linear_fp32
    x = torch.randn(1001, 5120, device="cuda").bfloat16()
    w = (torch.randn(1024, 5120, device="cuda") / 70).bfloat16()
    got = _linear_fp32(x, w)
    ref = torch.nn.functional.linear(x.double(), w.double())
    assert got.dtype == torch.float32
    assert ((got.double() - ref).abs() <= 1e-5 * ref.abs().amax(-1, keepdim=True)).all()
