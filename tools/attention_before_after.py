"""Finished before/after studies of the attention side at real V4.1-Flash shape (one EP4/DP4 rank: 4,096 tokens),
each a change that landed, timed against what ran before it (docs/perf/005, docs/kernels.md): run and printed as
`python -m mini.bench.kernels` does (phase `kernels` of scripts/gpu.sh runs them after the suite):

    python3 tools/attention_before_after.py [--only NAME ...] [--json FILE]

* `attention_rope`: the sparse attention output's inverse RoPE in the kernel's epilogue vs a separate pass;
* `indexer_topk`: the top-k of the indexer scores, fp32 scores with int64 keys sorted vs bf16 with int32 unsorted;
* `rope_chains`: the attention layer's norm / RoPE / quant producer chains, eager around the RoPE kernel vs fused;
* `attn_glue`: the grouped wo_a projection and the compressor's fp32 projections, the GEMM forms before and after.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import kernels  # noqa: E402
from mini.bench.kernels import (COPY_TBS, D, DIM, GEMM_TFLOPS, H, IDI, IH, TOPK, _bench,  # noqa: E402
                                attention_cases, indexer_case)


def bench_attention_rope(rows: list, sweep=(), dev="cuda"):
    """What the layer runs: the output's inverse RoPE in the epilogue vs a separate apply_rope pass (before)."""
    from mini.kernels.sparse_attention import sparse_mla_attention
    from mini.ops.rope import apply_rope, rope_frequencies, rope_table
    for name, positions, args, kw, flops in attention_cases(dev):
        table = rope_table(positions, rope_frequencies(64, 160000.0, 65536, 16.0))
        for label, f in (("before: + apply_rope(inverse) pass",
                          lambda: apply_rope(sparse_mla_attention(*args, **kw), table, inverse=True)),
                         ("after: rope_out in the epilogue", lambda: sparse_mla_attention(*args, **kw,
                                                                                          rope_out=table))):
            ms = _bench(f)
            rows.append(dict(kernel=f"sparse_attention+rope/{name}", config=label, ms=ms, tflops=flops / ms / 1e9,
                             frac_gemm_peak=flops / ms / 1e9 / GEMM_TFLOPS))


def bench_indexer_topk(rows: list, sweep=(), dev="cuda"):
    """The top-k groups of the indexer's scores: the keys as they were (fp32 scores, int64, sorted top-k) and as
    they are (bf16 scores as the model now gets them, int32, unsorted); both must pick the same groups."""
    from mini.kernels.indexer_scores import index_scores
    from mini.ops.indexer import top_groups, topk_recent
    args, _, N = indexer_case(dev)
    T = args[0].shape[0]
    scores = index_scores(*args)  # bf16, as the model now gets them
    f32 = scores.float()

    def before():  # int64 keys from fp32 scores, sorted top-k, then the ascending sort
        values, indices = topk_recent(f32, TOPK)
        return torch.where(values > float("-inf"), indices, -1).sort(dim=-1).values

    for label, f in (("before: fp32 scores, int64 keys, sorted top-k", before),
                     ("fp32 scores, int64 keys, unsorted", lambda: top_groups(f32, TOPK)),
                     ("after: bf16 scores, int32 keys, unsorted", lambda: top_groups(scores, TOPK))):
        ms = _bench(f)
        rows.append(dict(kernel=f"indexer/top_groups [{T},{N}] k={TOPK}", config=label, ms=ms))
    assert torch.equal(before(), top_groups(scores, TOPK)), "the key paths must pick the same groups"


def bench_rope_chains(rows: list, sweep=(), dev="cuda"):
    """The attention layer's producer chains, before (eager norm / quant around the RoPE kernel, what
    attn_layer ran until norm_rope_quant) and after (ops.rope.norm_rope_quant: one fused kernel)."""
    from mini.formats import fake_quant_fp4, fake_quant_fp8
    from mini.ops.norm import rms_norm
    from mini.ops.rope import apply_rope, norm_rope_quant, rope_frequencies, rope_table
    T = 4096
    table = rope_table(torch.arange(T, device=dev) + 4096, rope_frequencies(64, 160000.0, 65536, 16.0))
    kv, iq = torch.randn(T, D, device=dev).bfloat16(), torch.randn(T, IH, IDI, device=dev).bfloat16()
    ik = torch.randn(T, IDI, device=dev).bfloat16()
    nw, knw = torch.rand(D, device=dev).bfloat16(), torch.rand(IDI, device=dev).bfloat16()
    cases = [("window kv: norm+rope+fp8 [4096,512]", kv,
              lambda: fake_quant_fp8(apply_rope(rms_norm(kv, nw, 1e-20), table), 32),
              lambda: norm_rope_quant(kv, table, nw, 1e-20, "fp8", 32)),
             ("index q: rope+fp4 ue8m0 [4096,32,128]", iq,
              lambda: fake_quant_fp4(apply_rope(iq, table), 32, "ue8m0"),
              lambda: norm_rope_quant(iq, table, quant="fp4_ue8m0")),
             ("index k: norm+rope+fp4 ue8m0 [4096,128]", ik,
              lambda: fake_quant_fp4(apply_rope(rms_norm(ik, knw, 1e-20), table), 32, "ue8m0"),
              lambda: norm_rope_quant(ik, table, knw, 1e-20, "fp4_ue8m0")),
             ("compressed kv: rope+fp4 e4m3 [4096,512]", kv,
              lambda: fake_quant_fp4(apply_rope(kv, table), 16, "e4m3"),
              lambda: norm_rope_quant(kv, table, quant="fp4_e4m3", quant_block=16))]
    for name, x, before, after in cases:
        nbytes = 2 * x.numel() * 2
        for label, f in (("before: eager norm/quant + rope kernel", before), ("after: norm_rope_quant", after)):
            ms = _bench(f)
            rows.append(dict(kernel=name, config=label, ms=ms, tbs=nbytes / ms / 1e9,
                             frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS))


def bench_attn_glue(rows: list, sweep=(), dev="cuda"):
    """GEMM glue of the attention layer, before / after: the grouped wo_a projection (einsum + transposing copy vs
    a batched GEMM writing [T, G, r]) and the ratio-2 compressor's fp32 projections (fp32 FMA GEMM vs a bf16
    tensor-core GEMM with an fp32 result)."""
    import torch.nn.functional as F

    from mini.ops.linear import grouped_linear
    from mini.ops.compressor import _linear_fp32
    T, G, R = 4096, 8, 1024
    o = torch.randn(T, G, H * D // G, device=dev).bfloat16()
    wo_a = (torch.randn(G, R, H * D // G, device=dev) * 0.02).bfloat16()
    flops = 2 * T * H * D * R
    for label, f in (("before: einsum + flatten copy", lambda: torch.einsum("tgd,grd->tgr", o, wo_a).flatten(1)),
                     ("after: bmm into [T, G, r]", lambda: grouped_linear(o, wo_a))):
        ms = _bench(f)
        rows.append(dict(kernel="attn/wo_a grouped projection", config=label, ms=ms, tflops=flops / ms / 1e9,
                         frac_gemm_peak=flops / ms / 1e9 / GEMM_TFLOPS))
    x = torch.randn(T, DIM, device=dev).bfloat16()
    w = (torch.randn(2 * D, DIM, device=dev) * 0.02).bfloat16()
    wf = w.float()
    flops = 2 * T * DIM * 2 * D
    for label, f in (("before: fp32 F.linear", lambda: F.linear(x.float(), wf)),
                     ("after: bf16 GEMM, fp32 out", lambda: _linear_fp32(x, w))):
        ms = _bench(f)
        rows.append(dict(kernel="attn/compressor wkv+wgate [4096,5120]x[5120,1024]", config=label, ms=ms,
                         tflops=flops / ms / 1e9))


BENCHES = {"attention_rope": bench_attention_rope, "indexer_topk": bench_indexer_topk,
           "rope_chains": bench_rope_chains, "attn_glue": bench_attn_glue}

if __name__ == "__main__":
    kernels.main(benches=BENCHES, prog="tools/attention_before_after.py")
