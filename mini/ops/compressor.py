"""KV compressor (spec §2.4.4): pools `ratio` consecutive tokens into one latent, carrying open groups across steps.

* ratio 1 (V4.1): `norm(wkv(x))` per token, bf16 weights, no gate.
* ratio > 1: `kv = wkv(x)`, `score = wgate(x) (+ ape[pos % ratio], V4)` in fp32 (bf16 x and weights promoted;
  with the fast backend on the GPU one bf16 tensor-core GEMM with an fp32 result: the same exact products); each
  channel is softmax-pooled over the group's tokens. V4 ratio 4 overlaps: group j pools group j-1's tokens on
  channel half 0 and its own on half 1 (group -1 is kv 0 / score -inf). The pooled latent is cast to x.dtype and
  RMS-normed.
The result is pre-RoPE: the caller makes index keys from it, then rotates it at position j·ratio and quantizes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F

from mini.ops import use_fast
from mini.ops.norm import rms_norm


@dataclass
class GroupIndex:
    """The compressed groups completed by this step for one (ratio, overlap) kind, G groups in all."""
    seq: torch.Tensor  # [G] sequence of the batch
    group: torch.Tensor  # [G] absolute group id j
    pos: torch.Tensor  # [G] the group's position for RoPE: j * ratio (its first token)
    pool_row: torch.Tensor  # [G] flat row of the paged pools
    member_row: torch.Tensor  # [G, M] chunk row of each pooled token, -1 when it is not in the chunk
    member_state: torch.Tensor  # [G, M] flat state row of each pooled token from an earlier step, -1 when not
    write_row: torch.Tensor | None  # [n] chunk rows that belong to groups still open after the step (None: all) ...
    write_state: torch.Tensor  # [n] ... and the flat state rows they are kept in

    @cached_property
    def member_reads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """How `compress` gathers the members: (chunk rows and state rows to read, -1 -> 0; [G, M, 1] from the chunk;
        [G, M, 1] from neither). The same for every compressor of the step's kind: built once (the layout keeps
        the GroupIndex), not twice per compressing layer (issue 28)."""
        return (self.member_row.clamp_min(0), self.member_state.clamp_min(0), (self.member_row >= 0)[..., None],
                ((self.member_row < 0) & (self.member_state < 0))[..., None])


@dataclass
class CompressorWeights:
    ratio: int
    overlap: bool
    wkv: torch.Tensor  # [coff·d, D]: x.dtype for ratio 1; otherwise bf16 as stored (promoted on use) or fp32
    wgate: torch.Tensor | None  # [coff·d, D] (ratio > 1), like wkv
    ape: torch.Tensor | None  # [ratio, coff·d] fp32 (V4)
    norm: torch.Tensor  # [d]

    @classmethod
    def from_state(cls, state: dict, prefix: str, ratio: int, overlap: bool, dtype) -> "CompressorWeights":
        def promoted(w):  # the reference promotes ratio > 1 weights to fp32: bf16 ones exactly, on use
            return w if w.dtype == torch.bfloat16 else w.float()

        gate = state.get(f"{prefix}.wgate.weight")
        ape = state.get(f"{prefix}.ape")
        wkv = state[f"{prefix}.wkv.weight"]
        return cls(ratio, overlap, wkv.to(dtype) if ratio == 1 else promoted(wkv),
                   None if gate is None else promoted(gate), None if ape is None else ape.float(),
                   state[f"{prefix}.norm.weight"])


def _linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 x·wᵀ of x and w promoted to fp32. With both in bf16 every product is exact in fp32, so on the GPU a bf16
    tensor-core GEMM with an fp32 result (0.03 ms instead of 0.43 ms for [4096, 5120] x [5120, 1024] with fp32
    FMAs) gives the same sums up to order and the tensor cores' truncation of their partial sums (~1e-5 of a sum
    over K = 5120, see mini/kernels/moe_gate.py), far below the bf16 rounding of what the compressor feeds."""
    if use_fast(x) and x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and _MM_OUT_DTYPE:  # (CUDA-only mm)
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
    return F.linear(x.float(), w.float())


_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(..., out_dtype=) (CUDA), not in every release


def compress(x: torch.Tensor, w: CompressorWeights, positions: torch.Tensor, groups: GroupIndex,
             state_kv: torch.Tensor | None, state_score: torch.Tensor | None, eps: float,
             keep: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
    """x [T, D] (normed attention input), positions [T] -> latents [G, d] of the groups completed in this step, in
    `groups` order. Updates the state pools [n_slots, rows, width] in place with the still-open tokens. `keep`
    (ratio > 1) is handed every row's (kv, score) as the state would take them: a speculative verify step keeps its
    draft rows' to write the accepted ones later (mini.model.drafts)."""
    if w.ratio == 1:
        return rms_norm(F.linear(x, w.wkv.to(x.dtype)), w.norm, eps)
    kv, score = _linear_fp32(x, w.wkv), _linear_fp32(x, w.wgate)
    if w.ape is not None:
        score = score + w.ape[positions % w.ratio]
    if keep is not None:
        keep(kv, score)
    width = kv.shape[-1]
    flat_kv, flat_score = state_kv.view(-1, width), state_score.view(-1, width)

    chunk_row, state_row, in_chunk, in_neither = groups.member_reads

    def members(fresh: torch.Tensor, kept: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.where(in_chunk, fresh[chunk_row], kept[state_row]).masked_fill(in_neither, fill)

    m_kv, m_score = members(kv, flat_kv, 0.0), members(score, flat_score, float("-inf"))
    if w.overlap:  # previous group on the first channel half, this group on the second
        d, r = width // 2, w.ratio
        m_kv = torch.cat([m_kv[:, :r, :d], m_kv[:, r:, d:]], dim=1)
        m_score = torch.cat([m_score[:, :r, :d], m_score[:, r:, d:]], dim=1)
    latent = (m_kv * m_score.softmax(dim=1)).sum(dim=1)
    # the open tokens are written after the gather: their state rows may still hold members read above
    open_rows = slice(None) if groups.write_row is None else groups.write_row
    flat_kv[groups.write_state] = kv[open_rows]
    flat_score[groups.write_state] = score[open_rows]
    return rms_norm(latent.to(x.dtype), w.norm, eps)
