"""`mini` command line: generate, logits, make-checkpoint, serve, bench, profile.

Every subcommand imports what it needs lazily, so `mini --help` stays fast and a missing optional part only
affects its own command.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-v4.1", help="checkpoint directory or preset name (default: tiny-v4.1)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation dtype")
    p.add_argument("--backend", default=None, choices=["reference", "fast"], help="ops backend (default: fast on CUDA)")


def _setup(args) -> tuple:
    import torch

    from mini import ops
    if args.backend:
        ops.set_backend(args.backend)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, getattr(torch, args.dtype)


def cmd_generate(args) -> int:
    from mini.parallel.serve import generate_torchrun, under_torchrun
    from mini.engine import LLM, SamplingParams
    from mini.tokenizer import render_chat
    device, dtype = _setup(args)
    # on CPU the cache is sized by a block count (on CUDA from free memory): enough for this one request
    num_blocks = args.num_blocks or (None if device.startswith("cuda") else 8 + (args.max_tokens + 4096) // 128)
    prompt = render_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    if under_torchrun():  # DP ranks: the prompt runs on rank 0, the others serve its MoE layers
        return generate_torchrun(args, prompt, num_blocks)
    llm = LLM(args.model, device=device, dtype=dtype, num_blocks=num_blocks, max_num_seqs=4,
              enforce_eager=args.enforce_eager)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    dt = time.perf_counter() - t0
    print(out.text)
    n = len(out.token_ids)
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s, prompt {len(out.prompt_token_ids)} tokens]",
          file=sys.stderr)
    return 0


def cmd_logits(args) -> int:
    import numpy as np
    import torch

    from mini.model import Batch, KVCache, SeqChunk, load_model
    device, dtype = _setup(args)
    try:
        ids = [int(t) for t in args.ids.split(",") if t.strip()]
    except ValueError:
        print(f"error: --ids must be comma-separated integers, got {args.ids!r}", file=sys.stderr)
        return 2
    model, cfg, _ = load_model(args.model, device=device, dtype=dtype)
    if not ids or min(ids) < 0 or max(ids) >= cfg.vocab_size:
        print(f"error: --ids must be non-empty token ids in [0, {cfg.vocab_size})", file=sys.stderr)
        return 2
    total = len(ids) + args.decode
    block_tokens = 128
    cache = KVCache(cfg, n_slots=1, n_blocks=(total + block_tokens - 1) // block_tokens, block_tokens=block_tokens,
                    device=device, dtype=dtype)
    blocks = list(range(cache.n_blocks))
    with torch.inference_mode():
        batch = Batch.build([SeqChunk(tokens=ids, start=0, slot=0, blocks=blocks)], cfg, device, hasher=model.hasher)
        batch = dataclasses.replace(batch, logit_rows=torch.arange(len(ids), device=batch.input_ids.device))
        prefill = model.forward(batch, cache)  # every prompt position
        history, decode_logits = list(ids), []
        nxt = int(prefill[-1].argmax())
        for _ in range(args.decode):
            history.append(nxt)
            batch = Batch.build([SeqChunk(tokens=history, start=len(history) - 1, slot=0, blocks=blocks)], cfg,
                                device, hasher=model.hasher)
            row = model.forward(batch, cache)[0]
            decode_logits.append(row)
            nxt = int(row.argmax())
    decoded = torch.stack(decode_logits) if decode_logits else torch.empty(0, cfg.vocab_size)
    np.savez(args.out, prefill=prefill.float().cpu().numpy(), decode=decoded.float().cpu().numpy(),
             tokens=np.array(history[len(ids):], dtype=np.int64), ids=np.array(ids, dtype=np.int64))
    print(f"wrote {args.out}: prefill {tuple(prefill.shape)}, decode {tuple(decoded.shape)}")
    return 0


def cmd_make_checkpoint(args) -> int:
    from mini.checkpoint import make_checkpoint
    out = make_checkpoint(args.preset, args.out_dir, seed=args.seed)
    print(f"wrote {out}")
    return 0


def cmd_serve(args) -> int:
    from mini.parallel.serve import serve_local, serve_torchrun, under_torchrun
    if under_torchrun():
        if args.ep not in (None, 1):
            print("error: --ep starts its own ranks; under torchrun use --nproc-per-node", file=sys.stderr)
            return 2
        return serve_torchrun(args)
    if args.ep is not None and args.ep > 1:
        return serve_local(args, args.ep)
    from mini.server import serve
    return serve(args) or 0


def cmd_bench(argv: list[str]) -> int:
    from mini.bench import main as bench_main
    return bench_main(argv) or 0


def cmd_profile(argv: list[str]) -> int:
    from mini.bench.profile import main as profile_main
    return profile_main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # bench and profile parse their own arguments (each suite adds its own)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    if argv and argv[0] == "profile":
        return cmd_profile(argv[1:])
    p = argparse.ArgumentParser(prog="mini", description="Inference engine for DeepSeek-V4.1-Flash / V4")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    _model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the V4.1 chat format")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--num-blocks", type=int, default=None, help="cache blocks of 128 positions (default: sized)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    g.set_defaults(fn=cmd_generate)
    lg = sub.add_parser("logits", help="write fp32 logits of a prefill and N greedy decode steps (parity checks)")
    _model_args(lg)
    lg.add_argument("--ids", required=True, help="comma-separated prompt token ids")
    lg.add_argument("--decode", type=int, default=0)
    lg.add_argument("--out", required=True)
    lg.set_defaults(fn=cmd_logits)
    mc = sub.add_parser("make-checkpoint", help="write a random checkpoint in the official layout")
    mc.add_argument("preset")
    mc.add_argument("out_dir")
    mc.add_argument("--seed", type=int, default=0)
    mc.set_defaults(fn=cmd_make_checkpoint)
    sv = sub.add_parser("serve", help="OpenAI-compatible server")
    try:
        from mini.server import add_serve_args
        add_serve_args(sv)
    except ImportError:
        _model_args(sv)
    sv.add_argument("--ep", type=int, default=None,
                    help="start N local EP/DP ranks (gloo on CPU, NCCL on GPU) and serve on rank 0")
    sv.set_defaults(fn=cmd_serve)
    sub.add_parser("bench", help="benchmark suites: mini bench --help")
    sub.add_parser("profile", help="per-stage profiler: mini profile --help")
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
