"""FlashMLA on a machine without it, for tests of the deterministic mode's split (mini.kernels.flashmla_attention.
attend_by_chunk_kind): its sparse prefill replaced by a per-row reference (each query alone over its own key list,
the reference op's online softmax), every shape "taken", the switches set to FlashMLA. A row's output then depends
on its own inputs only, as measured for FlashMLA on the H200, and its arithmetic differs from our Triton kernel's,
so a row sent to the wrong kernel shows."""
from __future__ import annotations

from typing import Callable

import torch


def reference_prefill(q, kv, rows, count, sink, scale):
    """mini.kernels.flashmla_attention.sparse_prefill's contract: out[t] = attention of q[t] over
    kv[rows[t, :count[t]]]."""
    from mini.ops.attention import _attend
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        keys = kv[rows[t, :int(count[t])].long()].float()[None]
        valid = torch.ones(keys.shape[:2], dtype=torch.bool)
        out[t] = _attend(q[t:t + 1], keys, valid, sink.float(), scale)[0].to(q.dtype)
    return out


def install(setattr: Callable) -> None:
    """Put the stand-in in place with `setattr(obj, name, value)` (pytest's monkeypatch.setattr: undone after the
    test)."""
    from mini.kernels import flashmla_attention as fm
    from mini.ops import attention
    setattr(fm, "sparse_prefill", reference_prefill)
    setattr(attention, "DET_SPARSE_ATTN", "flashmla")
    setattr(fm, "takes_model", lambda q, keys: True)
    setattr(attention.backends, "sparse_attn", lambda: "flashmla")
