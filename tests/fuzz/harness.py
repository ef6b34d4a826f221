"""Fast path vs reference path on one random config (configs.py): per op, per layer and end to end.

Three levels, each on the same random weights (make-checkpoint's `random_state`), in bf16:
1. Per op, on the same input. During a reference forward every call of a dispatched op (linear, RoPE, the fused
   norm + RoPE + fake quant, indexer scores, sparse attention, the mHC site input and output, the MoE, Engram) is
   also made with the fast backend and with the reference on the same arguments cast to fp32. The fast result
   must be as close to the bf16 reference as that fp32 twin is, within a factor FACTOR, plus FLOOR x its size:
       ||fast - ref|| <= FACTOR * ||ref - ref_fp32|| + FLOOR * ||ref||
   and hold its inf / NaN exactly where the reference does. Why this bound: the fast path may differ from the
   reference only in summation order (and tensor-core sums), which moves a bf16 result by about one rounding,
   the same size as what computing in fp32 instead of bf16 moves it; a FP8 / FP4 fake quantization that flips at
   a tie turns that into one quantization step for both. An indexing, masking or scale bug moves whole rows by
   O(1), far outside. FLOOR covers ops whose output the bf16 inputs fully determine in fp32 (mHC mixes: the fp32
   twin is then identical, while the fast kernel's tensor-core products differ by ~1e-5, kernels.md).
2. Per layer, on the same input (mini.check.fastpath.Recorder's shadow run): each attention / MoE sub-layer
   run by the fast path on the reference's input, with its own caches. Its error includes top-k choices that
   flip near ties, so it is bounded by the fp32-activation model's own chained error at that layer (how far bf16
   rounding alone moves the layer) and an absolute LAYER_FLOOR: a loose bound, it catches garbage, level 1 catches
   small bugs.
3. End to end: logits of one prefill, of the same prompt in chunks, and of greedy-forced decode steps, fast vs
   reference, bounded by the fp32-activation model's error on the same schedule (chaotic random models: one flip
   moves later logits by O(0.1), the same for bf16 vs fp32).
Where the fast path cannot take a shape it must fall back (level 1 then compares the reference with itself) or
refuse with a clear error; `coverage` counts the kernel calls that did run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

import mini.ops
from mini.ops import using_backend

FACTOR = 2.0
FLOOR = 1e-4
LAYER_FLOOR = 0.05
E2E_FACTOR = 1.5
E2E_FLOOR = 0.02

# (module, attribute) of every dispatched op the model calls, where the model looks it up
OPS = [("mini.model.attn_layer", n) for n in ("linear", "apply_rope", "norm_rope_quant", "index_scores",
                                             "sparse_attention")]
OPS += [("mini.ops.mhc", "pre_norm"), ("mini.ops.mhc", "expand"), ("mini.model.model", "moe"),
        ("mini.model.model", "engram")]
# kernel entry points, counted to report which kernels ran (module -> functions)
KERNELS = {"mini.kernels.sparse_attention": ["sparse_mla_attention"], "mini.kernels.rope_quant": ["rope_quant"],
           "mini.kernels.indexer_scores": ["index_scores"], "mini.kernels.mhc_norm": ["mhc_norm"],
           "mini.kernels.mhc_expand": ["mhc_expand"], "mini.kernels.fp8_act_quant": ["fp8_act_quant"],
           "mini.kernels.mxfp4_grouped_gemm": ["grouped_swiglu", "grouped_down", "swiglu_rows"],
           "mini.kernels.moe_gate": ["gate_topk"], "mini.kernels.humming_experts": ["grouped_gemm"],
           "mini.kernels.flashmla_attention": ["sparse_prefill"]}


@dataclasses.dataclass
class OpCheck:
    op: str
    err: float  # ||fast - ref||
    noise: float  # ||ref - ref_fp32||
    size: float  # ||ref||
    same_nonfinite: bool

    @property
    def ok(self) -> bool:
        return self.same_nonfinite and self.err <= FACTOR * self.noise + FLOOR * self.size


def _import(name):
    import importlib
    return importlib.import_module(name)


def _tensors(x):
    return [t for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, torch.Tensor)]


def _fp32(x):
    if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
        return x.float()
    if isinstance(x, (list, tuple)):
        return type(x)(_fp32(v) for v in x)
    return x


def _norm(x: torch.Tensor) -> float:
    x = x.double()
    return float(x[torch.isfinite(x)].norm())


def compare(op: str, ref, fast, ref32) -> list[OpCheck]:
    out = []
    for r, f, r32 in zip(_tensors(ref), _tensors(fast), _tensors(ref32)):
        if r.dtype in (torch.int64, torch.int32, torch.bool):
            continue
        fin = torch.isfinite(r)
        same = bool(torch.equal(fin, torch.isfinite(f))) and r.shape == f.shape
        r64 = r.double().where(fin, 0)
        out.append(OpCheck(op, _norm(f.double().where(fin, 0) - r64) if same else float("inf"),
                           _norm(r32.double().where(fin, 0) - r64), _norm(r64), same))
    return out


@contextlib.contextmanager
def op_checks(results: list[OpCheck]):
    """Every dispatched op call (made under the reference backend) is also run fast and in fp32; `results` gets
    one OpCheck per floating output. The model continues with the reference result."""
    saved = []

    def wrap(mod, name):
        fn = getattr(mod, name)

        def call(*args, **kw):
            if mini.ops.backend() != "reference":  # the shadow run of level 2: the fast path as it is
                return fn(*args, **kw)
            # the step's plan was made under the reference backend: each run below decides for its own call
            kw = {k: v for k, v in kw.items() if k != "step"}
            with using_backend("reference"):
                ref = fn(*args, **kw)
                ref32 = fn(*_fp32(args), **{k: _fp32(v) for k, v in kw.items()})
            with using_backend("fast"):
                fast = fn(*args, **kw)
            results.extend(compare(name, ref, fast, ref32))
            return ref
        saved.append((mod, name, fn))
        setattr(mod, name, call)
    try:
        for m, n in OPS:
            wrap(_import(m), n)
        yield
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)


@contextlib.contextmanager
def coverage(counts: dict[str, int]):
    """Counts calls of the kernels' entry points (by "module.function") while the block runs."""
    saved = []
    try:
        for m, names in KERNELS.items():
            try:
                mod = _import(m)
            except ImportError:
                continue
            for n in names:
                fn = getattr(mod, n, None)
                if fn is None:
                    continue

                def counted(*a, _fn=fn, _key=f"{m.split('.')[-1]}.{n}", **kw):
                    counts[_key] = counts.get(_key, 0) + 1
                    return _fn(*a, **kw)
                saved.append((mod, n, fn))
                setattr(mod, n, counted)
        yield counts
    finally:
        for mod, n, fn in reversed(saved):
            setattr(mod, n, fn)


# ------------------------------------------------------------------------------------------------ the model runs
def build(cfg, device, dtype, seed: int):
    from mini.testing.rank_model import hasher_of
    from mini.checkpoint import random_state
    from mini.model import Model
    model = Model(cfg, random_state(cfg, device, seed), device, dtype)
    model.hasher = hasher_of(cfg)
    return model


def block_tokens_of(cfg) -> int:
    """A cache block size every compress ratio divides (V4's 128 included)."""
    return max(16, *cfg.compress_ratios)


def run_schedule(model, tokens: list[int], chunks: list[int], decode: int, block_tokens: int | None = None):
    """Logits [rows, vocab] fp32 of: prefill chunks of the given lengths (every row of each chunk), then `decode`
    single-token steps fed the next prompt tokens (teacher forcing: both backends see the same history)."""
    from mini.model import Batch, KVCache, SeqChunk
    cfg, dev = model.config, model.device
    block_tokens = block_tokens or block_tokens_of(cfg)
    total = sum(chunks) + decode
    blocks = list(range(-(-total // block_tokens)))
    cache = KVCache(cfg, 2, len(blocks) + 1, block_tokens, dev, model.dtype)
    out, start = [], 0
    for n in chunks + [1] * decode:
        batch = Batch.build([SeqChunk(tokens[:start + n], start, 1, blocks)], cfg, dev, model.hasher)
        batch = dataclasses.replace(batch, logit_rows=torch.arange(n, device=dev))
        out.append(model.forward(batch, cache).float())
        start += n
    return torch.cat(out)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@dataclasses.dataclass
class Report:
    seed: int
    config: str
    ops: list[OpCheck]
    layers: list[dict]
    e2e: dict[str, dict]
    kernels: dict[str, int]
    seconds: float

    def failures(self) -> list[str]:
        bad = [f"op {c.op}: err {c.err:.3g} > {FACTOR} x noise {c.noise:.3g} + {FLOOR} x size {c.size:.3g}"
               + ("" if c.same_nonfinite else " (inf/NaN pattern or shape differs)") for c in self.ops if not c.ok]
        bad += [f"layer {r['layer']} {r['kind']}: same-input err {r['err']:.3g} > bound {r['bound']:.3g}"
                for r in self.layers if r["err"] > r["bound"]]
        for mode, m in self.e2e.items():
            if not m["rel_err"] <= m["bound"]:
                bad.append(f"{mode}: logits rel err {m['rel_err']:.3g} > bound {m['bound']:.3g}")
            if m["top1"] < m["top1_bound"]:
                bad.append(f"{mode}: top-1 agreement {m['top1']:.3f} < {m['top1_bound']:.3f}")
        return bad

    def summary(self) -> str:
        worst = max(self.ops, key=lambda c: c.err / max(FACTOR * c.noise + FLOOR * c.size, 1e-30), default=None)
        e2e = " ".join(f"{k} {m['rel_err']:.3g}/{m['bound']:.3g} top1 {m['top1']:.2f}" for k, m in self.e2e.items())
        w = f"worst op {worst.op} {worst.err:.3g} vs noise {worst.noise:.3g}" if worst else "no ops"
        return (f"seed {self.seed} [{self.seconds:.1f}s] {self.config}\n  {len(self.ops)} op outputs, {w}; "
                f"{e2e}\n  kernels {self.kernels}")


MODES = ("prefill", "chunked", "decode", "chunked_decode")


def check_config(seed: int, cfg, device, prompt: int = 24, chunks: tuple[int, ...] = (10, 9, 5), decode: int = 3,
                 layers: bool = True, modes: tuple[str, ...] = ("prefill", "chunked", "decode"),
                 make_model=None, tokens: list[int] | None = None) -> Report:
    """All three levels for `cfg` (weights and prompt drawn from `seed`). End-to-end `modes`: one prefill of the
    prompt; the prompt in `chunks`; one prefill then `decode` single-token steps; the chunks then the decode
    steps (one schedule covering both, for the slow CPU interpreter). `make_model(dtype)` and `tokens` (prompt +
    decode ids) replace the random weights and ids (a checkpoint's model, e.g. the official fixtures)."""
    assert sum(chunks) == prompt and set(modes) <= set(MODES), (chunks, prompt, modes)
    from configs import describe
    t0 = time.perf_counter()
    if tokens is None:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(3, cfg.vocab_size, (prompt + decode,), generator=g).tolist()
    assert len(tokens) >= prompt + decode
    make_model = make_model or (lambda dtype: build(cfg, device, dtype, seed))
    model = make_model(torch.bfloat16)
    ops: list[OpCheck] = []
    kernels: dict[str, int] = {}
    # level 1 (+ 2): one prefill of the prompt under the reference, each op also run fast and in fp32
    from mini.check.fastpath import prefill as recorded_prefill
    with using_backend("reference"), op_checks(ops), coverage(kernels):
        rec, _ = recorded_prefill(model, tokens[:prompt], block_tokens_of(cfg), None, shadow=layers)
    e2e_runs = {"prefill": ([prompt], 0), "chunked": (list(chunks), 0), "decode": ([prompt], decode),
                "chunked_decode": (list(chunks), decode)}
    e2e_runs = {m: e2e_runs[m] for m in modes}
    fast, ref = {}, {}
    with coverage(kernels):
        for mode, (ch, dec) in e2e_runs.items():
            with using_backend("fast"):
                fast[mode] = run_schedule(model, tokens, ch, dec)
            with using_backend("reference"):
                ref[mode] = run_schedule(model, tokens, ch, dec)
    del model
    model32 = make_model(torch.float32)
    with using_backend("reference"):
        rec32, _ = recorded_prefill(model32, tokens[:prompt], block_tokens_of(cfg), None)
        f32 = {mode: run_schedule(model32, tokens, ch, dec) for mode, (ch, dec) in e2e_runs.items()}
    rows = []
    if layers:
        for key, r in rec.out.items():
            noise = rel(r, rec32.out[key])
            rows.append({"layer": key[1], "kind": key[0], "err": rel(rec.shadow_out[key], r),
                         "bound": max(FACTOR * noise, LAYER_FLOOR)})
    e2e = {}
    for mode in e2e_runs:
        noise = rel(ref[mode], f32[mode])
        agree32 = float((ref[mode].argmax(-1) == f32[mode].argmax(-1)).float().mean())
        e2e[mode] = {"rel_err": rel(fast[mode], ref[mode]), "bound": E2E_FACTOR * noise + E2E_FLOOR,
                     "top1": float((fast[mode].argmax(-1) == ref[mode].argmax(-1)).float().mean()),
                     "top1_bound": agree32 - 0.15}
    return Report(seed, describe(cfg), ops, rows, e2e, kernels, time.perf_counter() - t0)
