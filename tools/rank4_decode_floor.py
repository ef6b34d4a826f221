"""rank4-decode (mini/bench/rank4_decode.py) against its memory floor, with the graph replay's kernels by part
(issue 13 item 5, docs/perf/009-010; phases `rank4_decode` and `rank4_decode_split` of scripts/gpu.sh): the suite
runs here with both added to each (B, C):

    python3 tools/rank4_decode_floor.py [rank4-decode options] [--tbps 4.26] [--kernel-split-steps 2] [--json FILE]

The floor (`decode_floor`): the bytes a decode step must read, over `--tbps` (H200 device copy bandwidth from
shared/perf/README.md, 4.26 TB/s): the rank's non-expert weights in the checkpoint's formats (FP8 attention and
shared expert, bf16 norms, gate, compressor, head; only B rows of the embedding and of the Engram tables), the
local experts the step's routing touches (counted per layer from one recorded step) in MXFP4, and per sequence
its KV: the window rows of every layer, the top-k compressed entries of every compressed layer, the index keys each
indexer scores (all visible groups; the candidate layers only their candidate blocks), in the cache's dtype (bf16
here: an FP8 cache would halve that term). Compute is not counted: at B <= 256 these GEMMs are memory-bound.

`kernel_ms.*`: the graph replay's own kernels under torch.profiler, grouped by name into parts (KERNEL_CLASSES;
they add up to the graph's step less its gaps), beside the suite's `stage_ms.*` of eager steps.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import rank4_decode  # noqa: E402
from mini.bench.rank4_decode import SUITE  # noqa: E402
from mini.config import ModelConfig  # noqa: E402
from mini.testing.suites import run_as_script  # noqa: E402

H200_TBPS = 4.26  # TB/s, device-to-device copy measured on one H200 (shared/perf/README.md "Ceilings")


def add_args(p) -> None:
    rank4_decode.add_args(p)
    p.add_argument("--kernel-split-steps", type=int, default=2,
                   help="graph replays under torch.profiler for the per-kernel split (CUDA; 0: none)")
    p.add_argument("--tbps", type=float, default=H200_TBPS, help="memory bandwidth of the floor, TB/s")


def kv_read_per_seq(cfg: ModelConfig, context: int) -> dict[str, int]:
    """Cache elements one decode token at position `context` reads (it sees context + 1 positions, itself
    included): `window` (every layer's ring), `compressed` (each compressed layer's top-k entries), `index_keys`
    (the keys each indexer scores: every visible group, or only the candidate blocks on a layer that uses them)."""
    seen = context + 1
    window = compressed = index = 0
    for p in cfg.layers:
        window += min(seen, cfg.window_size) * cfg.head_dim
        if p.ratio > 0:
            visible = seen // p.ratio
            compressed += min(cfg.index_topk, visible) * cfg.head_dim
            if p.runs_indexer:
                scored = visible
                if p.uses_candidates:
                    scored = min(visible, cfg.candidate_topk_blocks * cfg.candidate_block_size)
                index += scored * cfg.index_head_dim
    return {"window": window, "compressed": compressed, "index_keys": index}


def expert_bytes(cfg: ModelConfig) -> int:
    """Bytes of one routed expert (w1, w2, w3 with their scales) in the checkpoint's format."""
    from mini.checkpoint.inventory import Weight
    fmt = "mxfp4" if cfg.expert_dtype == "fp4" else "fp8"
    shapes = [(cfg.moe_inter_dim, cfg.dim), (cfg.dim, cfg.moe_inter_dim), (cfg.moe_inter_dim, cfg.dim)]
    return sum(t.nbytes for s in shapes for t in Weight("e", fmt, s).tensors(cfg.fp8_block).values())


def dense_read_bytes(cfg: ModelConfig, batch: int) -> dict[str, int]:
    """Non-expert weight bytes a step of `batch` tokens reads, in the checkpoint's formats: `weights` (every
    tensor but the two tables, read whole), `embed_rows` (batch rows of the embedding), `engram_rows` (batch x
    n_hash_cols rows of each Engram table, FP8 + E8M0)."""
    from mini.checkpoint.inventory import weights
    out = {"weights": 0, "embed_rows": 0, "engram_rows": 0}
    for w in weights(cfg, experts=range(0)):
        specs = w.tensors(cfg.fp8_block)
        if w.name == "embed.weight":
            out["embed_rows"] += batch * specs[w.name].nbytes // w.shape[0]
        elif w.fmt == "fp8_rows":  # an Engram table: one row per hash column per token
            out["engram_rows"] += batch * cfg.n_hash_cols * sum(t.nbytes for t in specs.values()) // w.shape[0]
        else:
            out["weights"] += sum(t.nbytes for t in specs.values())
    return out


def decode_floor(cfg: ModelConfig, batch: int, context: int, touched_experts: list[int], kv_elem_bytes: int = 2,
                 tbps: float = H200_TBPS) -> dict[str, float]:
    """The memory-bound time of one decode step of `batch` sequences at `context`: bytes by kind and `ms`.
    `touched_experts`: local experts the step routes at least one pair to, per MoE layer."""
    dense = dense_read_bytes(cfg, batch)
    kv = {k: batch * v * kv_elem_bytes for k, v in kv_read_per_seq(cfg, context).items()}
    out = {"dense_weights": dense["weights"], "embed_rows": dense["embed_rows"], "engram_rows": dense["engram_rows"],
           "experts": sum(touched_experts) * expert_bytes(cfg),
           "kv_window": kv["window"], "kv_compressed": kv["compressed"], "kv_index_keys": kv["index_keys"]}
    out["total"] = sum(out.values())
    out["ms"] = out["total"] / (tbps * 1e12) * 1e3
    return out


# kernel name -> part of the step, first match wins (names of our Triton kernels, Humming's, FlashMLA's, cuBLAS's)
KERNEL_CLASSES = (
    ("copies", r"^(memcpy|memset)"),
    ("moe_experts", r"humming|process_input|finalize_group_token_scales|_grouped_|swiglu|marlin"),
    ("sparse_attention", r"mla|sparse_attn|sparse_fwd"),
    ("indexer", r"index_scores|topk|radix|sort|candidate"),
    ("gate_route", r"gate|_count_kernel|_scan_kernel|_place_kernel|_plan_one_kernel|combine"),
    ("gemm", r"gemm|gemv|_sum_pieces|nvjet|cutlass|xmma|cublas|_mm_kernel"),  # + our decode GEMV and its split-K sum
    ("mhc_norm", r"mhc|norm|sinkhorn"),
    ("quant_rope", r"quant|rope"),
)


def kernel_class(name: str) -> str:
    import re
    low = name.lower()
    return next((c for c, pattern in KERNEL_CLASSES if re.search(pattern, low)), "other")


def kernel_split(fn, steps: int) -> tuple[dict[str, float], list[tuple[str, float, float]]]:
    """GPU ms per step of every kernel `fn` (one graph replay) runs, from torch.profiler (CUPTI sees the kernels of
    a graph replay): (ms by KERNEL_CLASSES part, with "total", and kernels per step by part as "launches.PART";
    every kernel as (name, ms per step, launches per step), longest first: the census of what a step launches,
    fusion's worklist at small B). Empty when the profiler saw no kernel."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_kernel: dict[str, float] = defaultdict(float)
    launches: dict[str, float] = defaultdict(float)
    count: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        by_kernel[e.key] += us / 1e3 / steps
        launches[kernel_class(e.key)] += e.count / steps
        count[e.key] += e.count / steps
    if not by_kernel:
        return {}, []
    parts: dict[str, float] = defaultdict(float)
    for name, ms in by_kernel.items():
        parts[kernel_class(name)] += ms
    parts["total"] = sum(by_kernel.values())
    # kernels per step: a graph replay still pays a few us between dependent kernels, so at small B the step less
    # the kernels' sum grows with their count (fusion's target), not with their bytes
    parts.update({f"launches.{k}": n for k, n in launches.items()})
    parts["launches.total"] = sum(launches.values())
    every = sorted(by_kernel.items(), key=lambda kv: -kv[1])
    return dict(parts), [(name[:160], ms, count[name]) for name, ms in every]


class FloorAndSplit:
    """rank4_decode.measure_one's study: the shape's floor against its median replay, then the kernel split."""

    def __init__(self, args):
        self.args = args

    def __call__(self, run, touched: list[int], med: float, cuda: bool) -> tuple[dict[str, float], dict]:
        args = self.args
        elem = torch.empty((), dtype=run.cache.dtype).element_size()
        floor = decode_floor(run.cfg, run.B, run.C, touched, elem, args.tbps)
        m = {"floor_ms": floor["ms"], "vs_floor": med / floor["ms"],
             "floor_tok_per_s_per_gpu": run.B / (floor["ms"] / 1e3),
             **{f"floor_gb_{k}": v / 1e9 for k, v in floor.items() if k not in ("ms",)}}
        raw = {}
        if cuda and args.kernel_split_steps > 0:
            run.fill()
            try:
                parts, top = kernel_split(run.replay, args.kernel_split_steps)
            except Exception as e:  # noqa: BLE001 - the split is a diagnosis: the timed figures stand without it
                parts, top = {}, []
                raw["kernel_split_error"] = f"{type(e).__name__}: {e}"
                print(f"{SUITE}: kernel split failed: {raw['kernel_split_error']}", flush=True)
            if not parts and "kernel_split_error" not in raw:
                raw["kernel_split_error"] = "the profiler saw no kernel in the graph replay"
                print(f"{SUITE}: {raw['kernel_split_error']}", flush=True)
            m.update({(f"kernels_per_step.{k[len('launches.'):]}" if k.startswith("launches.") else f"kernel_ms.{k}"): v
                      for k, v in parts.items()})
            raw["kernels_ms_launches"] = top
            for name, ms, _ in top[:8]:
                print(f"{SUITE} B={run.B} C={run.C} kernel {ms:7.3f} ms  {kernel_class(name):16s} {name[:70]}",
                      flush=True)
        return m, raw


def run(args) -> dict:
    result = rank4_decode.run(args, FloorAndSplit(args))
    result["definition"]["tbps"] = args.tbps
    return result


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__name__, SUITE, "rank4-decode against its memory floor, kernels by part", argv,
                         "tools/rank4_decode_floor.py")


if __name__ == "__main__":
    raise SystemExit(main())
