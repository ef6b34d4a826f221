"""mini vs transformers' DeepSeek-V4 port (`DeepseekV4ForCausalLM`) on a tiny V4-Flash-architecture model.

transformers builds the model with random weights; `hf_v4_convert` quantizes them to the official checkpoint formats
(FP8 e4m3 + E8M0 128x128 blocks, MXFP4 routed experts, bf16, fp32), loads the dequantized values back into
transformers and writes the official layout; mini loads that checkpoint. Both run in fp32 and must agree to a
relative error of 1e-4 on the logits of every prompt position (prefill) and of greedy decode steps.

Where transformers and the official reference (`inference/model.py`) differ, mini follows the reference; each
difference is neutralised in the comparison only, never in mini's normal behaviour:

1. Fake quantization. The reference (and mini) quantize every FP8/FP4 GEMM input to FP8 1x128, the window and
   compressed KV to FP8 1x64 on the nope dims, and the indexer q / k to FP4 1x32; transformers does none of it.
   mini runs inside `mini.formats.no_fake_quant()`.
2. Hadamard rotation of the indexer q and k (reference `rotate_activation`; absent in transformers). It is
   orthonormal on both sides of q·k, so without FP4 quantization in between it cancels:
   `test_hadamard_cancels_without_fake_quant` checks this on mini's own `hadamard`.
3. Precision. The reference flows activations in bf16 (bf16 index scores, bf16 P before PV); here both sides run
   fp32 (`DeepseekV4ForCausalLM.float()`, mini dtype float32).
4. Router normalisation: transformers divides the routing weights by `sum + 1e-20`, the V4 reference by `sum`. At
   fp32 with sums of order 1 the epsilon is below rounding; nothing to neutralise.
5. Routed-expert weight: the reference scales the SwiGLU output before `w2`, transformers scales after `w2`.
   Identical without activation quantization (item 1), up to fp32 rounding.
6. Top-k ties. Index scores are Σ_h relu(q_h·k)·w_h: with tiny-v4's 4 index heads, ~6% of queries have several
   groups scoring exactly 0 (all four ReLUs zero) at the top-k boundary, and which of them is kept is
   implementation-defined (torch.topk in both the reference and transformers). The test config therefore uses 8
   index heads of 128 dims (the real model's 64 nope + 64 RoPE split), which makes such ties rare but not
   impossible; `test_topk_decisions_are_separated` checks that every indexer and router decision transformers made
   for this seed and prompt has a clear gap, so the comparison is well posed.

Conventions checked against the spec (`test_transformers_conventions`, and by the end-to-end match): RoPE is
interleaved on the last 64 dims in both (transformers' `rotate_half` pairs x[2i], x[2i+1]); compressed layers use
base 160000 with YaRN and no mscale, window-only layers base 10000 without YaRN; the grouped `wo_a` has the same
[groups·o_lora, heads·head_dim/groups] layout; `gate_up_proj` holds w1 rows then w3 rows. The APE
(`position_bias` = `ape`), the hash table (`tid2eid`), `hc_head`, the per-head q norm and the overlapping ratio-4
compressor are carried over unchanged and covered by the logit comparison (their values are randomised, not left
at transformers' constant initialisation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4", reason="needs transformers with the DeepSeek-V4 port (>= 5.24)")

import hf_v4_convert as conv  # noqa: E402
from mini.checkpoint import load_state  # noqa: E402
from mini.checkpoint.inventory import expected_tensors  # noqa: E402
from mini.config import TINY_V4  # noqa: E402
from mini.formats import fake_quant_fp4, no_fake_quant  # noqa: E402

pytestmark = pytest.mark.slow  # ~50 CPU-seconds for the module

CONFIG = TINY_V4.replace(index_n_heads=8, index_head_dim=128)  # item 6 of the module docstring
PROMPT_LEN = 250  # crosses the 128 window, one ratio-128 group and 62 ratio-4 groups
DECODE_STEPS = 8  # positions 250..257: ratio-4 groups close at 251 and 255, the second ratio-128 group at 255
BLOCK_TOKENS, BLOCKS, SLOT = 128, [3, 0, 2], 1  # non-trivial paging: blocks out of order, slot 1 of 2
REL_TOL = 1e-4
MIN_GAP = 1e-5  # smallest relative score gap at a top-k boundary for which the comparison is well posed


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row: max |a - ref| / max |ref|."""
    return (a - ref).abs().amax(-1) / ref.abs().amax(-1)


@dataclass
class Run:
    hf: object  # DeepseekV4ForCausalLM, weights = dequantized checkpoint
    original: dict  # its random weights before quantization
    official: dict  # the checkpoint tensors
    ckpt: str
    tokens: list[int]  # prompt + greedy continuation (transformers' argmax)
    hf_logits: list[torch.Tensor]  # [PROMPT_LEN, V] for the prefill, then [V] per decode step
    index_scores: list[torch.Tensor]  # transformers' indexer scores, [S, T] per call and CSA layer
    router_scores: list[torch.Tensor]  # transformers' score-routed selection scores (+ bias), [S, E]


def _record(model, index_scores: list, router_scores: list) -> list:
    """Forward hooks on transformers' indexer scorers and score-routed gates."""
    handles = []
    for layer in model.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            handles.append(comp.indexer.scorer.register_forward_hook(
                lambda mod, inp, out: index_scores.append(out[0].detach().clone())))
        gate = layer.mlp.gate
        if not hasattr(gate, "tid2eid"):
            handles.append(gate.register_forward_hook(
                lambda mod, inp, out: router_scores.append(
                    (mod.score_fn(out[0]) + mod.e_score_correction_bias).detach().clone())))
    return handles


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    hf = conv.random_model(CONFIG, seed=1)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    official = conv.quantize_model(hf, CONFIG)
    ckpt = str(conv.write_checkpoint(official, CONFIG, tmp_path_factory.mktemp("tiny_v4_ckpt")))
    prompt = torch.randint(0, CONFIG.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3))
    tokens, index_scores, router_scores = prompt.tolist(), [], []
    handles = _record(hf, index_scores, router_scores)
    with torch.no_grad():
        out = hf(prompt[None], use_cache=True)
        cache, logits = out.cache, [out.logits[0]]
        for _ in range(DECODE_STEPS):
            tokens.append(int(logits[-1].reshape(-1, CONFIG.vocab_size)[-1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    for h in handles:
        h.remove()
    return Run(hf, original, official, ckpt, tokens, logits, index_scores, router_scores)


# ---------------------------------------------------------------------- the conversion, in isolation
def test_checkpoint_layout_and_round_trip(run: Run):
    # names, dtypes and shapes are exactly what mini's inventory of the config expects
    want = expected_tensors(CONFIG)
    assert set(run.official) == set(want)
    for name, spec in want.items():
        t = run.official[name]
        assert (t.dtype, tuple(t.shape)) == (spec.dtype, spec.shape), name
    # what mini's loader reads back from the shards is bit-identical to what was written
    loaded = load_state(run.ckpt, CONFIG, progress=False)
    for name, t in run.official.items():
        assert torch.equal(loaded[name].view(torch.uint8) if t.element_size() == 1 else loaded[name],
                           t.view(torch.uint8) if t.element_size() == 1 else t), name
    # transformers computes with exactly the checkpoint's values: re-quantizing them changes no value
    hf_now = run.hf.state_dict()
    again = conv.hf_state(conv.official_state(run.hf, CONFIG), run.hf, CONFIG)
    for name, t in again.items():
        assert torch.equal(t, hf_now[name].to(t.dtype)), name
    # each tensor stays close to its random original, so the two directions of the name map are inverse to each
    # other: a mismatch (w1/w3, gate/up, expert order, transposes) would be off by O(1). That both directions agree
    # with the reference's conventions is what the logit comparison with mini shows. Bounds: bf16 2^-8, FP8 e4m3
    # 2^-4, MXFP4 ~0.25 per element.
    bound = {"bf16": 4e-3, "f32": 0.0, "i64": 0.0, "fp8": 0.05, "mxfp4": 0.2}
    for name, orig in run.original.items():
        err = ((hf_now[name].float() - orig.float()).norm() / orig.float().norm()).item()
        assert err <= bound[_format_of(name)], f"{name}: relative error {err:.3g} after quantization"


def _format_of(hf_name: str) -> str:
    if hf_name in conv._GLOBAL:
        return conv._GLOBAL[hf_name][1]
    rest = hf_name.split(".", 3)[3]
    return "mxfp4" if rest in conv._EXPERTS else conv._LAYER[rest][1]


def test_transformers_conventions(run: Run):
    """transformers' layouts are the reference's: interleaved RoPE on the last dims, the per-layer RoPE tables,
    the grouped wo_a, and w1-then-w3 in gate_up_proj."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(5)
    rd, hd = CONFIG.rope_head_dim, CONFIG.head_dim
    rope = run.hf.model.rotary_emb
    # tables: window-only layers base 10000 plain, compressed layers base 160000 + YaRN (reference formula)
    assert torch.allclose(rope.main_inv_freq, _reference_freqs(CONFIG.rope_theta, yarn=False), rtol=1e-6, atol=0)
    assert torch.allclose(rope.compress_inv_freq, _reference_freqs(CONFIG.compress_rope_theta, yarn=True),
                          rtol=1e-6, atol=0)
    assert rope.compress_attention_scaling == 1.0 and rope.main_attention_scaling == 1.0  # no YaRN mscale
    # RoPE: (x[2i], x[2i+1]) of the last rd dims rotated as a complex number; the inverse is the conjugate
    x = torch.randn(3, 2, 5, hd, generator=g)  # [B, H, S, D]
    pos = torch.tensor([[0, 7, 128, 255, 1000]] * 3)
    cos, sin = rope(x, pos, layer_type="compress")
    angle = pos[..., None].float() * rope.compress_inv_freq
    pairs = torch.view_as_complex(x[..., -rd:].unflatten(-1, (-1, 2)).contiguous())
    want = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)[:, None]).flatten(-2)
    got = apply_rotary_pos_emb(x, cos, sin)
    assert torch.equal(got[..., :-rd], x[..., :-rd])
    assert torch.allclose(got[..., -rd:], want, atol=1e-5)
    assert torch.allclose(apply_rotary_pos_emb(got, cos, -sin), x, atol=1e-5)
    # grouped wo_a: group g of heads uses rows g*o_lora..(g+1)*o_lora-1 (reference einsum 'bsgd,grd->bsgr')
    o_a = run.hf.model.layers[0].self_attn.o_a_proj
    o = torch.randn(2, 3, CONFIG.o_groups, CONFIG.n_heads * hd // CONFIG.o_groups, generator=g)
    want = torch.einsum("bsgd,grd->bsgr", o, o_a.weight.view(CONFIG.o_groups, CONFIG.o_lora_rank, -1))
    assert torch.allclose(o_a(o), want, rtol=1e-5, atol=1e-5)
    # experts: gate_up_proj[e] = [w1; w3], SwiGLU with the limit clamps on both
    experts = run.hf.model.layers[3].mlp.experts
    xs = torch.randn(4, CONFIG.dim, generator=g) * 4
    w1, w3 = experts.gate_up_proj[2].chunk(2)
    h = torch.nn.functional.silu((xs @ w1.T).clamp(max=CONFIG.swiglu_limit)) * (xs @ w3.T).clamp(
        -CONFIG.swiglu_limit, CONFIG.swiglu_limit)
    got = experts(xs, torch.full((4, 1), 2), torch.ones(4, 1))
    assert torch.allclose(got, h @ experts.down_proj[2].T, rtol=1e-5, atol=1e-5)


def _reference_freqs(base: float, yarn: bool) -> torch.Tensor:
    """Spec §2.4.2: f_i = base^(-2i/rd); YaRN divides by `factor` with a linear ramp between the floor/ceil of the
    correction dims of beta_fast and beta_slow."""
    c, rd = CONFIG, CONFIG.rope_head_dim
    f = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    if not yarn:
        return f

    def corr(rot):
        return rd * math.log(c.original_seq_len / (2 * math.pi * rot)) / (2 * math.log(base))

    lo, hi = max(math.floor(corr(c.beta_fast)), 0), min(math.ceil(corr(c.beta_slow)), rd - 1)
    ramp = ((torch.arange(rd // 2, dtype=torch.float32) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
    return f / c.rope_factor * ramp + f * (1 - ramp)


def test_hadamard_cancels_without_fake_quant():
    """mini rotates the V4 index q and k by the normalised Walsh–Hadamard transform before their FP4 fake
    quantization; transformers does not rotate. With fake quantization off the rotation cancels in q·k."""
    from mini.ops.indexer import hadamard

    g = torch.Generator().manual_seed(7)
    di = CONFIG.index_head_dim
    eye = torch.eye(di)
    assert torch.allclose(hadamard(eye) @ hadamard(eye).T, eye, atol=1e-6)
    q, k = torch.randn(37, 8, di, generator=g), torch.randn(53, di, generator=g)
    plain = torch.einsum("thd,nd->thn", q, k)
    rotated = torch.einsum("thd,nd->thn", hadamard(q), hadamard(k))
    assert torch.allclose(rotated, plain, rtol=1e-5, atol=1e-4)
    # with FP4 quantization between rotation and product it no longer cancels: hence no_fake_quant() below
    def fp4(x):
        return fake_quant_fp4(hadamard(x), 32, "ue8m0")

    quant = torch.einsum("thd,nd->thn", fp4(q), fp4(k))
    assert (quant - plain).abs().max() > 0.1
    with no_fake_quant():
        assert torch.equal(fake_quant_fp4(q, 32, "ue8m0"), q)


# ---------------------------------------------------------------------- transformers side
def test_topk_decisions_are_separated(run: Run):
    """Every top-k decision transformers made (indexer groups, routed experts) has a relative gap of more than
    MIN_GAP between the last kept and the first dropped candidate, 10x the ~1e-6 relative fp32 rounding difference
    between the two implementations' hidden states: rounding cannot flip a decision, so the logits must agree."""
    assert len(run.index_scores) == 2 * (1 + DECODE_STEPS) and run.router_scores
    kept, ratio = CONFIG.index_topk, 4
    for scores in run.index_scores:  # [S, T], before transformers masks the groups a query cannot see yet
        S, T = scores.shape
        visible = torch.full((S,), T) if S == 1 else (torch.arange(S) + 1) // ratio
        for row, n in zip(scores, visible.tolist()):
            if n > kept:
                top = row[:n].sort(descending=True).values
                gap = (top[kept - 1] - top[kept]) / top.abs().max()
                assert gap > MIN_GAP, f"indexer near-tie: relative gap {gap:.3g}"
    for scores in run.router_scores:
        top = scores.sort(-1, descending=True).values
        k = CONFIG.n_activated_experts
        gap = (top[:, k - 1] - top[:, k]) / top.abs().amax(-1)
        assert gap.min() > MIN_GAP, f"router near-tie: relative gap {gap.min():.3g}"


def test_transformers_decode_matches_its_prefill(run: Run):
    """transformers' cache path (window tail, compressor buffers, overlap state) against one prefill of the same
    tokens: localises a decode mismatch below to mini or to transformers."""
    with torch.no_grad():
        full = run.hf(torch.tensor([run.tokens]), use_cache=False).logits[0]
    assert rel_err(full[:PROMPT_LEN], run.hf_logits[0]).max() <= REL_TOL
    assert rel_err(torch.stack(run.hf_logits[1:]), full[PROMPT_LEN:]).max() <= REL_TOL


# ---------------------------------------------------------------------- mini against transformers
def _mini_step(model, cache, chunks: list[tuple[tuple[int, list[int]], int, int]], tokens: list[int]):
    """One forward of mini over `chunks` = [((slot, blocks), start, end)]: logits of every row."""
    from mini.model import Batch, SeqChunk

    batch = Batch.build([SeqChunk(tokens[:end], start, *seq) for seq, start, end in chunks], CONFIG, "cpu")
    batch.logit_rows = torch.arange(batch.n_tokens)
    return model.forward(batch, cache)


def _hf_rows(run: Run, start: int, end: int) -> torch.Tensor:
    """transformers' logits for positions start..end-1: prefill rows, then its decode steps."""
    decoded = torch.stack(run.hf_logits[1:])
    return torch.cat([run.hf_logits[0], decoded])[start:end]


def test_mini_matches_transformers(run: Run):
    """Sequence A alone: prefill of the whole prompt (every position compared), then decode. Then sequence B joins
    the flat batch: it prefills the same prompt in two chunks while A decodes (the cut leaves a partial ratio-4
    group; the second chunk crosses the window) and decodes one position behind A."""
    from mini.model import KVCache

    model, config, _ = _load_mini(run.ckpt)
    cache = KVCache(config, n_slots=2, n_blocks=7, block_tokens=BLOCK_TOKENS, device="cpu", dtype=torch.float32)
    a, b, cut, P = (SLOT, BLOCKS), (0, [4, 6, 1]), 97, PROMPT_LEN
    steps = [[(a, 0, P)], [(a, P, P + 1)], [(a, P + 1, P + 2), (b, 0, cut)], [(b, cut, P), (a, P + 2, P + 3)]]
    steps += [[(a, P + k, P + k + 1), (b, P + k - 3, P + k - 2)] for k in range(3, DECODE_STEPS)]
    with no_fake_quant():
        for n, chunks in enumerate(steps):
            got = _mini_step(model, cache, chunks, run.tokens)
            want = torch.cat([_hf_rows(run, start, end) for _, start, end in chunks])
            err = rel_err(got, want)
            if err.max() > REL_TOL:
                where = f"step {n} {[(slot, start, end) for (slot, _), start, end in chunks]}"
                bad = int((err > REL_TOL).sum())
                pytest.fail(f"{where}: {bad} rows off, max relative error {err.max():.3g}"
                            + ("; " + _first_divergence(run, model) if n == 0 else ""))
            assert torch.equal(got.argmax(-1), want.argmax(-1))  # the greedy tokens agree


def _load_mini(ckpt: str):
    from mini.model import load_model

    model, config, tokenizer = load_model(ckpt, "cpu", torch.float32)
    assert config == CONFIG
    return model, config, tokenizer


def _first_divergence(run: Run, model) -> str:
    """On failure: the first sub-layer (attention / MoE of which layer) whose prefill output differs, from hooks
    on transformers' modules and wrappers around mini's per-layer calls."""
    import mini.model.model as mm

    hf_out, mini_out = [], []
    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: hf_out.append((n, (out[0] if isinstance(
        out, tuple) else out)[0].detach())))
             for i, layer in enumerate(run.hf.model.layers)
             for n, m in ((f"layer {i} attention", layer.self_attn), (f"layer {i} moe", layer.mlp))]
    with torch.no_grad():
        run.hf(torch.tensor([run.tokens[:PROMPT_LEN]]), use_cache=False)
    for h in hooks:
        h.remove()
    attention, ffn = mm.attention, mm.Model._ffn
    mm.attention = lambda *a, **k: _keep(mini_out, attention(*a, **k))
    mm.Model._ffn = lambda *a, **k: _keep(mini_out, ffn(*a, **k))
    try:
        from mini.model import KVCache

        cache = KVCache(CONFIG, 2, 7, BLOCK_TOKENS, "cpu", torch.float32)
        _mini_step(model, cache, [((SLOT, BLOCKS), 0, PROMPT_LEN)], run.tokens)
    finally:
        mm.attention, mm.Model._ffn = attention, ffn
    for (name, ref), got in zip(hf_out, mini_out):
        err = rel_err(got.float(), ref)
        if err.max() > REL_TOL:
            return f"first divergence: {name} at position {int((err > REL_TOL).nonzero()[0])} (max {err.max():.3g})"
    return "no sub-layer output differs (the final hc_head / norm / head?)"


def _keep(store: list, out: torch.Tensor) -> torch.Tensor:
    store.append(out.detach())
    return out
