"""Per-stage timing of a forward step: the recorder behind `mini profile`, `ep-prefill`'s and `rank4-decode`'s
stage rows and tools/det_profile.py.

Stages are the named ranges the model and op code marks (mini/ops/stages.py: `@staged` / `stage`); the profiler
times each marked call (CUDA events around it on the GPU, the wall clock on the CPU), so every stage is the GPU time
between its first and last kernel, launch gaps included:

    attention          mini.model.attn_layer.attention (whole)  = sparse core + key gathering + indexer + other
      sparse core      mini.ops.attention.sparse_attention (the kernel reads window / pool keys by index)
      key gathering    mini.model.attn_layer._compressed_ids (top-k groups -> pool rows; no key tensor is built)
      indexer + top-k  mini.model.attn_layer._index
    gate               mini.ops.moe.gate
    routed experts     mini.ops.moe.routed = act quant + routing plan + w1/w3 GEMM + w2 GEMM + combine
                       (Humming backend: act quant with the row gather + plan + both GEMMs + SwiGLU + combine)
    shared expert      mini.ops.moe.shared
    ep emulation       the rest of the MoE (Model._ffn: mini.testing.emulated_ep.EmulatedEP's synthetic remote rows, the
                       own-row slice, the sum)
    communication      0 here: one GPU emulates an EP4 rank (the exchange is measured on 2 GPUs)
    hc / norm / other  mHC pre-norm (mixes, collapse, RMSNorm) and expand, the final RMSNorm, Engram
    unattributed       step - everything above (embedding, head, Python between stages)

On real EP ranks (`staged_with_exchange`) the exchange's collectives are timed as `communication` instead
of the emulation: the calls and their `wait()`s (exposed communication), `exchange_report` splits the MoE
stage's remainder into communication and exchange glue.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from mini.ops.stages import recording
from mini.parallel import exchange as exchange_mod

# the stages timed; a stage "a.b" whose parent "a" is one of them counts only the calls made inside a call of the
# parent (the FP8 act quant of the routed experts, not the one every linear layer runs)
STAGES = ("attention", "attention.sparse_core", "attention.key_gathering", "attention.indexer_topk",
          "moe", "moe.gate", "moe.routed", "moe.routed.act_quant", "moe.routed.route_plan",
          "moe.routed.gemm_w13_swiglu", "moe.routed.gemm_w2",
          "moe.routed.gemm_humming", "moe.routed.swiglu",  # with the Humming backend (MINI_MOE_GEMM)
          "moe.routed.combine", "moe.shared",
          # pre_norm = mixes + collapse + the site's RMSNorm (one fused kernel on the fast path)
          "hc_norm_other.mhc", "hc_norm_other.norm", "hc_norm_other.engram")


class StageTimer:
    """A stage recorder (mini.ops.stages.recording): each call of one of `stages` records its time."""

    def __init__(self, cuda: bool, stages: tuple[str, ...] = STAGES):
        self.cuda, self.stages = cuda, stages
        self.pending: dict[str, list] = defaultdict(list)
        self._active: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, stage: str):
        parent = stage.rpartition(".")[0]
        if stage not in self.stages or (parent in self.stages and not self._active[parent]):
            yield
            return
        self._active[stage] += 1
        try:
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                yield
                b.record()
                self.pending[stage].append((a, b))
            else:
                t0 = time.perf_counter()
                yield
                self.pending[stage].append(1e3 * (time.perf_counter() - t0))
        finally:
            self._active[stage] -= 1

    def totals(self) -> dict[str, float]:
        """ms per stage, summed over every call so far."""
        if not self.cuda:
            return {s: sum(ps) for s, ps in self.pending.items()}
        torch.cuda.synchronize()
        return {s: sum(a.elapsed_time(b) for a, b in ps) for s, ps in self.pending.items()}


@contextmanager
def staged(cuda: bool):
    """Time the marked stages while open; yields the StageTimer."""
    timer = StageTimer(cuda)
    with recording(timer):
        yield timer


def report(totals: dict[str, float], step_ms: float, steps: int) -> dict[str, float]:
    """Per-step ms of each reported stage; parents minus their measured children give the 'other' parts."""
    t = {k: v / steps for k, v in totals.items()}
    g = t.get
    att = g("attention", 0.0)
    core, gather = g("attention.sparse_core", 0.0), g("attention.key_gathering", 0.0)
    idx = g("attention.indexer_topk", 0.0)
    moe_all = g("moe", 0.0)
    gate, routed, shared = g("moe.gate", 0.0), g("moe.routed", 0.0), g("moe.shared", 0.0)
    parts = {k.split(".")[-1]: v for k, v in t.items() if k.startswith("moe.routed.")}
    hc = sum(v for k, v in t.items() if k.startswith("hc_norm_other."))
    stages = {
        "sparse_attention_core": core,
        "key_gathering": gather,
        "indexer_topk": idx,
        "other_attention": att - core - gather - idx,
        "routed_experts": routed,
        **{f"routed.{k}": v for k, v in parts.items()},
        "routed.other": routed - sum(parts.values()),
        "gate": gate,
        "shared_expert": shared,
        "ep_emulation": moe_all - gate - routed - shared,
        "communication": 0.0,
        "hc_norm_other": hc,
        **{f"hc_norm_other.{k.split('.')[-1]}": v for k, v in t.items() if k.startswith("hc_norm_other.")},
    }
    top = att + moe_all + hc  # the top-level stages do not overlap
    stages["unattributed"] = step_ms - top
    stages["step"] = step_ms
    stages["unattributed_fraction"] = (step_ms - top) / step_ms
    return stages


# ---------------------------------------------------------------------------------------------- real EP ranks
class _Pending:
    """An async collective's handle whose `wait()` is timed (the exchange overlaps the shared expert with it)."""

    def __init__(self, work, timer):
        self.work, self.timer = work, timer

    def wait(self):
        with self.timer("communication.moe"):
            return self.work.wait()


COMMUNICATION = ("communication.moe", "communication.counts")


@contextmanager
def staged_with_exchange(cuda: bool):
    """`staged`'s stages (the real exchange is the MoE stage: Model._ffn), plus the collectives as
    communication: the exchange's own (its MoE rows) and those of its token counts (begin_step)."""
    timer = StageTimer(cuda, STAGES + COMMUNICATION)
    originals = {n: getattr(exchange_mod, n) for n in ("all_gather", "reduce_scatter")}
    begin_step = exchange_mod.MoEExchange.begin_step
    in_counts = [False]

    def collective(fn):
        def call(*a, **kw):
            with timer(COMMUNICATION[1] if in_counts[0] else COMMUNICATION[0]):
                work = fn(*a, **kw)
            return _Pending(work, timer) if kw.get("async_op") else work
        return call

    def counted_begin_step(self, n):
        in_counts[0] = True
        try:
            return begin_step(self, n)
        finally:
            in_counts[0] = False

    try:
        for n, fn in originals.items():
            setattr(exchange_mod, n, collective(fn))
        exchange_mod.MoEExchange.begin_step = counted_begin_step
        with recording(timer):
            yield timer
    finally:
        exchange_mod.MoEExchange.begin_step = begin_step
        for n, fn in originals.items():
            setattr(exchange_mod, n, fn)


def exchange_report(totals: dict[str, float], step_ms: float, steps: int) -> dict[str, float]:
    """`report`'s stages, with the EP exchange in place of the emulation: the MoE stage's remainder is
    communication + exchange glue, and the token-count exchange (outside the MoE) is communication too."""
    stages = report(totals, step_ms, steps)
    moe_comm = totals.get("communication.moe", 0.0) / steps
    counts = totals.get("communication.counts", 0.0) / steps
    stages["exchange_glue"] = stages.pop("ep_emulation") - moe_comm
    stages["communication"] = moe_comm + counts
    stages["unattributed"] -= counts
    stages["unattributed_fraction"] = stages["unattributed"] / step_ms
    stages["exposed_fraction"] = (stages["communication"] + stages["exchange_glue"]) / step_ms
    return stages
