"""`mini check fastpath`: the fast path (backend "fast": Triton kernels) against the reference path (backend
"reference": plain PyTorch, fp32-dequantized weights) on the same weights, in bf16.

(a) Real width. `--preset` (V4.1-Flash) cut to tiny-v4.1's 8-layer schedule, which keeps every layer kind: window
    only, Engram, the ratio-2 KV + index source and its consumer, the ratio-1 KV + index + candidate source and its
    consumer, a reindex source (scores inside the candidates) and its consumer. `--experts` routed experts (top-k
    kept); `--candidate-blocks` smaller than the real 2048 so that the candidate restriction is active at a
    `--tokens` prefill. One model, one prefill per backend, each with fresh caches; every attention and MoE
    sub-layer output and the logits of every row are recorded. Two comparisons:
    * chained: each backend runs its own stream, so a layer's error includes what the layers below passed on;
    * same input: during the reference forward each sub-layer is also run by the fast path on the reference's
      input (with its own caches), which isolates the error of that layer's kernels.
    For scale, the same weights in a float32-activation model (reference path) give bf16's own error
    (`*_bf16_vs_fp32`): the fast path should be well inside it.
(b) End to end. `--decode-preset` (tiny-v4.1) greedy: a `--prompt-len` random prompt, then `--decode-steps` decode
    steps, with each backend. Reported: whether the tokens are identical, the first step that differs and the
    reference's top-2 logit gap there (a near tie flipping is rounding, a large gap is a bug), the largest
    relative logit error over the steps before it, and the same error over every step when the fast path is fed
    the reference's tokens (teacher forcing); for scale, the float32-activation model fed the same tokens.

Relative errors are ||fast - ref|| / ||ref|| over the whole tensor. On a CPU both backends run the reference (the
fast path needs CUDA), so every error is exactly 0: that checks the harness, not the kernels.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from mini.ops import using_backend
from mini.formats.quant import no_fake_quant
from mini.testing.rank_model import hasher_of
from mini.config import ModelConfig, preset

SCHEDULE = "tiny-v4.1"  # the preset whose layer schedule the real-width check borrows


def add_args(p) -> None:
    p.add_argument("--preset", default="v4.1-flash", help="widths of the layer check")
    p.add_argument("--tokens", type=int, default=2048, help="prefill length of the layer check")
    p.add_argument("--experts", type=int, default=32, help="routed experts per layer (top-k kept)")
    p.add_argument("--candidate-blocks", type=int, default=128,
                   help="candidate_topk_blocks of the layer check (real: 2048, inactive below 16k tokens)")
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--engram-rows", type=int, default=1 << 16, help="rows kept per Engram table")
    p.add_argument("--no-fp32", action="store_true", help="skip the float32-activation model (bf16's own error)")
    p.add_argument("--decode-preset", default="tiny-v4.1")
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--decode-block-tokens", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-only", action="store_true", help="skip the real-width layer check")
    p.add_argument("--decode-no-fake-quant", action="store_true",
                   help="decode with the activation/KV fake quantization off: without its FP8/FP4 roundings, which "
                        "turn summation-order differences into whole quantization steps, the paths should agree")


# ---------------------------------------------------------------------------------------------------- helpers
def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).norm() / ref.norm())


def layer_config(args) -> ModelConfig:
    """`args.preset` at full width with the tiny schedule's layers, `args.experts` experts and candidate blocks."""
    s, base = preset(SCHEDULE), preset(args.preset)
    return base.replace(
        n_layers=s.n_layers, compress_ratios=s.compress_ratios, kv_source_layers=s.kv_source_layers,
        index_source_layers=s.index_source_layers, candidate_source_layer=s.candidate_source_layer,
        engram_layer_ids=s.engram_layer_ids, n_routed_experts=args.experts,
        n_activated_experts=min(base.n_activated_experts, args.experts),
        candidate_topk_blocks=args.candidate_blocks)


def build_model(cfg: ModelConfig, device, dtype, seed: int, engram_rows: int | None):
    from mini.checkpoint import random_state
    from mini.model import Model
    return Model(cfg, random_state(cfg, device, seed, engram_rows=engram_rows), device, dtype)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------- (a) layer outputs
class Recorder:
    """Wraps the model's attention and MoE calls (mini.model.model.attention, Model._ffn) for one forward:
    records each sub-layer's output by (kind, layer) and, with `shadow`, also runs the fast path on the same
    input with its own cache and published top-k, recording that output under `shadow_out`."""

    def __init__(self, shadow_cache=None):
        self.shadow_cache = shadow_cache
        self.out: dict[tuple[str, int], torch.Tensor] = {}
        self.shadow_out: dict[tuple[str, int], torch.Tensor] = {}
        self._shadow_shared = None  # the shadow forward's StepShared: the fast path's plan, its own top-k

    @contextlib.contextmanager
    def installed(self, model):
        import mini.model.model as mm
        from mini.model.attn_layer import StepShared
        attention, ffn = mm.attention, model._ffn

        def attn(x, w, plan, cfg, lay, cache, shared):
            y = attention(x, w, plan, cfg, lay, cache, shared)
            self.out[("attn", plan.layer)] = y.float()
            if self.shadow_cache is not None:
                with using_backend("fast"):
                    if self._shadow_shared is None:  # the step's plan under the fast backend
                        self._shadow_shared = StepShared(lay.plan(x.dtype))
                    z = attention(x, w, plan, cfg, lay, self.shadow_cache, self._shadow_shared)
                self.shadow_out[("attn", plan.layer)] = z.float()
            return y

        def moe(x, blk, input_ids, image_mask=None, step=None):  # Model._ffn's arguments
            y = ffn(x, blk, input_ids, image_mask, step)
            self.out[("moe", blk.plan.layer)] = y.float()
            if self.shadow_cache is not None:
                with using_backend("fast"):
                    z = ffn(x, blk, input_ids, image_mask, self._shadow_shared.step)
                self.shadow_out[("moe", blk.plan.layer)] = z.float()
            return y

        mm.attention, model._ffn = attn, moe
        try:
            yield self
        finally:
            mm.attention = attention
            del model._ffn  # the class's method again


def prefill(model, tokens: list[int], block_tokens: int, engram_rows: int | None, shadow: bool = False):
    """(Recorder, logits of every row) of one prefill of `tokens` from position 0 with fresh caches."""
    from mini.model import Batch, KVCache, SeqChunk
    cfg, dev = model.config, model.device
    blocks = list(range(-(-len(tokens) // block_tokens)))
    batch = Batch.build([SeqChunk(tokens, 0, 0, blocks)], cfg, dev, hasher_of(cfg))
    if batch.engram is not None and engram_rows:
        batch.engram.data = batch.engram.data % engram_rows  # hash ids -> the capped tables' rows
    batch.logit_rows = torch.arange(len(tokens), device=dev)

    def cache():
        return KVCache(cfg, 1, len(blocks), block_tokens, dev, model.dtype)
    rec = Recorder(cache() if shadow else None)
    with rec.installed(model):
        logits = model.forward(batch, cache())
    return rec, logits


def check_layers(args) -> tuple[dict, list[dict]]:
    """Metrics of (a) and one row per sub-layer for the notes."""
    cfg, dev = layer_config(args), torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(3, cfg.vocab_size, (args.tokens,), generator=g).tolist()
    model = build_model(cfg, dev, torch.bfloat16, args.seed, args.engram_rows)
    timings = {}
    with using_backend("reference"):
        t0 = time.perf_counter()
        ref, ref_logits = prefill(model, tokens, args.block_tokens, args.engram_rows, shadow=True)
        _sync(dev)
        timings["reference_with_shadow_s"] = time.perf_counter() - t0
    with using_backend("fast"):
        t0 = time.perf_counter()
        fast, fast_logits = prefill(model, tokens, args.block_tokens, args.engram_rows)
        _sync(dev)
        timings["fast_s"] = time.perf_counter() - t0  # includes the first call's kernel compiles
    del model
    f32 = f32_logits = None
    if not args.no_fp32:
        model = build_model(cfg, dev, torch.float32, args.seed, args.engram_rows)
        with using_backend("reference"):
            f32, f32_logits = prefill(model, tokens, args.block_tokens, args.engram_rows)
        del model

    metrics, rows = {}, []
    for (kind, layer), r in ref.out.items():
        row = {"layer": layer, "kind": kind, "rel_err": rel_err(fast.out[(kind, layer)], r),
               "rel_err_same_input": rel_err(ref.shadow_out[(kind, layer)], r)}
        if f32 is not None:
            row["bf16_vs_fp32"] = rel_err(r, f32.out[(kind, layer)])
        rows.append(row)
        metrics.update({f"L{layer}_{kind}_{k}": v for k, v in row.items() if k not in ("layer", "kind")})
    metrics["logits_rel_err"] = rel_err(fast_logits, ref_logits)
    metrics["logits_top1_agree"] = float((fast_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    if f32_logits is not None:
        metrics["logits_bf16_vs_fp32_rel_err"] = rel_err(ref_logits, f32_logits)
        metrics["logits_bf16_vs_fp32_top1_agree"] = float(
            (ref_logits.argmax(-1) == f32_logits.argmax(-1)).float().mean())
    metrics.update({f"prefill_{k}": v for k, v in timings.items()})
    return metrics, rows


# ------------------------------------------------------------------------------------------- (b) greedy decode
def greedy(model, prompt: list[int], steps: int, block_tokens: int, forced: list[int] | None = None):
    """(tokens, logits [steps + 1, vocab] fp32): the prefill's token, then `steps` decode steps. With `forced`,
    the history takes those tokens instead of this model's argmax (teacher forcing); `tokens` stays the argmax."""
    from mini.model import Batch, KVCache, SeqChunk
    cfg, dev = model.config, model.device
    blocks = list(range(-(-(len(prompt) + steps + 1) // block_tokens)))
    cache = KVCache(cfg, 1, len(blocks), block_tokens, dev, model.dtype)
    hasher = hasher_of(cfg)
    history, tokens, logits, start = list(prompt), [], [], 0
    for i in range(steps + 1):
        out = model.forward(Batch.build([SeqChunk(history, start, 0, blocks)], cfg, dev, hasher), cache)[0]
        tokens.append(int(out.argmax()))
        logits.append(out)
        start = len(history)
        history.append(forced[i] if forced is not None else tokens[-1])
    return tokens, torch.stack(logits)


def check_decode(args) -> dict:
    cfg, dev = preset(args.decode_preset), torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    model = build_model(cfg, dev, torch.bfloat16, args.seed, None)
    n, bt = args.decode_steps, args.decode_block_tokens
    with using_backend("reference"):
        ref_tokens, ref_logits = greedy(model, prompt, n, bt)
    with using_backend("fast"):
        fast_tokens, fast_logits = greedy(model, prompt, n, bt)
        forced_tokens, forced_logits = greedy(model, prompt, n, bt, forced=ref_tokens)

    def step_errs(a, b):
        return [rel_err(x, y) for x, y in zip(a, b)]

    top2 = ref_logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    differ = [i for i, (a, b) in enumerate(zip(fast_tokens, ref_tokens)) if a != b]
    first = differ[0] if differ else -1
    # the logits of step i are comparable while the histories agree: up to and including the first differing step
    same = slice(0, first + 1) if differ else slice(None)
    m = {"decode_tokens_identical": int(not differ), "decode_first_divergence_step": first,
         "decode_max_logit_rel_err": max(step_errs(fast_logits[same], ref_logits[same])),
         "decode_forced_max_logit_rel_err": max(step_errs(forced_logits, ref_logits)),
         "decode_forced_argmax_agree": float(np.mean([a == b for a, b in zip(forced_tokens, ref_tokens)])),
         "decode_ref_min_top2_gap": min(gaps), "decode_ref_median_top2_gap": float(np.median(gaps)),
         "decode_ref_logit_std": float(ref_logits.float().std(-1).mean())}
    if differ:
        m["decode_ref_top2_gap_at_divergence"] = gaps[first]
        m["decode_abs_logit_err_at_divergence"] = float((fast_logits[first] - ref_logits[first]).abs().max())
    if not args.no_fp32:  # bf16's own error on the same histories, for scale
        del model
        model = build_model(cfg, dev, torch.float32, args.seed, None)
        with using_backend("reference"):
            f32_tokens, f32_logits = greedy(model, prompt, n, bt, forced=ref_tokens)
            f32_free, _ = greedy(model, prompt, n, bt)
        # how long bf16 itself keeps float32's greedy tokens: the horizon any bf16 path can be expected to hold
        f32_differ = [i for i, (a, b) in enumerate(zip(f32_free, ref_tokens)) if a != b]
        m["decode_bf16_vs_fp32_first_divergence_step"] = f32_differ[0] if f32_differ else -1
        m["decode_bf16_vs_fp32_forced_max_logit_rel_err"] = max(step_errs(ref_logits, f32_logits))
        m["decode_bf16_vs_fp32_forced_argmax_agree"] = float(np.mean([a == b for a, b in zip(f32_tokens, ref_tokens)]))
        # bf16's own reach per step: a reference top-2 gap below twice it is a tie at bf16 resolution, which no
        # bf16 implementation (bf16 itself against fp32 included) can be expected to break the reference's way
        own = (f32_logits - ref_logits).abs().amax(-1).tolist()
        clear = [i for i, (gap, e) in enumerate(zip(gaps, own)) if gap >= 2 * e]
        m["decode_clear_steps"] = len(clear)
        m["decode_forced_argmax_disagree_at_clear_steps"] = sum(forced_tokens[i] != ref_tokens[i] for i in clear)
        if differ:
            m["decode_bf16_vs_fp32_abs_logit_err_at_divergence"] = own[first]
    return m


# ------------------------------------------------------------------------------------------------------ suite
def definition(args) -> dict:
    cfg = layer_config(args)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    return {"preset": args.preset, "layers": cfg.n_layers, "compress_ratios": list(cfg.compress_ratios),
            "dim": cfg.dim, "experts": cfg.n_routed_experts, "topk_experts": cfg.n_activated_experts,
            "candidate_blocks": cfg.candidate_topk_blocks, "tokens": args.tokens, "block_tokens": args.block_tokens,
            "engram_rows": args.engram_rows, "decode_preset": args.decode_preset, "prompt_len": args.prompt_len,
            "decode_steps": args.decode_steps, "decode_fake_quant": not args.decode_no_fake_quant, "dtype": "bfloat16",
            "seed": args.seed, "device": dev}


def run(args) -> dict:
    metrics, rows = ({}, []) if args.decode_only else check_layers(args)
    with no_fake_quant() if args.decode_no_fake_quant else contextlib.nullcontext():
        metrics.update(check_decode(args))
    return {"suite": "fastpath", "definition": definition(args), "metrics": metrics, "layers": rows}
