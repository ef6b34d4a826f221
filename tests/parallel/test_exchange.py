"""The EP MoE exchange on gloo ranks (spawned CPU processes) against the single-device MoE."""
import contextlib

import pytest
import torch

from mini.checkpoint import expert_range, random_state
from mini.config import TINY_V4, TINY_V41
from mini.parallel.exchange import MoEExchange, decode_fp8, encode_fp8
from mini.parallel.groups import DistContext
from mini.parallel.launch import spawn
from mini.formats import fake_quant_fp8
from mini.formats.quant import no_fake_quant
from mini.ops.moe import MoEWeights, moe

CONFIGS = {"tiny-v4.1": TINY_V41, "tiny-v4": TINY_V4}


def _inputs(cfg, counts, seed):
    """Every rank's MoE input (same on every process): odd sizes, a wide dynamic range, one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, cfg.dim, generator=g) * torch.logspace(-3, 2, n).unsqueeze(1) for n in counts]
    if counts[0]:
        xs[0][0] = 0.0
    ids = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in counts]
    return xs, ids


def _moe_case(cfg, layer, w, x, ids, fake_quant, run):
    with no_fake_quant() if not fake_quant else contextlib.nullcontext():
        return run(x, w, cfg, cfg.layers[layer], input_ids=ids)


def _rank(ctx: DistContext, preset, cases, seed):
    """Each case (layer, counts, dtype, fake_quant) is one step through one MoE layer, called twice (as two
    layers of a step would be) with the counts exchanged once."""
    cfg = CONFIGS[preset]
    mine = expert_range(cfg, ctx.rank, ctx.world)
    state = random_state(cfg, seed=seed, experts=mine)
    ex, out = MoEExchange(ctx), []
    for layer, counts, dtype, fake_quant in cases:
        w = MoEWeights.from_state(state, f"layers.{layer}.ffn", cfg, layer, experts=mine)
        xs, ids = _inputs(cfg, counts, seed)
        assert ex.begin_step(counts[ctx.rank]) == sum(counts)
        out.append([_moe_case(cfg, layer, w, xs[ctx.rank].to(dtype), ids[ctx.rank], fake_quant, ex)
                    for _ in range(2)])
    return out


# one spawn per world: cases of (layer, per-rank token counts, activation dtype, fake quantization on)
@pytest.mark.parametrize("preset, cases", [
    ("tiny-v4.1", [(3, [5, 0, 3, 7], torch.float32, True),  # uneven counts and an idle rank
                   (5, [4, 4, 4, 4], torch.bfloat16, True),  # equal counts: no padding
                   (2, [3, 9, 1, 2], torch.float32, False)]),  # fake quant off: raw activations travel
    ("tiny-v4", [(0, [6, 1], torch.float32, True),  # V4: hash-routed layer (tid2eid), 1x128 blocks
                 (3, [1, 0], torch.bfloat16, True),  # one token in all: single-row views of the gathered bytes
                 (4, [0, 1], torch.float32, False)]),
])
def test_exchange_matches_single_device_moe(preset, cases):
    cfg, seed = CONFIGS[preset], 11
    world = len(cases[0][1])
    got = spawn(world, _rank, preset, cases, seed, device="cpu")
    state = random_state(cfg, seed=seed)
    for i, (layer, counts, dtype, fake_quant) in enumerate(cases):
        w = MoEWeights.from_state(state, f"layers.{layer}.ffn", cfg, layer)
        xs, ids = _inputs(cfg, counts, seed)
        for r, n in enumerate(counts):
            want = _moe_case(cfg, layer, w, xs[r].to(dtype), ids[r], fake_quant, moe)
            for y in got[r][i]:
                assert y.shape == (n, cfg.dim) and y.dtype == dtype
                assert torch.isfinite(y).all()
                if dtype == torch.float32:  # only the cross-rank fp32 summation order differs
                    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6 * want.abs().max().item() if n else 0.0)
                else:  # the bf16 rounding of a sum whose last fp32 bits differ: at most one bf16 step apart
                    torch.testing.assert_close(y.float(), want.float(), rtol=2 ** -7, atol=0)
            assert torch.equal(got[r][i][0], got[r][i][1])


def test_single_rank_exchange_is_the_plain_moe():
    cfg, layer = TINY_V41, 4
    w = MoEWeights.from_state(random_state(cfg, seed=3), f"layers.{layer}.ffn", cfg, layer)
    x = torch.randn(9, cfg.dim)
    ex = MoEExchange(DistContext(0, 1, torch.device("cpu"), None))
    with pytest.raises(RuntimeError, match="begin_step"):
        ex(x, w, cfg, cfg.layers[layer])
    ex.begin_step(9)
    assert torch.equal(ex(x, w, cfg, cfg.layers[layer]), moe(x, w, cfg, cfg.layers[layer]))


@pytest.mark.parametrize("block, dtype", [(32, torch.float32), (128, torch.bfloat16), (32, torch.bfloat16)])
def test_fp8_wire_form_decodes_to_the_fake_quantized_input(block, dtype):
    x = torch.randn(37, 4 * block) * torch.logspace(-8, 4, 37).unsqueeze(1)
    x[3] = 0.0
    x[5, :block] = 1e-30
    x = x.to(dtype)
    codes, scales = encode_fp8(x, block)
    assert codes.dtype == scales.dtype == torch.uint8 and scales.shape == (37, 4)
    want = fake_quant_fp8(x, block)
    got = decode_fp8(codes, scales, block, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    # the experts quantize the gathered input again: fake quantization must be idempotent for that to be exact
    assert torch.equal(fake_quant_fp8(want, block), want)
