"""Shapes a fast-path kernel cannot take: the kernel refuses them with an error naming the shape, and the op's
dispatch falls back to the reference (the fuzzer's configs reach these; here each is checked on its own). Under the
interpreter on CPU (mini.ops.set_backend(..., interpret_on_cpu=True))."""
import pytest
import torch

import mini.ops


def _fast(fn, *args, **kw):
    mini.ops.set_backend("fast")
    try:
        return fn(*args, **kw)
    finally:
        mini.ops.set_backend("reference")


def _reference(fn, *args, **kw):
    mini.ops.set_backend("reference")
    return fn(*args, **kw)


def _never(monkeypatch, module: str, name: str):
    import importlib
    mod = importlib.import_module(module)

    def refuse(*a, **k):
        raise AssertionError(f"{module}.{name} was called for a shape it does not take")
    monkeypatch.setattr(mod, name, refuse)


def test_rope_with_a_tail_that_is_not_a_power_of_two(fast_on_cpu, monkeypatch):
    from mini.kernels.rope_quant import rope_quant, supported
    from mini.ops.rope import apply_rope, norm_rope_quant, rope_frequencies, rope_table
    x = torch.randn(5, 3, 96).bfloat16()
    table = rope_table(torch.arange(5), rope_frequencies(24, 10000.0))
    assert not supported(96, 24, None, 1)
    with pytest.raises(ValueError, match="RoPE 24"):
        rope_quant(x, table)
    _never(monkeypatch, "mini.kernels.rope_quant", "rope_quant")
    assert torch.equal(_fast(apply_rope, x, table), _reference(apply_rope, x, table))
    y = x[:, 0]
    assert torch.equal(_fast(norm_rope_quant, y, table, torch.ones(96), 1e-6, "fp8", 32),
                       _reference(norm_rope_quant, y, table, torch.ones(96), 1e-6, "fp8", 32))


def test_rope_over_the_whole_vector(fast_on_cpu, monkeypatch):
    """A head of RoPE alone (d == rope_dim, e.g. a 32-wide index head with a 32-wide RoPE tail) with a fake quant:
    the kernel's empty nope tile cannot be quantized, so it is refused and the torch ops run (it had been taken and
    failed to build); without a quant the kernel rotates it."""
    from mini.kernels.rope_quant import rope_quant, supported
    from mini.ops.rope import norm_rope_quant, rope_frequencies, rope_table
    y = torch.randn(5, 32).bfloat16()
    table = rope_table(torch.arange(5), rope_frequencies(32, 10000.0))
    assert not supported(32, 32, "fp8", 32) and supported(32, 32, None, 32)
    with pytest.raises(ValueError, match="RoPE 32"):
        rope_quant(y, table, quant="fp8")
    # the torch chain (its rotation may still take the kernel, without a quant)
    assert torch.equal(_fast(norm_rope_quant, y, table, torch.ones(32), 1e-6, "fp8", 32),
                       _reference(norm_rope_quant, y, table, torch.ones(32), 1e-6, "fp8", 32))


def test_attention_with_a_head_dim_that_is_not_a_power_of_two(fast_on_cpu, monkeypatch):
    from mini.kernels.sparse_attention import sparse_mla_attention, supported
    from mini.ops.attention import sparse_attention
    T, H, D, W = 6, 4, 96, 8
    q, kv = torch.randn(T, H, D).bfloat16(), torch.randn(T, D).bfloat16()
    window = torch.randn(2, W, D).bfloat16()
    args = (q, kv, window, torch.randn(H), torch.arange(T), torch.zeros(T, dtype=torch.long),
            torch.tensor([1]), torch.tensor([0]), D ** -0.5)
    assert not supported(D)
    with pytest.raises(ValueError, match="head dim 96"):
        sparse_mla_attention(*args)
    _never(monkeypatch, "mini.kernels.sparse_attention", "sparse_mla_attention")
    assert torch.equal(_fast(sparse_attention, *args), _reference(sparse_attention, *args))


def test_indexer_with_heads_that_are_not_a_power_of_two(fast_on_cpu, monkeypatch):
    from mini.kernels.indexer_scores import index_scores as kernel, supported
    from mini.ops.indexer import index_scores
    T, H, DI, N = 5, 3, 64, 4
    args = (torch.randn(T, H, DI).bfloat16(), torch.randn(T, H).bfloat16(), torch.randn(N, DI).bfloat16(),
            torch.arange(N)[None], torch.zeros(T, dtype=torch.long), torch.tensor([1, 2, 2, 3, 4]))
    assert not supported(H, DI)
    with pytest.raises(ValueError, match="3 heads"):
        kernel(*args)
    _never(monkeypatch, "mini.kernels.indexer_scores", "index_scores")
    assert torch.equal(_fast(index_scores, *args), _reference(index_scores, *args))


def test_mhc_expand_with_three_copies(fast_on_cpu, monkeypatch):
    from mini.kernels.mhc_expand import mhc_expand, supported
    from mini.ops.mhc import expand
    T, HC, D = 4, 3, 32
    args = (torch.randn(T, D).bfloat16(), torch.randn(T, HC, D).bfloat16(), torch.rand(T, HC),
            torch.rand(T, HC, HC))
    assert not supported(HC)
    with pytest.raises(ValueError, match="hc 3"):
        mhc_expand(*args)
    _never(monkeypatch, "mini.kernels.mhc_expand", "mhc_expand")
    assert torch.equal(_fast(expand, *args), _reference(expand, *args))
