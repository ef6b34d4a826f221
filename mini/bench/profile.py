"""`mini profile --suite rank4`: ms per step of each stage of the rank4 prefill step, adding up to the step.

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

The run first measures the rank4 suite as `mini bench rank4` does (written as rank4.json: one model build serves
both), then the staged steps; one more step runs under torch.profiler with every stage a named range
(record_function), its Chrome trace gzipped beside them.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

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
    from mini.ops.stages import recording
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


def main(argv: list[str] | None = None) -> int:
    from mini.bench import rank4
    from mini.testing.rank_step import sync, time_steps
    from mini.testing.suites import check_result, environment, write_result
    from mini.ops.stages import recording
    p = argparse.ArgumentParser(prog="mini profile", description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=("rank4",), default="rank4")
    p.add_argument("--out", type=Path, default=Path("profile-out"), help="folder for the JSON report and the trace")
    p.add_argument("--profile-steps", type=int, default=3, help="steps timed by stage")
    rank4.add_args(p)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    r, setup_s = rank4.setup(args)
    suite = check_result("rank4", rank4.measure(r, setup_s, args))  # the rank4 suite's numbers, unwrapped
    plain = suite["raw"]["step_ms"]
    with staged(cuda) as timer:
        timed = time_steps(r, args.profile_steps)
        totals = timer.totals()
    step_ms = sum(timed) / len(timed)
    stages = report(totals, step_ms, len(timed))
    args.out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof, recording(torch.profiler.record_function):
        r.step()
        sync(r.batch.input_ids.device)
    trace = args.out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(args.out / "trace.json.gz", "wb") as z:  # Perfetto reads .json.gz
        shutil.copyfileobj(f, z)
    trace.unlink()
    result = {"suite": args.suite, "definition": rank4.definition(args), "stages_ms_per_step": stages,
              "step_ms_unwrapped_mean": sum(plain) / len(plain), "step_ms_wrapped": timed, "raw_totals_ms": totals,
              "profile_steps": len(timed), "env": environment()}
    write_result(args.out / "profile.json", result)
    write_result(args.out / "rank4.json", {**suite, "env": environment()})
    width = max(len(k) for k in stages)
    print(f"profile {args.suite}: " + json.dumps(result["definition"], sort_keys=True))
    for k, v in stages.items():
        print(f"  {k:{width}s} {v:10.3f}")
    print(f"  (unwrapped step {result['step_ms_unwrapped_mean']:.3f} ms; trace {args.out / 'trace.json.gz'})")
    return 0
