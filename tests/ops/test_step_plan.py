"""A step's plan (mini.ops.step_plan): each op's rule asked once per step, kept on the step's layout, renewed when
a choice it was made under changes, and what the model's layers run."""
import torch

import mini.ops
from mini.checkpoint.make import random_state
from mini.checkpoint.tiny_tokenizer import build_tiny_tokenizer
from mini.config import preset
from mini.model import Batch, Model, SeqChunk
from mini.ops import attention, indexer, moe
from mini.ops.engram import EngramHasher
from mini.ops.step_plan import plan_step
from mini.tokenizer import compressed_token_map

CPU = torch.device("cpu")


def test_each_rule_answers_for_the_step():
    ref = plan_step(4096, CPU, torch.bfloat16)  # on the CPU the fast path serves nothing (no interpreter)
    assert (ref.fast, ref.gate, ref.experts, ref.tie_rule) == (False, "unfused", "reference", "official")
    assert moe.gate_kernel(4096, torch.bfloat16, fast=True) == "fused"
    for tokens in (1, 64, 65, moe.FUSED_GATE_MIN_TOKENS - 1):  # decode, verify steps, short prefill chunks
        assert moe.gate_kernel(tokens, torch.bfloat16, fast=True) == "few_rows"
    assert "from 1024 tokens" in str(plan_step(1, CPU, torch.bfloat16))
    assert moe.gate_kernel(1, torch.float32, fast=True) == "unfused"
    assert moe.gate_kernel(4096, torch.float32, fast=True) == "unfused"
    with mini.ops.deterministic_mode():
        assert plan_step(4096, CPU, torch.bfloat16).tie_rule == "newer"
        assert moe.gate_kernel(1, torch.bfloat16, fast=True) == "fused"  # the token count does not choose
    assert indexer.tie_rule(fast=True) == "newer"
    assert "indexer ties: official" in str(ref) and "routed experts: reference" in str(ref)


def _tiny():
    cfg = preset("tiny-v4.1")
    model = Model(cfg, random_state(cfg, seed=0), "cpu", torch.float32)
    model.hasher = EngramHasher(cfg, compressed_token_map(build_tiny_tokenizer(cfg.vocab_size)))
    return model


def test_the_layers_run_the_plan_their_layout_keeps(monkeypatch):
    """One forward asks the attention rule once per layer kind (pool or none, the pool's shape), not per layer; the
    plan is the layout's, read again from it while the choices stand, and made anew when one changes."""
    model = _tiny()
    cfg = model.config
    asked = []
    rule = attention.core_kernel
    monkeypatch.setattr(attention, "core_kernel", lambda inp: asked.append(inp.with_pool) or rule(inp))
    cache = model.new_cache(2, 16, 16, "cpu", torch.float32)
    batch = Batch.build([SeqChunk(list(range(3, 60)), 0, 0, [0, 1, 2, 3])], cfg, "cpu", hasher=model.hasher)
    model.forward(batch, cache)
    lay = batch.layout(16, cfg.window_size)
    plan = lay.plan(torch.float32)
    assert lay.plan(torch.float32) is plan  # kept, not made again
    kinds = len(plan.attention_kernels)
    assert 1 < kinds == len(asked) < cfg.n_layers and set(plan.attention_kernels.values()) == {"reference"}
    with mini.ops.deterministic_mode():  # another choice: another plan, with the mode's rules
        assert lay.plan(torch.float32) is not plan and lay.plan(torch.float32).tie_rule == "newer"
    assert lay.plan(torch.float32) is plan


def test_the_plan_decides_what_the_ops_run(monkeypatch):
    """The ops follow the plan they are handed, not their own reading of the backend: a plan whose tie rule is
    "newer" ranks ties to the newer group on the reference backend too."""
    scores = torch.zeros(3, 8)
    tok_end = torch.tensor([8, 8, 16])
    plan = plan_step(3, CPU, torch.float32)
    assert indexer.tie_widths(scores, tok_end, 4, plan).tolist() == [2, 2, 4]
    monkeypatch.setattr(plan, "tie_rule", "newer")
    assert indexer.tie_widths(scores, tok_end, 4, plan) is None
    assert indexer.tie_widths(scores, tok_end, 4).tolist() == [2, 2, 4]  # without a plan: the rule for this call


def test_a_checked_kernel_follows_the_verdict_once_made(monkeypatch):
    """MINI_SPARSE_ATTN=auto: a step's plan names "flashmla-checked" for its first layer of a kind; once that layer's
    check settled the library, the later layers of the step run the verdict's kernel, not the check again."""
    from mini.kernels.attention_input import AttentionInput
    from mini.ops import backends
    inp = AttentionInput(*(torch.zeros(1),) * 8, 0.1)
    checks = []
    monkeypatch.setattr(attention, "_first_flashmla_call", lambda i, rows: checks.append(i) or "checked")
    monkeypatch.setattr(attention, "flashmla_attention", lambda *a, **kw: "flashmla")
    monkeypatch.setattr(backends, "_libraries", {"sparse_attn": "auto-flashmla"})
    assert attention._run("flashmla-checked", inp, None) == "checked" and len(checks) == 1
    monkeypatch.setattr(backends, "_libraries", {"sparse_attn": "flashmla"})  # the check kept FlashMLA
    assert attention._run("flashmla-checked", inp, None) == "flashmla" and len(checks) == 1


def test_decode_shaped_steps_take_flashmla_in_place_once_checked(monkeypatch):
    """A decode-shaped step over a KeyStore (flashmla.serves_in_place) runs FlashMLA in place under
    MINI_SPARSE_ATTN=flashmla; under auto its first eager call is the check, made on the in-place path itself, and
    the verdict then holds; MINI_SPARSE_ATTN=triton keeps our kernel."""
    from mini.kernels import flashmla_attention as flashmla
    from mini.kernels.attention_input import AttentionInput
    from mini.ops import backends
    inp = AttentionInput(*(torch.zeros(1, dtype=torch.bfloat16),) * 8, 0.1)
    monkeypatch.setattr(attention, "use_fast", lambda q: True)
    monkeypatch.setattr(attention, "_fast_supported", lambda q: True)
    monkeypatch.setattr(flashmla, "serves_in_place", lambda i: True)
    monkeypatch.setattr(flashmla, "serves", lambda i: False)
    monkeypatch.setattr(flashmla, "attend_in_place", lambda i, unrotate: "in place")
    checked = []
    monkeypatch.setattr(flashmla, "checked_first_call", lambda ours, theirs: checked.append(1) or (theirs(), None))
    monkeypatch.setattr(backends, "_libraries", {"sparse_attn": "flashmla"})
    assert attention.core_kernel(inp) == "flashmla-in-place" and attention._run("flashmla-in-place", inp, None) == \
        "in place"
    monkeypatch.setattr(backends, "_libraries", {"sparse_attn": "triton"})
    assert attention.core_kernel(inp) == "triton"
    monkeypatch.setattr(backends, "_libraries", {"sparse_attn": "auto-flashmla"})
    assert attention.core_kernel(inp) == "flashmla-checked"
    assert attention._run("flashmla-checked", inp, None) == "in place" and checked == [1]
    assert backends.sparse_attn() == "flashmla" and attention.core_kernel(inp) == "flashmla-in-place"
    assert attention._run("flashmla-checked", inp, None) == "in place" and checked == [1]  # a later layer: no check
