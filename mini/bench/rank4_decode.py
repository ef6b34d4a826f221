"""`rank4-decode`: decode steps of one EP4/DP4 rank at real V4.1-Flash shape, on one GPU.

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
GPU time comes from CUDA events around the replay; `stage_ms.*` splits eager
steps under the stage timer of `mini profile` (the model's named stages, but launch gaps count inside them: on the
H200 an eager step at B = 256 takes 2x the graph's). The memory floor of each shape (`vs_floor`) and the graph
replay's own kernels by part are the study beside it: tools/rank4_decode_floor.py, which runs this suite with them.
"""
from __future__ import annotations

import statistics

import torch

from mini.testing.suites import timed_call
from mini.config import ModelConfig

SUITE = "rank4-decode"


def add_args(p) -> None:
    from mini.testing.rank_model import add_emulated_rank_args
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--batch", default="64,256", help="comma-separated batch sizes B (sequences per step)")
    p.add_argument("--context", default="4096,32768", help="comma-separated contexts C (tokens in the cache)")
    p.add_argument("--shapes", default="", help="comma-separated BxC pairs, e.g. 1x4096,256x32768: these shapes "
                   "instead of every (--batch, --context) pair")
    p.add_argument("--width", type=int, default=1, help="rows per sequence: 1 a decode step, 1 + k a verify step of "
                   "k drafts (spec-decode sets its own widths)")
    p.add_argument("--ep", type=int, default=4, help="EP ranks emulated (this is rank 0)")
    p.add_argument("--max-model-len", type=int, default=0, help="the static buffers' positions a sequence, as "
                   "the engine's max_model_len sizes them (the cache stays C's); the step's graph spans what the "
                   "engine's would (mini.engine.cuda_graphs.spans); default: C's own")
    p.add_argument("--steps", type=int, default=10, help="timed graph replays per (B, C)")
    p.add_argument("--warmup", type=int, default=3, help="replays before the timed ones")
    p.add_argument("--profile-steps", type=int, default=2, help="eager steps timed per stage (0: no split)")
    add_emulated_rank_args(p)


def int_list(text: str, what: str, suite: str = SUITE) -> list[int]:
    """The positive integers of option --`what` (comma-separated), else a SuiteError naming `suite`."""
    from mini.testing.suites import SuiteError
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SuiteError(f"{suite}: --{what} takes comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise SuiteError(f"{suite}: --{what} needs positive integers, got {text!r}")
    return out


# ---------------------------------------------------------------------------------------------------- the run
class DecodeRun:
    """One (B, C) workload on a built rank model: its cache (random contents), static buffers and graph. `width` > 1:
    verify steps instead (spec-decode), each sequence its token and width - 1 draft tokens at the next positions."""

    def __init__(self, model, cfg: ModelConfig, exchange, batch: int, context: int, extra: int, block_tokens: int,
                 device, dtype, seed: int, width: int = 1, max_model_len: int = 0):
        from mini.engine.cuda_graphs import DecodeGraphs
        from mini.model import DecodeBuffers, KVCache
        from mini.model.static_decode import StaticDecodeInputs
        self.model, self.cfg, self.exchange, self.B, self.C = model, cfg, exchange, batch, context
        self.width = width
        max_len = -(-(context + extra + width) // block_tokens) * block_tokens
        self.blocks_per_seq = max_len // block_tokens
        n_blocks = batch * self.blocks_per_seq + 1  # + the scratch block padding rows write into
        self.cache = KVCache(cfg, batch + 1, n_blocks, block_tokens, device, dtype)  # + the scratch slot
        fill_random(self.cache, seed)
        engram_shape = None
        if cfg.engram_layer_ids:
            engram_shape = (len(cfg.engram_layer_ids), cfg.n_hash_cols, cfg.engram_head_dim)
        self.buffers = DecodeBuffers(batch, max(max_len, max_model_len), block_tokens, pad_slot=batch,
                                     pad_block=n_blocks - 1, device=device, engram_shape=engram_shape,
                                     engram_dtype=dtype, max_rows=width)
        g = torch.Generator().manual_seed(seed)
        self.engram = None if engram_shape is None else (
            torch.randn(batch * width, *engram_shape, generator=g) * 0.05).to(dtype)
        self.tokens = torch.randint(3, cfg.vocab_size, (1 << 12,), generator=g).tolist()
        self.blocks = [list(range(b * self.blocks_per_seq, (b + 1) * self.blocks_per_seq)) for b in range(batch)]
        self.step_no = 0
        self.fill()
        self.graphs = DecodeGraphs(model, self.cache, StaticDecodeInputs(self.buffers))
        # one bucket: exactly this batch and width (capture_all would take every bucket up to B, every width up to it)
        self.graphs.sizes, self.graphs.widths = [batch], [width]
        self.graphs.spans = [self.graphs.span_for(max_len)]  # the span the engine's step would take

    def fill(self) -> None:
        """The next step's inputs: every sequence one token further, a verify step's rows each a token of its own.
        (Drafts that were the next sequences' tokens put each token id on up to `width` rows of a step: with random
        weights those rows route alike: a B = 16 verify step touched 32 local experts where ~75 are expected.)"""
        s, B, W, n = self.step_no, self.B, self.width, len(self.tokens)
        toks = [self.tokens[((s * B + b) * W) % n] for b in range(B)]
        drafts = [[self.tokens[((s * B + b) * W + i) % n] for i in range(1, W)] for b in range(B)]
        engram = None if self.engram is None else self.engram[:B * W]  # built for the widest step; W may be less
        self.buffers.fill(B, toks, [self.C + s] * B, list(range(B)), self.blocks, engram, drafts=drafts, width=W)
        self.step_no += 1

    def capture(self) -> None:
        self.graphs.capture_all()  # CUDA only; on the CPU replay() runs the static step eagerly

    def replay(self) -> torch.Tensor:
        return self.graphs.replay(self.B, self.B, self.width, self.graphs.spans[0])

    def eager(self) -> torch.Tensor:
        return self.model.forward(self.buffers.batch(self.B, self.width, self.graphs.spans[0]), self.cache)

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


def time_calls(fn, steps: int, cuda: bool, before=None) -> list[float]:
    """ms of each of `steps` calls of fn (CUDA events around it, or the wall clock); `before()` runs untimed."""
    out = []
    for _ in range(steps):
        if before is not None:
            before()
        out.append(timed_call(fn, cuda)[1])
    return out


def measure_one(run: DecodeRun, args, cuda: bool, study=None) -> tuple[dict[str, float], dict]:
    """Metrics of one (B, C): graph replays, the per-stage split of eager steps; `study(run, touched, ms, cuda)`
    (tools/rank4_decode_floor.py) adds its metrics and raw entries after the replays."""
    from mini.testing.stage_times import report, staged
    touched, pairs = run.touched_experts()  # also the eager warm-up of this shape
    run.capture()
    for _ in range(args.warmup):
        run.fill()
        run.replay()
    steps = time_calls(run.replay, args.steps, cuda, before=run.fill)
    med = statistics.median(steps)
    m = {"ms_per_step": med, "mean_ms_per_step": statistics.mean(steps), "min_ms_per_step": min(steps),
         "max_ms_per_step": max(steps), "tok_per_s_per_gpu": run.B / (med / 1e3),
         "touched_local_experts": sum(touched), "touched_local_experts_per_layer_min": min(touched),
         "cache_gb": run.cache_bytes() / 1e9}
    raw = {"step_ms": steps, "touched_per_layer": touched,
           "pairs_per_local_expert_max": max(n for layer in pairs.values() for n in layer),
           # each MoE layer's rows per local expert: the spread a study of the expert GEMMs should replay
           # (tools/humming_decode_study.py --step-routing)
           "pairs_per_local_expert": {str(layer): counts for layer, counts in pairs.items()}}
    if study is not None:
        more, more_raw = study(run, touched, med, cuda)
        m.update(more)
        raw.update(more_raw)
    if args.profile_steps > 0:
        with staged(cuda) as timer:
            eager = time_calls(run.eager, args.profile_steps, cuda, before=run.fill)
            totals = timer.totals()
        eager_ms = statistics.mean(eager)
        m["eager_ms_per_step"] = eager_ms
        m.update({f"stage_ms.{k}": v for k, v in report(totals, eager_ms, len(eager)).items()})
    return m, raw


def definition(args, batches: list[int], contexts: list[int]) -> dict:
    return {"preset": args.preset, "batch": batches, "context": contexts, "ep": args.ep, "dtype": args.dtype,
            "block_tokens": args.block_tokens, "engram_rows": args.engram_rows, "seed": args.seed,
            "routing": args.routing, "graphs": args.device.startswith("cuda"),
            "max_model_len": getattr(args, "max_model_len", 0),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}


def measure_shape(model, cfg: ModelConfig, exchange, args, batch: int, context: int, study=None,
                  what: str = SUITE, width: int = 1) -> tuple[dict[str, float], dict]:
    """measure_one of a fresh DecodeRun of B = `batch` sequences at `context` (of `width` rows each: verify steps),
    its cache freed after; a cache that cannot fit is refused (SuiteError, naming `what`) before it is allocated.
    Also spec-decode's (its verify step and proxy)."""
    from mini.testing.suites import SuiteError
    cuda = args.device.startswith("cuda")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    extra = args.warmup + args.steps + args.profile_steps + 2  # positions the steps advance past C
    max_len = -(-(context + extra + width) // args.block_tokens) * args.block_tokens
    need = predicted_cache_bytes(cfg, batch, max_len, args.block_tokens, dtype)
    if cuda:
        # free on the device plus what torch's allocator holds unused (without expandable segments the build's
        # freed temporaries stay reserved, and the cache can be carved from them)
        free, _ = torch.cuda.mem_get_info(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        if need + (4 << 30) > free + reserved - allocated:  # 4 GiB for the step's activations and the graph
            raise SuiteError(f"{what}: B={batch} x C={context} needs a {need / 2**30:.1f} GiB cache; "
                             f"{free / 2**30:.1f} GiB free after the model, {(reserved - allocated) / 2**30:.1f} "
                             f"GiB reserved unused, {allocated / 2**30:.1f} GiB allocated")
        torch.cuda.reset_peak_memory_stats()
    r = DecodeRun(model, cfg, exchange, batch, context, extra, args.block_tokens, device, dtype, args.seed, width,
                  getattr(args, "max_model_len", 0))
    m, raw = measure_one(r, args, cuda, study)
    del r
    if cuda:
        m["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
    return m, raw


def build(args, config: ModelConfig | None = None) -> tuple[ModelConfig, object, object, dict[str, float]]:
    """emulated_rank's model (of `config`, else of --preset) and the metrics of its build. Also spec-decode's."""
    from mini.testing.rank_model import emulated_rank
    cfg, exchange, model, setup_s = emulated_rank(args, config)
    metrics = {"setup_s": setup_s}
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        metrics["built_mem_gb"] = torch.cuda.memory_allocated() / 2**30
    return cfg, exchange, model, metrics


def run(args, study=None) -> dict:
    """The suite; `study`: see measure_one."""
    shapes = shape_list(args)
    batches, contexts = sorted({b for b, _ in shapes}), sorted({c for _, c in shapes})
    cfg, exchange, model, metrics = build(args)
    raw = {}
    # the largest shape first (the target is at B = 256): a run cut by its time limit has measured it
    for B, C in sorted(shapes, reverse=True):
        m, raw[f"b{B}_c{C}"] = measure_shape(model, cfg, exchange, args, B, C, study, width=args.width)
        metrics.update({f"b{B}_c{C}.{k}": v for k, v in m.items()})
        # as each shape finishes, so that a run cut by its time limit still tells what it measured
        floor = f", floor {m['floor_ms']:.2f} ms ({m['vs_floor']:.2f}x)" if "floor_ms" in m else ""
        print(f"{SUITE} B={B} C={C}: {m['ms_per_step']:.2f} ms/step, {m['tok_per_s_per_gpu']:.0f} tok/s/GPU"
              + floor, flush=True)
    definition_ = definition(args, batches, contexts)
    if args.shapes:
        definition_["shapes"] = [f"{b}x{c}" for b, c in shapes]
    if args.width != 1:
        definition_["width"] = args.width  # tok_per_s_per_gpu then counts sequences, not tokens
    return {"suite": SUITE, "definition": definition_, "metrics": metrics, "raw": raw}


def shape_list(args) -> list[tuple[int, int]]:
    """The (B, C) shapes to measure: --shapes' pairs, else every (--batch, --context) pair."""
    from mini.testing.suites import SuiteError
    if args.width < 1:
        raise SuiteError(f"{SUITE}: --width takes 1 (decode) or more (verify), got {args.width}")
    if not args.shapes:
        return [(b, c) for b in int_list(args.batch, "batch") for c in int_list(args.context, "context")]
    try:
        shapes = [tuple(int(v) for v in pair.lower().split("x")) for pair in args.shapes.split(",") if pair.strip()]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SuiteError(f"{SUITE}: --shapes takes comma-separated BxC pairs of positive integers, got {args.shapes!r}")
    return shapes
