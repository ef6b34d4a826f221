"""Micro-benchmarks of the attention-side kernels at real V4.1-Flash shape (one EP4/DP4 rank: 4,096 tokens).

`python -m mini.bench.kernels [--json FILE] [--only NAME ...] [--sweep]` prints, per kernel, the median time
(triton.testing.do_bench on random data) and the achieved rate against the measured H200 ceilings (bf16 GEMM
804 TFLOP/s, device copy 4.26 TB/s; /work/shared/perf/README.md), plus the torch reference op where it fits.
Counting: attention 4·H·D FLOP per (query, key) (QK and PV); indexer 2·H·di per visible (query, group); the
memory-bound kernels count each input read once and each output written once.
"""
from __future__ import annotations

import argparse
import json

import torch

GEMM_TFLOPS, COPY_TBS = 804.0, 4.26
H, D, W, RATIO, TOPK, BLOCK_TOKENS = 64, 512, 128, 2, 512, 256
IH, IDI = 32, 128
HC, DIM = 4, 5120


def _bench(fn) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def _reference(fn):
    """Time the plain reference op: mini.ops would dispatch to the kernels themselves on CUDA."""
    import mini.ops

    def call():
        mini.ops.set_backend("reference")
        try:
            return fn()
        finally:
            mini.ops.set_backend("fast")
    return call


def _prefill_batch(T: int, start: int, ratio: int, dev):
    """One sequence: a chunk of T tokens starting at `start`, blocks in shuffled order."""
    end = start + T
    nb = -(-end // BLOCK_TOKENS)
    return dict(positions=torch.arange(start, end, device=dev), seq_of=torch.zeros(T, dtype=torch.long, device=dev),
                slots=torch.tensor([1], device=dev), start_pos=torch.tensor([start], device=dev),
                block_table=torch.randperm(nb + 5, device=dev)[:nb].to(torch.int32)[None], n_blocks=nb + 5)


def _decode_batch(B: int, pos: int, dev):
    nb = -(-(pos + 1) // BLOCK_TOKENS)
    return dict(positions=torch.full((B,), pos, device=dev), seq_of=torch.arange(B, device=dev),
                slots=torch.randperm(B, device=dev), start_pos=torch.full((B,), pos, device=dev),
                block_table=torch.randperm(B * nb, device=dev).view(B, nb).to(torch.int32), n_blocks=B * nb)


def bench_attention(rows: list, sweep: bool, dev="cuda"):
    from mini.kernels.sparse_attention import sparse_mla_attention
    from mini.ops.attention import sparse_attention as reference
    cases = [("prefill", 4096, _prefill_batch(4096, 4096, RATIO, dev)), ("decode", 128, _decode_batch(128, 9000, dev))]
    from mini.ops.rope import apply_rope, rope_frequencies, rope_table
    configs = [{}]  # the defaults: block_h 64, block_n 64, 8 warps, 2 stages
    if sweep:
        configs += [dict(block_h=64, block_n=32, num_warps=8, num_stages=2),
                    dict(block_h=64, block_n=32, num_warps=8, num_stages=3),
                    dict(block_h=64, block_n=16, num_warps=8, num_stages=3)]
    for name, T, b in cases:
        q = torch.randn(T, H, D, device=dev).bfloat16()
        kv_new = torch.randn(T, D, device=dev).bfloat16()
        window = torch.randn(int(b["slots"].max()) + 1, W, D, device=dev).bfloat16()
        comp = torch.randn(b["n_blocks"], BLOCK_TOKENS // RATIO, D, device=dev).bfloat16()
        sink = torch.randn(H, device=dev)
        vis = (b["positions"] + 1) // RATIO
        comp_idx = (torch.rand(T, TOPK, device=dev) * vis[:, None]).long().sort(-1).values  # all valid
        args = (q, kv_new, window, sink, b["positions"], b["seq_of"], b["slots"], b["start_pos"], D ** -0.5)
        kw = dict(comp=comp, block_table=b["block_table"], comp_idx=comp_idx, ratio=RATIO)
        flops = 4 * H * D * T * (W + TOPK)
        key_bytes = T * (W + TOPK) * D * 2  # keys as gathered per query (mostly L2 hits)
        for cfg in configs:
            ms = _bench(lambda: sparse_mla_attention(*args, **kw, **cfg))
            rows.append(dict(kernel=f"sparse_attention/{name}", config=cfg or "default", ms=ms,
                             tflops=flops / ms / 1e9, frac_gemm_peak=flops / ms / 1e9 / GEMM_TFLOPS,
                             gathered_tbs=key_bytes / ms / 1e9))
        # what the layer runs: the output's inverse RoPE in the epilogue vs a separate apply_rope pass (before)
        table = rope_table(b["positions"], rope_frequencies(64, 160000.0, 65536, 16.0))
        for label, f in (("before: + apply_rope(inverse) pass",
                          lambda: apply_rope(sparse_mla_attention(*args, **kw), table, inverse=True)),
                         ("after: rope_out in the epilogue", lambda: sparse_mla_attention(*args, **kw,
                                                                                          rope_out=table))):
            ms = _bench(f)
            rows.append(dict(kernel=f"sparse_attention+rope/{name}", config=label, ms=ms, tflops=flops / ms / 1e9,
                             frac_gemm_peak=flops / ms / 1e9 / GEMM_TFLOPS))
        if name == "prefill":
            ms = _bench(_reference(lambda: reference(*args, **kw)))
            rows.append(dict(kernel=f"sparse_attention/{name}", config="torch reference", ms=ms,
                             tflops=flops / ms / 1e9))


def bench_flashmla(rows: list, sweep: bool, dev="cuda"):
    """The sparse attention core through FlashMLA's sparse prefill kernel (MINI_SPARSE_ATTN=flashmla) vs our Triton
    kernel, both with the output's inverse RoPE (what the layer runs). Cases: rank4's (4,096 tokens from position
    0, a ratio-4 layer's top-512: early queries see fewer groups, -1 padded) and the attention bench's (at 4,096,
    ratio 2, 512 valid groups). The op path = scratch (StepRows) + kernel + in-place RoPE of the rotated channels,
    timed as a step's first layer (nothing kept) and as a later layer of the same index source (row lists kept);
    the kernel rows time the library alone on a prebuilt scratch, with and without the valid-first compaction
    (topk_length); the scratch rows time the first (sorted, per layer) scratch_keys against StepRows' three cases.
    `tflops` counts the keys actually read (4·H·D per query and key)."""
    import mini.ops.attention as attention_op
    from mini.kernels.flashmla_attention import TOPK_MULTIPLE, available, sparse_prefill
    from mini.kernels.sparse_attention import sparse_mla_attention
    from mini.ops.rope import apply_rope, rope_frequencies, rope_table
    if not available():
        rows.append(dict(kernel="sparse_core/flashmla", error="skipped: sgl-flash-mla does not import on an SM90 "
                                                              "GPU here (scripts/gpu.sh installs .whl/gpu)"))
        return
    T = 4096
    for name, start, ratio in (("rank4 prefill@0 ratio 4", 0, 4), ("prefill@4096 ratio 2", 4096, 2)):
        b = _prefill_batch(T, start, ratio, dev)
        q = torch.randn(T, H, D, device=dev).bfloat16()
        kv_new = torch.randn(T, D, device=dev).bfloat16()
        window = torch.randn(int(b["slots"].max()) + 1, W, D, device=dev).bfloat16()
        comp = torch.randn(b["n_blocks"], BLOCK_TOKENS // ratio, D, device=dev).bfloat16()
        sink = torch.randn(H, device=dev)
        vis = ((b["positions"] + 1) // ratio)[:, None]
        j = torch.arange(TOPK, device=dev)[None, :]
        few = torch.where(j < vis, j, -1)  # a query seeing <= TOPK groups reads them all
        comp_idx = torch.where(vis <= TOPK, few, (torch.rand(T, TOPK, device=dev) * vis).long()).sort(-1).values
        table = rope_table(b["positions"], rope_frequencies(64, 160000.0, 65536, 16.0))
        args = (q, kv_new, window, sink, b["positions"], b["seq_of"], b["slots"], b["start_pos"], D ** -0.5)
        kw = dict(comp=comp, block_table=b["block_table"], comp_idx=comp_idx, ratio=ratio, rope_out=table)
        src = (kv_new, window, b["positions"], b["seq_of"], b["slots"], b["start_pos"], comp, b["block_table"],
               comp_idx, TOPK_MULTIPLE)
        step = src[2:6]
        own = (kv_new, window, comp, b["block_table"], comp_idx, TOPK_MULTIPLE)  # a StepRows call's arguments
        kv, key_rows, count = attention_op.scratch_keys(*src)
        flops = 4 * H * D * float(count.sum())
        ours = sparse_mla_attention(*args, **kw)
        theirs = attention_op.flashmla_attention(*args, **kw)
        diff = (theirs.float() - ours.float()).flatten(1).norm(dim=1) / ours.float().flatten(1).norm(dim=1)
        kv_all, rows_all, count_all = attention_op.scratch_keys(*src, valid_first=False)

        kept = attention_op.step_rows(*step)  # a step's rows, built by its first layer
        attention_op.flashmla_attention(*args, **kw, key_rows=kept)
        warm = attention_op.step_rows(*step)
        warm.scratch_keys(*own)

        def new_source():  # the step's window rows kept, the row lists built
            warm.lists = None
            return warm.scratch_keys(*own)

        rotated = q.clone()  # rotated again at every repetition: the time does not depend on the values

        def tail_rope():
            tail = rotated[..., -2 * table.shape[-1]:]
            return tail.copy_(apply_rope(tail, table, inverse=True))

        kernels = [("triton (rope_out in the epilogue)", lambda: sparse_mla_attention(*args, **kw)),
                   ("flashmla op, a step's first layer (StepRows cold)",
                    lambda: attention_op.flashmla_attention(*args, **kw, key_rows=attention_op.step_rows(*step))),
                   ("flashmla op, a layer sharing its source's top-k ids (rows kept)",
                    lambda: attention_op.flashmla_attention(*args, **kw, key_rows=kept)),
                   ("flashmla kernel, valid-first rows + topk_length",
                    lambda: sparse_prefill(q, kv, key_rows, count, sink, D ** -0.5)),
                   ("flashmla kernel, rows as built (count = n)",
                    lambda: sparse_prefill(q, kv_all, rows_all, count_all, sink, D ** -0.5))]
        parts = [("scratch_keys alone (before: sorted lists per layer)", lambda: attention_op.scratch_keys(*src)),
                 ("StepRows scratch, a step's first layer", lambda: attention_op.step_rows(*step).scratch_keys(*own)),
                 ("StepRows scratch, an index source's first layer", new_source),
                 ("StepRows scratch, a layer sharing its source's ids", lambda: warm.scratch_keys(*own)),
                 ("inverse rope pass alone (before)", lambda: apply_rope(q, table, inverse=True)),
                 ("inverse rope of the rotated channels in place", tail_rope)]
        for i, (label, f) in enumerate(kernels + parts):
            ms = _bench(f)
            row = dict(kernel=f"sparse_core/{name}", config=label, ms=ms)
            if i < len(kernels):
                row.update(tflops=flops / ms / 1e9, frac_gemm_peak=flops / ms / 1e9 / GEMM_TFLOPS,
                           keys_per_query=float(count.float().mean()), rows_per_query=key_rows.shape[1])
            if label.startswith("flashmla op"):
                row.update(max_token_rel_err_vs_triton=float(diff.max()))
            rows.append(row)


def bench_indexer(rows: list, sweep: bool, dev="cuda"):
    from mini.kernels.indexer_scores import index_scores
    from mini.ops.indexer import index_scores as reference, top_groups, topk_recent
    T, start, ratio = 4096, 4096, 1
    b = _prefill_batch(T, start, ratio, dev)
    rpb = BLOCK_TOKENS // ratio
    N = (start + T) // ratio
    j = torch.arange(N, device=dev)
    seq_rows = (b["block_table"][0, j // rpb].long() * rpb + j % rpb)[None]
    keys = torch.randn(b["n_blocks"] * rpb, IDI, device=dev).bfloat16()
    q = torch.randn(T, IH, IDI, device=dev).bfloat16()
    w = (torch.randn(T, IH, device=dev) * 0.02).bfloat16()
    n_vis = (b["positions"] + 1) // ratio
    args = (q, w, keys, seq_rows, b["seq_of"], n_vis)
    flops = 2 * IH * IDI * float(n_vis.sum())
    configs = [dict(block_t=4, block_n=64)]
    if sweep:
        configs += [dict(block_t=2, block_n=128), dict(block_t=4, block_n=128, num_stages=3),
                    dict(block_t=2, block_n=64, num_stages=3)]
    for cfg in configs:
        ms = _bench(lambda: index_scores(*args, **cfg))
        rows.append(dict(kernel="indexer/scores", config=cfg, ms=ms, tflops=flops / ms / 1e9,
                         frac_gemm_peak=flops / ms / 1e9 / GEMM_TFLOPS))
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
    ms = _bench(_reference(lambda: reference(*args)))
    rows.append(dict(kernel="indexer/scores", config="torch reference", ms=ms, tflops=flops / ms / 1e9))


def bench_mhc(rows: list, sweep: bool, dev="cuda"):
    """mhc_norm at one V4.1 site (delayed pre): the floor is h read once + y written once (~210 MB, ~49 us at the
    copy ceiling). The kernel itself moves h once, y three times (written by the split-K pass, read and written
    by the normalisation): `moved_tbs` counts those bytes."""
    from mini.kernels.mhc_norm import mhc_norm
    from mini.ops import mhc
    from mini.ops.norm import rms_norm
    T = 4096
    h = torch.randn(T, HC, DIM, device=dev).bfloat16()
    fn = torch.randn((2 + HC) * HC, HC * DIM, device=dev) * 0.01
    scale, base = torch.rand(3, device=dev), torch.randn((2 + HC) * HC, device=dev)
    nw = torch.rand(DIM, device=dev).bfloat16()
    pre_prev = torch.rand(T, HC, device=dev)
    kw = dict(pre_in=pre_prev, iters=20, hc_eps=1e-6, norm_eps=1e-20)
    nbytes = h.numel() * 2 + T * DIM * 2 + fn.numel() * 4  # h once, y once, fn once
    moved = nbytes + 2 * T * DIM * 2
    configs = [{}]  # the defaults: block_t=64, block_k=16, split=8, 4 warps, 3 stages; finish 8 tokens x 512
    if sweep:
        # the neighbours of the default among the 35 configurations of docs/perf/raw/mhc2 (the default was fastest)
        configs += [dict(block_k=16, num_stages=4, split=6), dict(block_k=16, num_stages=2, split=10),
                    dict(block_k=16, split=20), dict(block_k=32), dict(finish_block_t=4)]
    for cfg in configs:
        for quant in ((None, "fp8") if cfg is configs[0] else (None,)):
            ms = _bench(lambda: mhc_norm(h, fn, scale, base, nw, **kw, quant=quant, **cfg))
            rows.append(dict(kernel=f"mhc_norm/quant={quant}", config=cfg or "default", ms=ms,
                             tbs=nbytes / ms / 1e9, frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS,
                             moved_tbs=moved / ms / 1e9))
    ms = _bench(lambda: mhc_norm(h, fn, scale, base, nw, **dict(kw, pre_in=None)))
    rows.append(dict(kernel="mhc_norm/V4 own pre (h read twice)", config="default", ms=ms,
                     tbs=nbytes / ms / 1e9, frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS))
    ms = _bench(lambda: mhc_norm(h, fn, scale, base, None, pre_in=None, iters=20, hc_eps=1e-6, norm_eps=1e-20,
                                 collapse=False))
    rows.append(dict(kernel="mhc_norm/mixes only", config="default", ms=ms, tbs=h.numel() * 2 / ms / 1e9,
                     frac_copy_peak=h.numel() * 2 / ms / 1e9 / COPY_TBS))
    ms = _bench(_reference(lambda: mhc.mixes(h, fn, scale, base, hc_mult=HC, iters=20, hc_eps=1e-6,
                                                norm_eps=1e-20)))
    rows.append(dict(kernel="mhc_norm/mixes only", config="torch reference", ms=ms, tbs=h.numel() * 2 / ms / 1e9))

    def ref():
        mhc.mixes(h, fn, scale, base, hc_mult=HC, iters=20, hc_eps=1e-6, norm_eps=1e-20)
        return rms_norm(mhc.collapse(h, pre_prev), nw, 1e-20)
    ms = _bench(_reference(ref))
    rows.append(dict(kernel="mhc_norm", config="torch reference", ms=ms, tbs=nbytes / ms / 1e9))


def bench_rope(rows: list, sweep: bool, dev="cuda"):
    from mini.formats import fake_quant_fp8
    from mini.kernels.rope_quant import rope_quant
    from mini.ops.norm import rms_norm
    from mini.ops.rope import apply_rope, rope_frequencies, rope_table
    T = 4096
    table = rope_table(torch.arange(T, device=dev) + 4096, rope_frequencies(64, 160000.0, 65536, 16.0))
    q = torch.randn(T, H, D, device=dev).bfloat16()
    kv = torch.randn(T, D, device=dev).bfloat16()
    nw = torch.rand(D, device=dev).bfloat16()
    for name, fn, ref, nbytes in [
        ("rope_quant/q rope", lambda: rope_quant(q, table), lambda: apply_rope(q, table), 2 * q.numel() * 2),
        ("rope_quant/kv norm+rope+fp8", lambda: rope_quant(kv, table, norm_weight=nw, eps=1e-20, quant="fp8"),
         lambda: fake_quant_fp8(apply_rope(rms_norm(kv, nw, 1e-20), table), 32), 2 * kv.numel() * 2)]:
        for label, f in (("triton", fn), ("torch reference", _reference(ref))):
            ms = _bench(f)
            rows.append(dict(kernel=name, config=label, ms=ms, tbs=nbytes / ms / 1e9,
                             frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS))


def bench_rope_chains(rows: list, sweep: bool, dev="cuda"):
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


def bench_attn_glue(rows: list, sweep: bool, dev="cuda"):
    """GEMM glue of the attention layer, before / after: the grouped wo_a projection (einsum + transposing copy vs
    a batched GEMM writing [T, G, r]) and the ratio-2 compressor's fp32 projections (fp32 FMA GEMM vs a bf16
    tensor-core GEMM with an fp32 result)."""
    import torch.nn.functional as F

    from mini.model.attn_layer import _grouped_out_proj
    from mini.ops.compressor import _linear_fp32
    T, G, R = 4096, 8, 1024
    o = torch.randn(T, G, H * D // G, device=dev).bfloat16()
    wo_a = (torch.randn(G, R, H * D // G, device=dev) * 0.02).bfloat16()
    flops = 2 * T * H * D * R
    for label, f in (("before: einsum + flatten copy", lambda: torch.einsum("tgd,grd->tgr", o, wo_a).flatten(1)),
                     ("after: bmm into [T, G, r]", lambda: _grouped_out_proj(o, wo_a))):
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


def bench_norm(rows: list, sweep: bool, dev="cuda"):
    from mini.formats import fake_quant_fp8
    from mini.kernels.mhc_norm import rms_norm
    from mini.ops.norm import rms_norm as reference
    for D in (5120, 1280):
        x = torch.randn(4096, D, device=dev).bfloat16()
        w = torch.rand(D, device=dev).bfloat16()
        nbytes = 2 * x.numel() * 2
        for label, f in (("triton", lambda: rms_norm(x, w, 1e-20)),
                         ("triton +fp8", lambda: rms_norm(x, w, 1e-20, "fp8")),
                         ("torch reference +fp8", _reference(lambda: fake_quant_fp8(reference(x, w, 1e-20), 32)))):
            ms = _bench(f)
            rows.append(dict(kernel=f"rms_norm/[4096,{D}]", config=label, ms=ms, tbs=nbytes / ms / 1e9,
                             frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS))


BENCHES = {"attention": bench_attention, "flashmla": bench_flashmla, "indexer": bench_indexer, "mhc": bench_mhc,
           "rope": bench_rope, "rope_chains": bench_rope_chains, "attn_glue": bench_attn_glue, "norm": bench_norm}


def add_args(parser: argparse.ArgumentParser, benches: dict = BENCHES) -> None:
    parser.add_argument("--only", nargs="*", choices=list(benches), default=list(benches))
    parser.add_argument("--sweep", action="store_true", help="also time alternative tile configurations")


def run(args, benches: dict = BENCHES) -> dict:
    torch.manual_seed(0)
    rows: list = []
    for name in args.only:
        try:
            benches[name](rows, args.sweep)
        except Exception as e:  # one failing kernel must not hide the others' numbers
            rows.append(dict(kernel=name, error=f"{type(e).__name__}: {e}"[:300]))
        print("\n".join(json.dumps(r) for r in rows[-8:]), flush=True)
    metrics = {f"{r['kernel']}|{r.get('config')}|ms": r["ms"] for r in rows if "ms" in r}
    return {"suite": "kernels", "definition": {"device": torch.cuda.get_device_name(), "tokens": 4096,
                                               "sweep": bool(args.sweep)}, "metrics": metrics, "rows": rows}


def main(argv=None, benches: dict = BENCHES, prog: str | None = None) -> None:
    """Run `benches` (default: the suite's) and print a table: `python -m mini.bench.kernels`, tools/mhc_split.py."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_args(parser, benches)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    res = run(args, benches)
    print(f"\n{'kernel':44s} {'config':58s} {'ms':>8s}  rate")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['kernel']:44s} ERROR {r['error']}")
            continue
        rate = " ".join(f"{k}={r[k]:.3g}" for k in ("tflops", "frac_gemm_peak", "tbs", "frac_hbm_peak",
                                                     "frac_copy_peak", "moved_tbs", "gathered_tbs",
                                                     "max_token_rel_err_vs_triton") if k in r)
        rate += f" bits={r['bits']}" if "bits" in r else ""
        print(f"{r['kernel']:44s} {str(r['config'])[:58]:58s} {r.get('ms', float('nan')):8.4f}  {rate}")
    if args.json:
        from mini.testing.suites import environment, write_result
        write_result(args.json, {**res, "env": environment()})


if __name__ == "__main__":
    main()
