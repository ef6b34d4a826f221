"""The vision encoder's speed at V4.1-Flash's real shape (issue 29 item 6), and the time to first token of a chat
carrying one such image, on one emulated EP rank.

    python3 tools/vision_speed.py [--json out.json]           # H200: the encoder, then the TTFT (scripts/gpu/fidelity.sh)
    python3 tools/vision_speed.py --small                     # CPU: tiny-v4.1-vl through the same code (tested)

Encoder: random bf16 weights of the tower (spec §2.8: 32 ViT blocks of 1024, 16 heads, MLP 2816, patch 14, the 3x3
aligner into V4.1-Flash's 5120) on the fast path (`encode_images`, batched), over one maximum-size image: the size
plan's largest square, 1302 x 1302 pixels = 93 x 93 patches -> 31 x 31 tokens, a 994-token span. The figure is the
median of `--repeat` timed calls after `--warmup`, with the achieved TFLOP/s (the GEMMs' and attention's FLOPs,
counted below). Target (issue 29): <= 50 ms. On CUDA one more call runs under torch's profiler: its GPU time by
kernel kind (attention, GEMMs, the encoder's Triton elementwise kernels, everything else) and its launch count.

TTFT (`--ttft`, default on): one prefill of `--text` text tokens around that image (half before, half after) through
the engine's path: `Model.build_batch` with the chunk's ImageSpan (its encoder call, SpanCache emptied before each
repeat), then `Model.forward` and the greedy token on the host. What is emulated: the model is rank 0 of `--ep`
(default 8) EP ranks, holding its 48 of 384 routed experts at real shape with random weights; the other ranks' MoE
work arrives through `mini.testing.emulated_ep.EmulatedEP` (their share of tokens computed locally, no NCCL), the
Engram tables are capped at `--engram-rows` rows (hash ids taken modulo), and the tokens are random ids. No
scheduling, HTTP or detokenization: the forward's time from the image and the ids to the first token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.config import preset  # noqa: E402


def vision_state(cfg, device, seed: int) -> dict:
    """Random tensors of the tower alone (`vision.*`, `aligner.*`, `image_*`), as make-checkpoint draws them."""
    from mini.checkpoint.inventory import weights
    from mini.checkpoint.make import _draw
    from mini.model.vision import VISION_PREFIXES
    state = {}
    for w in weights(cfg):
        if w.name.startswith(VISION_PREFIXES):
            state.update(_draw(w, cfg, seed, torch.device(device)))
    return state


def max_image(cfg, device):
    """An ImageInput of the size plan's largest square, random pixels (the encoder's work does not depend on them)."""
    from mini.model.image_input import ImageInput, plan_image
    plan = plan_image(8000, 8000, cfg)
    p = cfg.vision_patch_size
    patches = (torch.rand(plan.n_vit_h * plan.n_vit_w, 3, p, p, device=device) * 2 - 1).to(torch.bfloat16)
    return ImageInput(patches, plan, digest="max-image")


def encoder_flops(cfg, plan) -> float:
    """FLOPs of one image through the tower: patch embedding, per block the qkv / wo / MLP GEMMs and attention's
    two products over all N patches, the aligner's two GEMMs over the N / 9 cells."""
    n, c, inter, p = plan.n_vit_h * plan.n_vit_w, cfg.vision_dim, cfg.vision_inter_dim, cfg.vision_patch_size
    r2, cells = cfg.vision_downsample_ratio ** 2, plan.n_llm_h * plan.n_llm_w
    block = 2 * n * c * 3 * c + 2 * n * c * c + 2 * n * c * 2 * inter + 2 * n * inter * c + 2 * 2 * n * n * c
    return 2 * n * 3 * p * p * c + cfg.vision_n_layers * block + 2 * cells * (c * r2) * cfg.dim \
        + 2 * cells * cfg.dim * cfg.dim


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int, repeat: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def time_encoder(cfg, device, args) -> dict:
    from mini.ops.vision import VisionWeights, encode_images
    weights = VisionWeights.from_state(vision_state(cfg, device, args.seed), cfg)
    image = max_image(cfg, device)
    grid = [(image.plan.n_vit_h, image.plan.n_vit_w)]
    with torch.inference_mode():
        times = timed(lambda: encode_images([image.patches], grid, weights, batched=True), device, args.warmup,
                      args.repeat)
    ms = statistics.median(times) * 1e3
    flops = encoder_flops(cfg, image.plan)
    out = {"image_px": [image.plan.height, image.plan.width], "patches": image.plan.n_vit_h * image.plan.n_vit_w,
           "span_tokens": image.plan.n_tokens, "encoder_ms": ms, "encoder_ms_all": [t * 1e3 for t in times],
           "gflop": flops / 1e9, "tflops": flops / (ms * 1e-3) / 1e12}
    if args.profile and torch.device(device).type == "cuda":
        try:
            with torch.inference_mode():
                out["encoder_gpu_ms"] = profile_split(lambda: encode_images([image.patches], grid, weights,
                                                                            batched=True))
        except Exception as e:  # the split is a diagnosis: its failure is reported, the timings above stand
            out["encoder_gpu_ms"] = {"error": repr(e)}
    return out


def kind_of(kernel: str) -> str:
    """A GPU kernel's share of the encoder, by its name: attention (SDPA's cuDNN / flash / efficient kernels),
    gemm (cuBLAS / CUTLASS), vision_triton (mini/kernels/vision_*.py), other (torch's elementwise and copies)."""
    k = kernel.lower()
    if any(w in k for w in ("flash", "fmha", "attention", "cudnn", "sdpa", "efficient")):
        return "attention"
    if any(w in k for w in ("gemm", "cutlass", "nvjet", "cublas", "matmul", "sm90_xmma")):
        return "gemm"
    if any(w in k for w in ("add_rms_norm", "split_rope", "swiglu")):
        return "vision_triton"
    return "other"


def profile_split(fn) -> dict:
    """GPU ms of one encoder call by kind (`kind_of`), the launch count, and the eight costliest kernels."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    split = {"attention": 0.0, "gemm": 0.0, "vision_triton": 0.0, "other": 0.0}
    for e in kernels:
        split[kind_of(e.key)] += e.device_time_total / 1e3
    top = sorted(kernels, key=lambda e: -e.device_time_total)[:8]
    return {**split, "total": sum(split.values()), "launches": sum(e.count for e in kernels),
            "top": [[e.key[:90], e.count, e.device_time_total / 1e3] for e in top]}


def time_ttft(cfg, device, args) -> dict:
    """One prefill of text + the image + text on one emulated EP rank, from the ids and the image to the token."""
    import mini.ops
    from mini.checkpoint import expert_range
    from mini.model.batch import SeqChunk
    from mini.model.cache import KVCache
    from mini.model.image_input import expand_prompt
    from mini.testing.emulated_ep import EmulatedEP
    from mini.testing.rank_model import hasher_of, rank_model
    if torch.device(device).type == "cuda":
        mini.ops.set_backend("fast")
    experts = expert_range(cfg, 0, args.ep)
    t0 = time.perf_counter()
    model = rank_model(cfg, device, torch.bfloat16, args.seed, experts, args.engram_rows,
                       EmulatedEP(args.ep, args.seed, "uniform", experts))
    model.hasher = hasher_of(cfg)  # a stand-in token map: the same work as the real one
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(args.seed)
    text = torch.randint(3, cfg.vocab_size - 8, (args.text,), generator=g).tolist()
    image = max_image(cfg, device)
    half = args.text // 2
    prompt = expand_prompt(text[:half] + [cfg.image_token_id] + text[half:], [image], cfg)
    block_tokens = 256
    n_blocks = -(-len(prompt.ids) // block_tokens)
    cache = KVCache(cfg, 1, n_blocks, block_tokens, device, torch.bfloat16)
    chunk = SeqChunk(prompt.ids, 0, 0, list(range(n_blocks)), images=prompt.spans())

    def first_token() -> int:
        model.span_cache.spans.clear()  # the image is new to every repeat: its encoder call is timed too
        batch = model.build_batch([chunk], device)
        if batch.engram is not None and args.engram_rows:
            batch.engram.data = batch.engram.data % args.engram_rows  # the capped tables' rows
        return int(model.forward(batch, cache)[-1].argmax())

    with torch.inference_mode():
        times = timed(first_token, device, args.warmup, args.repeat)
    return {"ttft_ms": statistics.median(times) * 1e3, "ttft_ms_all": [t * 1e3 for t in times],
            "prompt_tokens": len(prompt.ids), "text_tokens": args.text, "ep": args.ep, "build_s": build_s,
            "emulated": "rank 0 of EP{}: its routed experts at real shape, random weights, the other ranks' MoE "
                        "computed locally (EmulatedEP), Engram tables capped at {} rows".format(args.ep,
                                                                                      args.engram_rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny-v4.1-vl on the CPU (a test of this script)")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --small")
    p.add_argument("--warmup", type=int, default=None, help="default 3 (1 with --small)")
    p.add_argument("--repeat", type=int, default=None, help="default 10 (2 with --small)")
    p.add_argument("--no-ttft", dest="ttft", action="store_false", help="the encoder only")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="CUDA: no profiled encoder call (by default one, its GPU time split by kernel kind)")
    p.add_argument("--text", type=int, default=1024, help="text tokens of the TTFT prompt")
    p.add_argument("--ep", type=int, default=4, help="EP ranks of the TTFT model (it is rank 0)")
    p.add_argument("--engram-rows", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.small:
        cfg = preset("tiny-v4.1-vl")
        args.device = args.device or "cpu"
        args.text, args.ep = min(args.text, 64), 2
    else:
        cfg = preset("v4.1-flash").replace(vision=True)
        args.device = args.device or "cuda"
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 3)
    args.repeat = args.repeat if args.repeat is not None else (2 if args.small else 10)
    out = {"config": "tiny-v4.1-vl" if args.small else "v4.1-flash (vision)", "device": args.device,
           **time_encoder(cfg, args.device, args)}
    print(f"encoder: {out['image_px'][0]}x{out['image_px'][1]} px, {out['patches']} patches, {out['span_tokens']}-"
          f"token span: {out['encoder_ms']:.2f} ms (median of {args.repeat}), {out['tflops']:.3g} TFLOP/s "
          f"({out['gflop']:.3g} GFLOP)", flush=True)
    if "encoder_gpu_ms" in out and "error" in out["encoder_gpu_ms"]:
        print(f"encoder profile failed: {out['encoder_gpu_ms']['error']}", flush=True)
    elif "encoder_gpu_ms" in out:
        g = out["encoder_gpu_ms"]
        print("encoder GPU time (one profiled call): " + ", ".join(
            f"{k} {g[k]:.2f} ms" for k in ("attention", "gemm", "vision_triton", "other", "total")) +
            f", {g['launches']} launches", flush=True)
    if args.ttft:
        out.update(time_ttft(cfg, args.device, args))
        print(f"TTFT: {out['prompt_tokens']} tokens ({out['text_tokens']} text + the image) on one emulated rank of "
              f"EP{out['ep']}: {out['ttft_ms']:.1f} ms (median of {args.repeat}; model built in "
              f"{out['build_s']:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
