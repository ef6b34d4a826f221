"""The sparse attention core through FlashMLA's sparse prefill kernel against our Triton kernel at real V4.1-Flash
shape, with the parts of the FlashMLA op path (docs/kernels.md, attention; phase `flashmla` of scripts/gpu.sh):
run and printed as `python -m mini.bench.kernels` does:

    python3 tools/flashmla_core.py [--json FILE]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import kernels  # noqa: E402
from mini.bench.kernels import BLOCK_TOKENS, GEMM_TFLOPS, TOPK, D, H, W, _bench, _prefill_batch  # noqa: E402


def bench_flashmla(rows: list, sweep=(), dev="cuda"):
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


BENCHES = {"flashmla": bench_flashmla}

if __name__ == "__main__":
    kernels.main(benches=BENCHES, prog="tools/flashmla_core.py")
