"""`mini profile --suite rank4`: ms per step of each stage of the rank4 prefill step, adding up to the step.

Stages are timed by wrapping the functions that implement them (CUDA events around each call on the GPU, the wall
clock on the CPU), so every stage is the GPU time between its first and last kernel, launch gaps included:

    attention          mini.model.model.attention (whole)  = sparse core + key gathering + indexer + other
      sparse core      mini.model.attn_layer.sparse_attention (the kernel reads window / pool keys by index)
      key gathering    mini.model.attn_layer._compressed_ids (top-k groups -> pool rows; no key tensor is built)
      indexer + top-k  mini.model.attn_layer._index
    gate               mini.ops.moe.gate
    routed experts     mini.ops.moe.routed = act quant + routing plan + w1/w3 GEMM + w2 GEMM + combine
                       (Humming backend: act quant with the row gather + plan + both GEMMs + SwiGLU + combine)
    shared expert      mini.ops.moe.shared
    ep emulation       the rest of bench.prefill.EmulatedEP (synthetic remote rows, the own-row slice, the sum)
    communication      0 here: one GPU emulates an EP4 rank (the exchange is measured on 2 GPUs)
    hc / norm / other  mHC mixes / collapse / expand, block RMSNorms, Engram
    unattributed       step - everything above (embedding, final norm and head, Python between stages)

The run first measures the rank4 suite as `mini bench rank4` does (written as rank4.json: one model build serves
both), then the staged steps; one more step runs under torch.profiler, its Chrome trace gzipped beside them.
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

# (stage, module path, attribute): the function whose calls are timed as that stage
WRAPPED = [
    ("attention", "mini.model.model", "attention"),
    ("attention.sparse_core", "mini.model.attn_layer", "sparse_attention"),
    ("attention.key_gathering", "mini.model.attn_layer", "_compressed_ids"),
    ("attention.indexer_topk", "mini.model.attn_layer", "_index"),
    ("moe", "mini.bench.prefill", "EmulatedEP.__call__"),
    ("moe.gate", "mini.ops.moe", "gate"),
    ("moe.routed", "mini.ops.moe", "routed"),
    ("moe.routed.act_quant", "mini.kernels.fp8_act_quant", "fp8_act_quant"),
    ("moe.routed.route_plan", "mini.kernels.moe_route", "plan_routes"),
    ("moe.routed.gemm_w13_swiglu", "mini.kernels.mxfp4_grouped_gemm", "grouped_swiglu"),
    ("moe.routed.gemm_w2", "mini.kernels.mxfp4_grouped_gemm", "grouped_down"),
    # with the Humming backend (MINI_MOE_GEMM): both GEMMs (w1|w3 side by side, then w2) and the SwiGLU pass
    ("moe.routed.gemm_humming", "mini.kernels.humming_experts", "grouped_gemm"),
    ("moe.routed.swiglu", "mini.kernels.mxfp4_grouped_gemm", "swiglu_rows"),
    ("moe.routed.combine", "mini.kernels.moe_combine", "combine"),
    ("moe.shared", "mini.ops.moe", "shared"),
    # pre_norm = mixes + collapse + the site's RMSNorm (one fused kernel on the fast path); wrapping its parts too
    # would count them twice on the reference path
    ("hc_norm_other.mhc", "mini.ops.mhc", "pre_norm"),
    ("hc_norm_other.mhc", "mini.ops.mhc", "expand"),
    ("hc_norm_other.norm", "mini.model.model", "rms_norm"),
    ("hc_norm_other.engram", "mini.model.model", "engram"),
]


class StageTimer:
    """Wraps functions in place so that each call records its time under a stage name; `restore()` undoes it.
    A stage "a.b" whose parent "a" is also wrapped counts only the calls made inside a call of the parent (the FP8
    act quant of the routed experts, not the one every linear layer runs)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.pending: dict[str, list] = defaultdict(list)
        self._undo: list = []
        self._stages: set[str] = set()
        self._active: dict[str, int] = defaultdict(int)

    def wrap(self, stage: str, owner, attr: str) -> None:
        fn = getattr(owner, attr)
        timer = self
        self._stages.add(stage)

        def timed(*args, **kwargs):
            parent = stage.rpartition(".")[0]
            if parent in timer._stages and not timer._active[parent]:
                return fn(*args, **kwargs)
            timer._active[stage] += 1
            try:
                return timer._time(stage, fn, args, kwargs)
            finally:
                timer._active[stage] -= 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def _time(self, stage: str, fn, args, kwargs):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn(*args, **kwargs)
            b.record()
            self.pending[stage].append((a, b))
        else:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.pending[stage].append(1e3 * (time.perf_counter() - t0))
        return out

    def restore(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()

    def totals(self) -> dict[str, float]:
        """ms per stage, summed over every call so far."""
        if not self.cuda:
            return {s: sum(ps) for s, ps in self.pending.items()}
        torch.cuda.synchronize()
        return {s: sum(a.elapsed_time(b) for a, b in ps) for s, ps in self.pending.items()}


def _resolve(path: str, attr: str):
    """(owner object, attribute name) of 'module' + 'Class.method' or 'function'."""
    import importlib
    owner = importlib.import_module(path)
    *classes, name = attr.split(".")
    for c in classes:
        owner = getattr(owner, c)
    return owner, name


@contextmanager
def staged(cuda: bool):
    timer = StageTimer(cuda)
    try:
        for stage, path, attr in WRAPPED:
            timer.wrap(stage, *_resolve(path, attr))
        yield timer
    finally:
        timer.restore()


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
    from mini.bench import check_result, environment, prefill
    p = argparse.ArgumentParser(prog="mini profile", description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=("rank4",), default="rank4")
    p.add_argument("--out", type=Path, default=Path("profile-out"), help="folder for the JSON report and the trace")
    p.add_argument("--profile-steps", type=int, default=3, help="steps timed by stage")
    prefill.add_args(p)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    r, setup_s = prefill.setup(args)
    suite = check_result("rank4", prefill.measure(r, setup_s, args))  # the rank4 suite's numbers, unwrapped
    plain = suite["raw"]["step_ms"]
    with staged(cuda) as timer:
        timed = prefill.time_steps(r, args.profile_steps)
        totals = timer.totals()
    step_ms = sum(timed) / len(timed)
    stages = report(totals, step_ms, len(timed))
    args.out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        r.step()
        prefill._sync(r.batch.input_ids.device)
    trace = args.out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(args.out / "trace.json.gz", "wb") as z:  # Perfetto reads .json.gz
        shutil.copyfileobj(f, z)
    trace.unlink()
    result = {"suite": args.suite, "definition": prefill.definition(args), "stages_ms_per_step": stages,
              "step_ms_unwrapped_mean": sum(plain) / len(plain), "step_ms_wrapped": timed, "raw_totals_ms": totals,
              "profile_steps": len(timed)}
    (args.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "rank4.json").write_text(json.dumps({**suite, "env": environment()}, indent=1) + "\n")
    width = max(len(k) for k in stages)
    print(f"profile {args.suite}: " + json.dumps(result["definition"], sort_keys=True))
    for k, v in stages.items():
        print(f"  {k:{width}s} {v:10.3f}")
    print(f"  (unwrapped step {result['step_ms_unwrapped_mean']:.3f} ms; trace {args.out / 'trace.json.gz'})")
    return 0
