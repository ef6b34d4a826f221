"""What runs for one forward step, and why: `plan_step` asks each op's rule once for a step (from the process's
record of choices, mini.ops.backends over mini.switches, and the step's size, device and activation dtype) and
returns a `StepPlan`. The step's layout keeps it (mini.model.layout.StepLayout.plan) and the model hands it to the
ops of every layer, which run what it says instead of deciding per call:

    fast        whether the fast path serves the step's tensors at all (mini.ops.fast_on)
    attention   the sparse attention core's kernel (mini.ops.attention.core_kernel, KERNELS says why), asked once
                per layer kind: whether the layer reads a compressed pool, and that pool's shape (FlashMLA's
                scratch grows with it)
    gate        "fused", "few_rows" or "unfused" (mini.ops.moe.gate_kernel; a layer whose gate the kernels do not
                cover, e.g. a hash-routed one, runs the unfused gate either way; "few_rows" for decode steps up to
                moe.FEW_ROWS_GATE_MAX_TOKENS tokens)
    experts     the routed experts' GEMMs: "humming", "triton" or "reference" (mini.ops.moe.experts_kernel)
    tie_rule    the indexer's ranking of equal scores: "official" or "newer" (mini.ops.indexer.tie_rule)

`str(plan)` says it in one line per op. Each rule lives beside its kernels in its op file; this module only asks
them, once per step. A plan holds for the choices it was made under (`choices`: the backends record, the CPU
interpreter, the fake quant, the ranking flag, the deterministic mode's attention switch, CUDA-graph capture): a
layout makes a new one when any of them changed since (a test switching backends between two forwards of one batch,
a static decode layout reused eagerly after its capture). Ops called without a plan (the EP exchange's pieces,
tests, tools) ask the same rules for that call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import mini.ops
from mini.formats.quant import fake_quant_enabled
from mini.kernels.attention_input import AttentionInput
from mini.ops import attention, backends, indexer, moe
from mini.ops.backends import Backends


def choices(device: torch.device) -> tuple:
    """Everything beside the step's shape that the rules read: a plan made under other choices is not reused."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return (backends.current(), mini.ops.interpreting_on_cpu(), fake_quant_enabled(), indexer.RANK_AS_OFFICIAL,
            attention.det_sparse_attn(), capturing)


def _layer_kind(inp: AttentionInput) -> tuple:
    """What the attention rule reads that differs between a step's layers: the pool and its shape, the dtypes."""
    pool = (tuple(inp.comp.shape), inp.comp.dtype) if inp.with_pool else None
    return pool, inp.q.dtype, tuple(inp.q.shape), inp.kv_new.dtype, tuple(inp.window.shape), inp.window.dtype


@dataclass
class StepPlan:
    tokens: int
    device: torch.device
    dtype: torch.dtype  # the activations'
    backends: Backends  # the record it was made from
    fast: bool
    gate: str
    experts: str
    tie_rule: str
    attention_kernels: dict[tuple, str] = field(default_factory=dict)  # per layer kind, filled as layers ask

    def attention(self, inp: AttentionInput) -> str:
        """The attention core's kernel for this step's layers of `inp`'s kind (`core_kernel`, asked once)."""
        kind = _layer_kind(inp)
        if kind not in self.attention_kernels:
            self.attention_kernels[kind] = attention.core_kernel(inp)
        return self.attention_kernels[kind]

    def __str__(self) -> str:
        kernels = sorted(set(self.attention_kernels.values()))
        lines = [f"step of {self.tokens} tokens, {str(self.dtype).removeprefix('torch.')} on {self.device}: "
                 f"{self.backends}; the fast path {'serves' if self.fast else 'does not serve'} it",
                 "attention: " + ("; ".join(f"{k} ({attention.KERNELS[k]})" for k in kernels)
                                  if kernels else "(asked by the first layer of each kind)"),
                 f"gate: {self.gate} " + ("(the kernels, in the layers whose gate they cover)"
                                          if self.gate != "unfused"
                                          else f"(torch ops: the gate kernels take bf16 steps of the fast path "
                                               + (f"up to {moe.FEW_ROWS_GATE_MAX_TOKENS} and "
                                                  if moe.FEW_ROWS_GATE_MAX_TOKENS > 0 else "")
                                               + f"from {moe.FUSED_GATE_MIN_TOKENS} tokens, or of any size in the "
                                               "deterministic mode)"),
                 f"routed experts: {self.experts} " + ("(the reference's loop over experts)"
                                                       if self.experts == "reference"
                                                       else "(grouped GEMMs, MINI_MOE_GEMM's library)"),
                 f"indexer ties: {self.tie_rule} "
                 + ("(the official reference's, by each sequence's width)" if self.tie_rule == "official"
                    else "(to the newer group, in every layout)")]
        return "\n".join(lines)


def plan_step(tokens: int, device: torch.device, dtype: torch.dtype) -> StepPlan:
    """The plan of a step of `tokens` rows of `dtype` activations on `device`, under the choices made now."""
    fast = mini.ops.fast_on(device)
    return StepPlan(tokens, device, dtype, backends.current(), fast, moe.gate_kernel(tokens, dtype, fast),
                    moe.experts_kernel(dtype, fast), indexer.tie_rule(fast))
