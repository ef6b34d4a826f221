"""FlashMLA's SM90 sparse prefill kernel (`sgl-flash-mla`, `flash_mla_sparse_fwd`) for the sparse attention core:
library adapter, called only from mini/ops/attention.py (which builds its inputs: `StepRows`, `scratch_keys`).

The kernel computes, per query token t and head h, over the key rows rows[t, :count[t]] of one bf16 tensor kv
(rows -1 or >= N skipped): o = Σ_j softmax_j(q·k_j·scale) k_j (K = V, all 512 channels), the denominator also
holding exp(sink[h]) (unscaled), fp32 logits and statistics, P rounded to bf16 before P·V, output bf16. That is
`mini.ops.attention.sparse_attention`'s arithmetic before its output RoPE. The SM90 build ("legacy" half of the
wheel, `use_legacy=True`) takes heads of width 512 and a row list whose length is a multiple of 128 (it walks it
two 64-row blocks at a time); `topk_length` (= count) lets a query stop after its valid rows. One CTA per (token,
64 heads), so it serves prefill-sized steps; decode steps stay on the Triton kernel (its decode path rejects
V4.1's cache formats anyway). Only 64 heads (V4.1-Flash) are used: 128 is in the kernel's feature list, but the
binary also carries a `params.h_q == 64` assertion of unknown scope and was only run at 64 heads.
"""
from __future__ import annotations

import functools

import torch

HEADS = (64,)
HEAD_DIM = 512  # d_v is fixed at 512, so with K = V the key width must be 512 too (576 would mean V = K[:512])
TOPK_MULTIPLE = 128
MIN_TOKENS = 512  # prefill-sized steps only; where the scratch building stops paying is a guess, not measured
# the scratch copies every key a step can touch, not only those it reads: skip steps where that is out of
# proportion (a ~1 KB row per key vs ~84 MFLOP of attention per token at V4.1's 64 heads x 640 keys)
SCRATCH_ROWS_PER_TOKEN = 32


@functools.cache
def available() -> bool:
    """Whether the library imports with its SM90 kernels and the current GPU is SM90."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import flash_mla
    except Exception:  # not installed, or its extension does not load against this torch / driver
        return False
    return flash_mla.has_legacy()


def supported(q: torch.Tensor, keys: list[torch.Tensor], scratch_rows: int) -> bool:
    """Whether this call is one the kernel serves: bf16 CUDA q [T, H, 512] with H in HEADS and bf16 key sources,
    a prefill-sized step, a scratch of `scratch_rows` rows in proportion, outside CUDA-graph capture."""
    T, H, D = q.shape
    return (q.is_cuda and q.dtype == torch.bfloat16 and all(k.dtype == torch.bfloat16 for k in keys)
            and H in HEADS and D == HEAD_DIM and T >= MIN_TOKENS and scratch_rows <= SCRATCH_ROWS_PER_TOKEN * T
            and not torch.cuda.is_current_stream_capturing() and available())


def sparse_prefill(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, count: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [T, H, 512] bf16, kv [N, 512] bf16, rows [T, n] int32 (n a multiple of TOPK_MULTIPLE, -1 = none), count
    [T] int32 (rows read per query), sink [H] -> [T, H, 512] bf16 (arithmetic in the module docstring)."""
    from flash_mla import flash_mla_sparse_fwd
    out = flash_mla_sparse_fwd(q.contiguous(), kv.unsqueeze(1), rows.unsqueeze(1), float(scale), d_v=q.shape[-1],
                               attn_sink=sink.float().contiguous(), topk_length=count, use_legacy=True)[0]
    if out.shape != q.shape or out.dtype != q.dtype:  # (output, max_logits, lse) is the documented return
        raise RuntimeError(f"flash_mla_sparse_fwd returned {tuple(out.shape)} {out.dtype} for q {tuple(q.shape)}")
    return out
