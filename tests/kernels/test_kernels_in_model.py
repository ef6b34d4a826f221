"""Every call the tiny V4.1 model makes to the dispatched ops (sparse attention, indexer scores, RoPE, the fused
norm + RoPE + fake quant, mHC mixes, the attention side's RMSNorms, Engram's gate), with its real arguments (paged
pools, rings, chunked prefill of two sequences), gives the same result through the Triton kernel (interpreter,
fp32) as through the reference op. End-to-end logits are not compared: a 1e-6 relative change of the attention
output alone moves the tiny random model's logits by up to ~0.5 through FP8 / top-k flips (checked on the reference
itself), so per-call parity is the meaningful check."""
import pytest
import torch

from mini.checkpoint.make import random_state
from mini.checkpoint.tiny_tokenizer import build_tiny_tokenizer
from mini.config import preset
from mini.model import Batch, KVCache, Model, SeqChunk
from mini.ops.engram import EngramHasher
from mini.tokenizer import compressed_token_map

pytestmark = pytest.mark.usefixtures("reference_ops")


@pytest.mark.slow
def test_kernels_match_reference_ops_inside_tiny_model(interpreter, monkeypatch):
    import mini.model.attn_layer as attn_layer
    import mini.ops.compressor as compressor_ops
    import mini.ops.engram as engram_ops
    import mini.ops.mhc as mhc_ops
    from mini.kernels.engram_gate import engram_gate
    from mini.kernels.indexer_scores import index_scores
    from mini.kernels.mhc_norm import mhc_norm
    from mini.kernels.rms_norm import rms_norm
    from mini.kernels.rope_quant import rope_quant, supported
    from mini.kernels.sparse_attention import sparse_mla_attention

    def kernel_mixes(h, fn, scale, base, *, hc_mult, iters, hc_eps, norm_eps):
        return mhc_norm(h, fn, scale, base, None, pre_in=None, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps,
                        collapse=False)[1:]

    errors: dict[str, list[float]] = {}

    def compared(name, reference, kernel):
        def call(*args, **kw):
            ref, got = reference(*args, **kw), kernel(*args, **kw)
            for r, g in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,)):
                fin = r > float("-inf")
                assert torch.equal(fin, g > float("-inf"))
                errors.setdefault(name, []).append(float((g[fin] - r[fin]).abs().max()) if fin.any() else 0.0)
            return ref  # the model goes on with the reference result
        return call

    def kernel_attention(*args, key_rows=None, step=None, window_width=None, comp_valid=None, key_store=None, **kw):
        # the FlashMLA paths' rows and key store and the step's plan are not our kernel's; what the step's layers
        # share is (mini.ops.attention._run's mapping)
        return sparse_mla_attention(*args, width=window_width, comp_valid=comp_valid, **kw)

    monkeypatch.setattr(attn_layer, "sparse_attention", compared("attention", attn_layer.sparse_attention,
                                                                 kernel_attention))
    def kernel_index_scores(q, weights, keys, seq_rows, seq_of, n_visible, step_table=None, candidates=None):
        return index_scores(q, weights, keys, seq_rows, seq_of, n_visible, candidates)  # its grid plan: its own

    monkeypatch.setattr(attn_layer, "index_scores", compared("indexer", attn_layer.index_scores,
                                                             kernel_index_scores))
    monkeypatch.setattr(attn_layer, "apply_rope", compared("rope", attn_layer.apply_rope, rope_quant))
    chain = attn_layer.norm_rope_quant

    def fused(x, table, norm_weight=None, eps=0.0, quant=None, quant_block=32):
        if not supported(x.shape[-1], 2 * table.shape[-1], quant, quant_block):  # the op runs the chain then
            return chain(x, table, norm_weight, eps, quant, quant_block)
        kernel_shapes.add((x.shape[-1], quant))
        return rope_quant(x, table, False, norm_weight, eps, quant, quant_block)

    kernel_shapes: set = set()
    monkeypatch.setattr(attn_layer, "norm_rope_quant", compared("norm_rope_quant", chain, fused))
    monkeypatch.setattr(mhc_ops, "mixes", compared("mixes", mhc_ops.mixes, kernel_mixes))
    for module in (attn_layer, compressor_ops):
        monkeypatch.setattr(module, "rms_norm", compared("rms_norm", module.rms_norm, rms_norm))

    def kernel_gate(h, kv, gate_weight, eps, token_mask=None):
        return engram_gate(h, kv, gate_weight, eps, engram_ops.GATE_FLOOR, token_mask)
    monkeypatch.setattr(engram_ops, "gated_update", compared("engram_gate", engram_ops.gated_update, kernel_gate))

    cfg = preset("tiny-v4.1")
    hasher = EngramHasher(cfg, compressed_token_map(build_tiny_tokenizer(cfg.vocab_size)))
    model = Model(cfg, random_state(cfg, seed=0), "cpu", torch.float32)
    toks = [torch.randint(3, cfg.vocab_size, (n,)).tolist() for n in (45, 21)]
    cache = KVCache(cfg, 4, 16, 16, "cpu", torch.float32)
    steps = [[(toks[0][:37], 0, 2, [5, 1, 7]), (toks[1][:20], 0, 0, [3, 9])],  # prefill of both sequences
             [(toks[0], 37, 2, [5, 1, 7]), (toks[1], 20, 0, [3, 9])]]  # a chunk of 8 and a decode
    for step in steps:
        model.forward(Batch.build([SeqChunk(*c) for c in step], cfg, "cpu", hasher), cache)
    assert set(errors) == {"attention", "indexer", "rope", "norm_rope_quant", "mixes", "rms_norm", "engram_gate"}, \
        errors.keys()
    assert kernel_shapes, "the fused norm + RoPE + quant kernel never ran"
    for name, errs in errors.items():
        assert max(errs) < 1e-4, (name, max(errs))
