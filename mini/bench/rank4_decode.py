"""`rank4-decode`: decode steps of one EP4/DP4 rank at real V4.1-Flash shape, on one GPU, against a memory floor.

The model is rank4's (mini/bench/rank4.py: all 40 layers, random weights drawn on the device, this rank's 96 of 384
experts, Engram tables capped to `--engram-rows` rows) with rank4's exchange emulation (`EmulatedEP`): the gate
over the rank's own B tokens, the local experts over those rows plus (ep - 1) x B synthetic remote rows with their
routing, the own rows kept plus the shared expert; the communication is not run (measured on 2 GPUs).

For each batch B in `--batch` and context C in `--context`: B sequences, each with C tokens already in the cache,
decode one token per step (positions C, C + 1, ...). The cache holds B x (C + steps) tokens of compressed KV and
index keys plus a window ring per sequence; it is filled with random values on the device instead of prefilling
B x C tokens (the step reads the same bytes and does the same work whatever the values; the top-k picks other
groups). The Engram rows a step looks up on the host (EngramInput "rows") are fixed random rows: the lookup is
B x 24 rows per Engram layer, outside the graph, and not timed here (issue 13 item 1 times it). The step is one CUDA
graph (mini.engine.cuda_graphs.DecodeGraphs, one bucket of exactly B) replayed with new tokens and positions; its
GPU time comes from CUDA events around the replay. Two splits: `kernel_ms.*`, the graph replay's own kernels under
torch.profiler, grouped by name into parts (KERNEL_CLASSES; they add up to the graph's step less its gaps), and
`stage_ms.*`, eager steps under the stage timer of `mini profile` (the model's named stages, but launch gaps count
inside them: on the H200 an eager step at B = 256 takes 2x the graph's).

The floor (`decode_floor`): the bytes a decode step must read, over `--tbps` (H200 device copy bandwidth from
shared/perf/README.md, 4.26 TB/s): the rank's non-expert weights in the checkpoint's formats (FP8 attention and
shared expert, bf16 norms, gate, compressor, head; only B rows of the embedding and of the Engram tables), the
local experts the step's routing touches (counted per layer from one recorded step) in MXFP4, and per sequence
its KV: the window rows of every layer, the top-k compressed entries of every compressed layer, the index keys each
indexer scores (all visible groups; the candidate layers only their candidate blocks), in the cache's dtype (bf16
here: an FP8 cache would halve that term). Compute is not counted: at B <= 256 these GEMMs are memory-bound.
"""
from __future__ import annotations

import statistics

import torch

from mini.testing.suites import timed_call
from mini.config import ModelConfig

SUITE = "rank4-decode"
H200_TBPS = 4.26  # TB/s, device-to-device copy measured on one H200 (shared/perf/README.md "Ceilings")


def add_args(p) -> None:
    from mini.testing.rank_model import add_emulated_rank_args
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--batch", default="64,256", help="comma-separated batch sizes B (sequences per step)")
    p.add_argument("--context", default="4096,32768", help="comma-separated contexts C (tokens in the cache)")
    p.add_argument("--ep", type=int, default=4, help="EP ranks emulated (this is rank 0)")
    p.add_argument("--steps", type=int, default=10, help="timed graph replays per (B, C)")
    p.add_argument("--warmup", type=int, default=3, help="replays before the timed ones")
    p.add_argument("--profile-steps", type=int, default=2, help="eager steps timed per stage (0: no split)")
    p.add_argument("--kernel-split-steps", type=int, default=2,
                   help="graph replays under torch.profiler for the per-kernel split (CUDA; 0: none)")
    add_emulated_rank_args(p)
    p.add_argument("--tbps", type=float, default=H200_TBPS, help="memory bandwidth of the floor, TB/s")


def _ints(text: str, what: str) -> list[int]:
    from mini.testing.suites import SuiteError
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SuiteError(f"{SUITE}: --{what} takes comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise SuiteError(f"{SUITE}: --{what} needs positive integers, got {text!r}")
    return out


# ---------------------------------------------------------------------------------------------------- the floor
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


# ---------------------------------------------------------------------------------------------------- the run
class DecodeRun:
    """One (B, C) workload on a built rank model: its cache (random contents), static buffers and graph."""

    def __init__(self, model, cfg: ModelConfig, exchange, batch: int, context: int, extra: int, block_tokens: int,
                 device, dtype, seed: int):
        from mini.engine.cuda_graphs import DecodeGraphs
        from mini.model import DecodeBuffers, KVCache
        from mini.model.static_decode import StaticDecodeInputs
        self.model, self.cfg, self.exchange, self.B, self.C = model, cfg, exchange, batch, context
        max_len = -(-(context + extra + 1) // block_tokens) * block_tokens
        self.blocks_per_seq = max_len // block_tokens
        n_blocks = batch * self.blocks_per_seq + 1  # + the scratch block padding rows write into
        self.cache = KVCache(cfg, batch + 1, n_blocks, block_tokens, device, dtype)  # + the scratch slot
        fill_random(self.cache, seed)
        engram_shape = None
        if cfg.engram_layer_ids:
            engram_shape = (len(cfg.engram_layer_ids), cfg.n_hash_cols, cfg.engram_head_dim)
        self.buffers = DecodeBuffers(batch, max_len, block_tokens, pad_slot=batch, pad_block=n_blocks - 1,
                                     device=device, engram_shape=engram_shape, engram_dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        self.engram = None if engram_shape is None else (
            torch.randn(batch, *engram_shape, generator=g) * 0.05).to(dtype)
        self.tokens = torch.randint(3, cfg.vocab_size, (1 << 12,), generator=g).tolist()
        self.blocks = [list(range(b * self.blocks_per_seq, (b + 1) * self.blocks_per_seq)) for b in range(batch)]
        self.step_no = 0
        self.fill()
        self.graphs = DecodeGraphs(model, self.cache, StaticDecodeInputs(self.buffers))
        self.graphs.sizes = [batch]  # one bucket: exactly this batch (capture_all would take every bucket up to B)

    def fill(self) -> None:
        """The next step's inputs: every sequence one token further."""
        s, B = self.step_no, self.B
        toks = [self.tokens[(s * B + b) % len(self.tokens)] for b in range(B)]
        self.buffers.fill(B, toks, [self.C + s] * B, list(range(B)), self.blocks, self.engram)
        self.step_no += 1

    def capture(self) -> None:
        self.graphs.capture_all()  # CUDA only; on the CPU replay() runs the static step eagerly

    def replay(self) -> torch.Tensor:
        return self.graphs.replay(self.B, self.B)

    def eager(self) -> torch.Tensor:
        return self.model.forward(self.buffers.batch(self.B), self.cache)

    def touched_experts(self) -> tuple[list[int], dict[int, list[int]]]:
        """One eager step with the emulation recording: local experts with at least one pair, per MoE layer, and
        the pairs per local expert."""
        pairs = self.exchange.record(self.eager, SUITE)
        return [sum(1 for n in layer if n > 0) for layer in pairs.values()], pairs

    def cache_bytes(self) -> int:
        c = self.cache
        pools = list(c.window) + list(c.comp_kv.values()) + list(c.index_k.values())
        pools += [t for kv_score in (*c.comp_state.values(), *c.index_state.values()) for t in kv_score]
        return sum(t.numel() * t.element_size() for t in pools)


@torch.no_grad()
def fill_random(cache, seed: int) -> None:
    """Random cache contents on the cache's device (N(0, 1); compressor scores too, so that every open group
    holds finite entries)."""
    g = torch.Generator(device=cache.device).manual_seed(seed)
    pools = list(cache.window) + list(cache.comp_kv.values()) + list(cache.index_k.values())
    pools += [t for kv_score in (*cache.comp_state.values(), *cache.index_state.values()) for t in kv_score]
    for t in pools:
        t.normal_(generator=g)


def predicted_cache_bytes(cfg: ModelConfig, batch: int, max_len: int, block_tokens: int, dtype) -> int:
    """What DecodeRun's cache will take (KVCache's own sizing), to refuse before allocating what cannot fit."""
    from mini.model import KVCache
    n_blocks = batch * -(-max_len // block_tokens) + 1
    return (n_blocks * KVCache.bytes_per_block(cfg, block_tokens, dtype)
            + (batch + 1) * KVCache.bytes_per_slot(cfg, dtype))


def _time(fn, steps: int, cuda: bool, before=None) -> list[float]:
    """ms of each of `steps` calls of fn (CUDA events around it, or the wall clock); `before()` runs untimed."""
    out = []
    for _ in range(steps):
        if before is not None:
            before()
        out.append(timed_call(fn, cuda)[1])
    return out


# kernel name -> part of the step, first match wins (names of our Triton kernels, Humming's, FlashMLA's, cuBLAS's)
KERNEL_CLASSES = (
    ("copies", r"^(memcpy|memset)"),
    ("moe_experts", r"humming|process_input|finalize_group_token_scales|_grouped_|swiglu|marlin"),
    ("sparse_attention", r"mla|sparse_attn|sparse_fwd"),
    ("indexer", r"index_scores|topk|radix|sort|candidate"),
    ("gate_route", r"gate|_count_kernel|_scan_kernel|_place_kernel|combine"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|_mm_kernel"),
    ("mhc_norm", r"mhc|norm|sinkhorn"),
    ("quant_rope", r"quant|rope"),
)


def kernel_class(name: str) -> str:
    import re
    low = name.lower()
    return next((c for c, pattern in KERNEL_CLASSES if re.search(pattern, low)), "other")


def kernel_split(fn, steps: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """GPU ms per step of every kernel `fn` (one graph replay) runs, from torch.profiler (CUPTI sees the kernels of
    a graph replay): (ms by KERNEL_CLASSES part, with "total"; the 15 longest kernels). Empty when the profiler saw
    no kernel."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_kernel: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        by_kernel[e.key] += us / 1e3 / steps
    if not by_kernel:
        return {}, []
    parts: dict[str, float] = defaultdict(float)
    for name, ms in by_kernel.items():
        parts[kernel_class(name)] += ms
    parts["total"] = sum(by_kernel.values())
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:15]
    return dict(parts), [(name[:120], ms) for name, ms in top]


def measure_one(run: DecodeRun, args, cuda: bool, tbps: float) -> tuple[dict[str, float], dict]:
    """Metrics of one (B, C): graph replays, the floor, the per-stage split of eager steps."""
    from mini.bench.profile import report, staged
    touched, pairs = run.touched_experts()  # also the eager warm-up of this shape
    run.capture()
    for _ in range(args.warmup):
        run.fill()
        run.replay()
    steps = _time(run.replay, args.steps, cuda, before=run.fill)
    med = statistics.median(steps)
    elem = torch.empty((), dtype=run.cache.dtype).element_size()
    floor = decode_floor(run.cfg, run.B, run.C, touched, elem, tbps)
    m = {"ms_per_step": med, "mean_ms_per_step": statistics.mean(steps), "min_ms_per_step": min(steps),
         "max_ms_per_step": max(steps), "tok_per_s_per_gpu": run.B / (med / 1e3),
         "floor_ms": floor["ms"], "vs_floor": med / floor["ms"], "floor_tok_per_s_per_gpu": run.B / (floor["ms"] / 1e3),
         **{f"floor_gb_{k}": v / 1e9 for k, v in floor.items() if k not in ("ms",)},
         "touched_local_experts": sum(touched), "touched_local_experts_per_layer_min": min(touched),
         "cache_gb": run.cache_bytes() / 1e9}
    raw = {"step_ms": steps, "touched_per_layer": touched,
           "pairs_per_local_expert_max": max(n for layer in pairs.values() for n in layer)}
    if cuda and args.kernel_split_steps > 0:
        run.fill()
        try:
            parts, top = kernel_split(run.replay, args.kernel_split_steps)
        except Exception as e:  # noqa: BLE001 - the split is a diagnosis: the timed figures above stand without it
            parts, top = {}, []
            raw["kernel_split_error"] = f"{type(e).__name__}: {e}"
            print(f"{SUITE}: kernel split failed: {raw['kernel_split_error']}", flush=True)
        if not parts and "kernel_split_error" not in raw:
            raw["kernel_split_error"] = "the profiler saw no kernel in the graph replay"
            print(f"{SUITE}: {raw['kernel_split_error']}", flush=True)
        m.update({f"kernel_ms.{k}": v for k, v in parts.items()})
        raw["top_kernels_ms"] = top
        for name, ms in top[:8]:
            print(f"{SUITE} B={run.B} C={run.C} kernel {ms:7.3f} ms  {kernel_class(name):16s} {name[:70]}", flush=True)
    if args.profile_steps > 0:
        with staged(cuda) as timer:
            eager = _time(run.eager, args.profile_steps, cuda, before=run.fill)
            totals = timer.totals()
        eager_ms = statistics.mean(eager)
        m["eager_ms_per_step"] = eager_ms
        m.update({f"stage_ms.{k}": v for k, v in report(totals, eager_ms, len(eager)).items()})
    return m, raw


def definition(args, batches: list[int], contexts: list[int]) -> dict:
    return {"preset": args.preset, "batch": batches, "context": contexts, "ep": args.ep, "dtype": args.dtype,
            "block_tokens": args.block_tokens, "engram_rows": args.engram_rows, "seed": args.seed,
            "routing": args.routing, "graphs": args.device.startswith("cuda"), "tbps": args.tbps,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}


def run(args) -> dict:
    from mini.testing.suites import SuiteError
    from mini.testing.rank_model import emulated_rank
    batches, contexts = _ints(args.batch, "batch"), _ints(args.context, "context")
    cuda = args.device.startswith("cuda")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg, exchange, model, setup_s = emulated_rank(args)
    metrics: dict[str, float] = {"setup_s": setup_s}
    if cuda:
        torch.cuda.synchronize()
        metrics["built_mem_gb"] = torch.cuda.memory_allocated() / 2**30
    raw = {}
    extra = args.warmup + args.steps + args.profile_steps + 2  # positions the steps advance past C
    # the largest shape first (the target is at B = 256): a run cut by its time limit has measured it
    for B in sorted(batches, reverse=True):
        for C in sorted(contexts, reverse=True):
            max_len = -(-(C + extra + 1) // args.block_tokens) * args.block_tokens
            need = predicted_cache_bytes(cfg, B, max_len, args.block_tokens, dtype)
            if cuda:
                free, _ = torch.cuda.mem_get_info(device)
                if need + (4 << 30) > free:  # 4 GiB for the step's activations and the graph
                    raise SuiteError(f"{SUITE}: B={B} x C={C} needs a {need / 2**30:.1f} GiB cache; "
                                     f"{free / 2**30:.1f} GiB free after the model")
                torch.cuda.reset_peak_memory_stats()
            r = DecodeRun(model, cfg, exchange, B, C, extra, args.block_tokens, device, dtype, args.seed)
            m, raw[f"b{B}_c{C}"] = measure_one(r, args, cuda, args.tbps)
            if cuda:
                m["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            metrics.update({f"b{B}_c{C}.{k}": v for k, v in m.items()})
            # as each shape finishes, so that a run cut by its time limit still tells what it measured
            print(f"{SUITE} B={B} C={C}: {m['ms_per_step']:.2f} ms/step, {m['tok_per_s_per_gpu']:.0f} tok/s/GPU, "
                  f"floor {m['floor_ms']:.2f} ms ({m['vs_floor']:.2f}x)", flush=True)
            del r
            if cuda:
                torch.cuda.empty_cache()
    return {"suite": SUITE, "definition": definition(args, batches, contexts), "metrics": metrics, "raw": raw}
