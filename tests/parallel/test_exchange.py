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


def inputs(cfg, counts, seed):
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
        xs, ids = inputs(cfg, counts, seed)
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
        xs, ids = inputs(cfg, counts, seed)
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


class _CountingExchange(MoEExchange):
    """MoEExchange that counts the layers its fused glue served (so a silent fallback to the eager one shows)."""
    wire_calls = 0

    def exchange_wire(self, *a, **kw):
        self.wire_calls += 1
        return super().exchange_wire(*a, **kw)


def _rank_fused(ctx: DistContext, layer, counts, seed):
    """One MoE layer through the fused glue and the eager one, on the fast path with the Triton kernels under the
    interpreter (bf16, fake quant on), and this rank's tokens through one device holding every expert."""
    import mini.ops
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    cfg = TINY_V41
    mine = expert_range(cfg, ctx.rank, ctx.world)
    w = MoEWeights.from_state(random_state(cfg, seed=seed, experts=mine), f"layers.{layer}.ffn", cfg, layer,
                              experts=mine)
    xs, ids = inputs(cfg, counts, seed)
    x, plan = xs[ctx.rank].bfloat16(), cfg.layers[layer]
    out = {}
    for glue in ("fused", "eager"):
        ex = _CountingExchange(ctx, glue=glue)
        ex.begin_step(counts[ctx.rank])
        out[glue] = ex(x, w, cfg, plan, input_ids=ids[ctx.rank])
        out[glue + "_wire_calls"] = ex.wire_calls
    every = MoEWeights.from_state(random_state(cfg, seed=seed), f"layers.{layer}.ffn", cfg, layer)
    out["one"] = moe(x, every, cfg, plan, input_ids=ids[ctx.rank])
    return out


@pytest.mark.parametrize("counts", [[7, 3], [0, 5]])  # padding rows (id -1) on rank 1; an idle rank 0
def test_fused_glue_equals_eager_glue_and_one_device_bitwise(counts, monkeypatch):
    """The fused glue (wire rows from the act-quant kernel, decode in the experts' gather pass, the shared expert
    added in the combine) gives the eager glue's and one device's bf16 outputs bit for bit."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned ranks when their kernels are decorated
    got = spawn(2, _rank_fused, 3, counts, 5, device="cpu")
    for r, n in enumerate(counts):
        o = got[r]
        assert o["fused_wire_calls"] == 1 and o["eager_wire_calls"] == 0
        assert o["fused"].shape == (n, TINY_V41.dim) and o["fused"].dtype == torch.bfloat16
        assert torch.isfinite(o["fused"]).all()
        assert torch.equal(o["fused"], o["eager"]) and torch.equal(o["fused"], o["one"])


def test_glue_choice_refuses_unknown_names(monkeypatch):
    from mini.parallel.exchange import glue_choice
    monkeypatch.setenv("MINI_EP_GLUE", "eager")
    assert glue_choice() == "eager" and glue_choice("fused") == "fused"
    monkeypatch.setenv("MINI_EP_GLUE", "fast")
    with pytest.raises(ValueError, match="MINI_EP_GLUE"):
        glue_choice()


def test_wire_row_fields_are_aligned_views():
    from mini.parallel.exchange import WireRow
    row = WireRow(k=5, dim=5120, block=32)
    used = 8 * 5 + 5120 + 160
    assert row.width % 16 == 0 and used <= row.width < used + 16
    buf = torch.zeros(3, row.width, dtype=torch.uint8)
    ids, weights, codes, scales = row.fields(buf)
    assert ids.shape == weights.shape == (3, 5) and codes.shape == (3, 5120) and scales.shape == (3, 160)
    ids.fill_(-1)
    weights.view(torch.int32).fill_(0x01020304)
    codes.fill_(2)
    scales.fill_(3)
    assert (buf[:, used:] == 0).all() and (buf[:, :used] != 0).all()  # the fields tile the row, no overlap
    assert (buf[:, 8 * 5: 8 * 5 + 5120] == 2).all() and (buf[:, 8 * 5 + 5120: used] == 3).all()


def _one_layer_state(cfg, seed, device):
    """Layer 0's MoE tensors at cfg's sizes (random_state would draw every layer), quantized on `device`."""
    import math

    from mini.formats import quantize_fp8, quantize_mxfp4
    g = torch.Generator().manual_seed(seed)
    p, D, inter, E = "layers.0.ffn", cfg.dim, cfg.moe_inter_dim, cfg.n_routed_experts
    st = {f"{p}.gate.weight": (torch.randn(E, D, generator=g) / math.sqrt(D)).bfloat16(),
          f"{p}.gate.bias": torch.randn(E, generator=g) * 0.02}
    shapes = (("w1", (inter, D)), ("w3", (inter, D)), ("w2", (D, inter)))
    for e in range(E):
        for name, (n, k) in shapes:
            d, s = quantize_mxfp4(torch.randn(n, k, generator=g).to(device) / math.sqrt(k))
            st[f"{p}.experts.{e}.{name}.weight"], st[f"{p}.experts.{e}.{name}.scale"] = d.view(torch.int8), s
    for name, (n, k) in shapes:
        d, s = quantize_fp8(torch.randn(n, k, generator=g).to(device) / math.sqrt(k), cfg.fp8_block)
        st[f"{p}.shared_experts.{name}.weight"], st[f"{p}.shared_experts.{name}.scale"] = d, s
    return {k: v.to(device) for k, v in st.items()}


def one_rank_layer(ctx: DistContext, seed, dim, inter, experts):
    """(config, MoEWeights of layer 0) at the given sizes for the fast path on a one-rank group (the launcher starts
    no group for one rank, and the collectives need one; on the CPU the kernels run under the interpreter)."""
    import mini.ops
    from mini.config import preset
    import torch.distributed as dist
    dev = ctx.device
    if dev.type == "cpu":
        mini.ops.set_backend("fast", interpret_on_cpu=True)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, **({"device_id": dev} if dev.type == "cuda" else {}))
    cfg = preset("tiny-v4.1").replace(dim=dim, moe_inter_dim=inter, n_routed_experts=experts, n_activated_experts=6)
    return cfg, MoEWeights.from_state(_one_layer_state(cfg, seed, dev), "layers.0.ffn", cfg, 0)


def _rank_wire(ctx: DistContext, cases, seed, dim, inter, experts):
    """`exchange_wire` with the real experts on one rank (a one-rank group: the all-gather and reduce-scatter copy),
    `pad` padding rows past this rank's tokens, against the one-device fast MoE (on the CPU: under the
    interpreter)."""
    from mini.ops.moe import gate, routed_wire, routed_wire_ok, shared
    dev = ctx.device
    cfg, w = one_rank_layer(ctx, seed, dim, inter, experts)
    plan, out = cfg.layers[0], []
    for T, pad in cases:
        x = (torch.randn(T, cfg.dim, device=dev) * torch.logspace(-2, 2, T, device=dev)[:, None]).bfloat16()
        weights, ids = gate(x, w, cfg, plan)
        assert routed_wire_ok(x, ids, w)
        ex = MoEExchange(ctx)
        ex.set_counts([T + pad])
        got = ex.exchange_wire(x, weights, ids, cfg.fp8_block, local=lambda: shared(x, w),
                               experts=lambda rows, wa, ia, add, at: routed_wire(rows, w, wa, ia, add, at))
        out.append((got.cpu(), moe(x, w, cfg, plan).cpu(), w.humming is not None))
    return out


def _check_wire(device, cases, dim, inter, experts):
    for (T, _), (got, want, humming) in zip(cases, spawn(1, _rank_wire, cases, 3, dim, inter, experts,
                                                         device=device)[0]):
        assert got.shape == want.shape == (T, dim) and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert torch.equal(got, want), f"humming={humming}: {(got != want).sum().item()} elements differ"


def test_fused_exchange_equals_one_device_moe_interpreter(monkeypatch):
    """The fused glue's real path (act-quant kernel into the send buffer, our GEMMs on the decoded gathered rows,
    the shared expert added in the combine; padding rows with id -1) gives the one-device fast MoE's bits."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check_wire("cpu", [(9, 3)], 64, 32, 16)


@pytest.mark.gpu
def test_fused_exchange_equals_one_device_moe_gpu():
    """The same at 1,024 wide with 32 experts on the GPU (300 tokens, then 2,000 with 7 padding rows): Humming's
    GEMMs where they load (the default on an H200), else ours."""
    _check_wire("cuda", [(300, 0), (2000, 7)], 1024, 512, 32)
