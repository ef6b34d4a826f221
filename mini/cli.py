"""`mini` command line: generate, logits, make-checkpoint, serve, bench, check, profile.

Every subcommand imports what it needs lazily, so `mini --help` stays fast and a missing optional part only
affects its own command.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from mini.args import (UsageError, add_engine_args, add_model_args, add_serve_args, check_model, count, engine_opts,
                       non_negative, resolve_device)


def cmd_generate(args) -> int:
    from mini.parallel.launch import generate_torchrun, under_torchrun
    from mini.engine import LLM, SamplingParams
    from mini.chat_format import render_chat
    check_model(args.model)
    opts = engine_opts(args)
    # on CPU the cache is sized by a block count (on CUDA from free memory): enough for this one request
    if args.num_blocks is None and not opts["device"].startswith("cuda"):
        opts["num_blocks"] = 8 + (args.max_tokens + 4096) // args.block_tokens
    marker = "<mini-image>"  # --image: each image's place, before the prompt's text (one user message with --chat)
    content = [{"type": "text", "text": marker} for _ in args.image] + [{"type": "text", "text": args.prompt}]
    prompt = render_chat([{"role": "user", "content": content}]) if args.chat else \
        marker * len(args.image) + args.prompt
    if under_torchrun():  # DP ranks: the prompt runs on rank 0, the others serve its MoE layers
        with_images = None
        if args.image:
            def with_images(engine):
                return _prompt_with_images(prompt, marker, args.image, engine)
        return generate_torchrun(args, prompt, opts.get("num_blocks"), with_images)
    try:
        llm = LLM(args.model, **opts)
    except ValueError as e:  # an option the model cannot take (--speculative dspark without mtp.*)
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    images = None
    if args.image:
        try:
            prompt, images = _prompt_with_images(prompt, marker, args.image, llm.engine)
        except (OSError, ValueError) as e:
            print(f"error: --image: {e}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, images=images)[0]
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
    check_model(args.model)
    device, dtype = resolve_device(args)
    try:
        ids = [int(t) for t in args.ids.split(",") if t.strip()]
        forced = [int(t) for t in (args.force_tokens or "").split(",") if t.strip()]
    except ValueError:
        print(f"error: --ids and --force-tokens must be comma-separated integers, got {args.ids!r}, "
              f"{args.force_tokens!r}", file=sys.stderr)
        return 2
    # with --dspark the step after the last decode step is forced too: it is the last draft's anchor
    fed = max(len(forced) - 1, 0) if args.dspark else len(forced)
    if forced and args.decode not in (0, fed):
        print(f"error: --decode {args.decode} but --force-tokens gives {len(forced)} tokens"
              + (" (N + 1 for N steps with --dspark)" if args.dspark else ""), file=sys.stderr)
        return 2
    steps = fed or args.decode
    model, cfg, _ = load_model(args.model, device=device, dtype=dtype)
    prompt = None  # --image: the prompt with every image placeholder expanded to its span (mini.model.image_input)
    if args.image:
        try:
            prompt = _expand_images(ids, args.image, cfg)
        except (OSError, ValueError) as e:
            print(f"error: --image: {e}", file=sys.stderr)
            return 2
        ids = prompt.ids
    if not ids or min(ids + forced) < 0 or max(ids + forced) >= cfg.vocab_size:
        print(f"error: --ids (non-empty) and --force-tokens must be token ids in [0, {cfg.vocab_size})",
              file=sys.stderr)
        return 2
    if args.dspark and model.dspark is None:
        print(f"error: --dspark: {args.model} has no DSpark draft module (mtp.*)", file=sys.stderr)
        return 2
    drafter = _Drafts(model, cfg, device, dtype) if args.dspark else None
    total = len(ids) + steps
    block_tokens = 128
    cache = KVCache(cfg, n_slots=1, n_blocks=(total + block_tokens - 1) // block_tokens, block_tokens=block_tokens,
                    device=device, dtype=dtype)
    blocks = list(range(cache.n_blocks))
    with torch.inference_mode():
        history = list(ids) if prompt is None else prompt.engram_ids()  # image positions: dead for Engram
        images = None if prompt is None else _image_rows(model, prompt, device)
        batch = Batch.build([SeqChunk(tokens=history, start=0, slot=0, blocks=blocks)], cfg, device,
                            hasher=model.hasher)
        batch = dataclasses.replace(batch, logit_rows=torch.arange(len(ids), device=batch.input_ids.device),
                                    images=images)
        prefill = model.forward(batch, cache)  # every prompt position
        if drafter:
            drafter.write(batch)
        decode_logits = []
        nxt = int(prefill[-1].argmax())
        for step in range(steps):  # fed the forced tokens when given (decode by definition), else greedy ones
            history.append(forced[step] if forced else nxt)
            batch = Batch.build([SeqChunk(tokens=history, start=len(history) - 1, slot=0, blocks=blocks)], cfg,
                                device, hasher=model.hasher)
            row = model.forward(batch, cache)[0]
            decode_logits.append(row)
            nxt = int(row.argmax())
            if drafter:  # the step's features go into the rings, then a draft anchored on the next token
                drafter.write(batch)
                drafter.propose(forced[step + 1] if forced else nxt, len(history) - 1)
    decoded = torch.stack(decode_logits) if decode_logits else torch.empty(0, cfg.vocab_size)
    np.savez(args.out, prefill=prefill.float().cpu().numpy(), decode=decoded.float().cpu().numpy(),
             **({} if prompt is None else {"token_types": np.array(prompt.token_types, dtype=np.int64)}),
             tokens=np.array(history[len(ids):], dtype=np.int64), ids=np.array(ids, dtype=np.int64),
             **(drafter.arrays() if drafter else {}))
    print(f"wrote {args.out}: prefill {tuple(prefill.shape)}, decode {tuple(decoded.shape)}"
          + (f", {steps} DSpark drafts of {cfg.dspark_block_size}" if drafter else ""))
    return 0


class _Drafts:
    """`mini logits --dspark`: DSpark drafts along the decode, as the official driver makes them (the f4 fixture):
    the prefill's features seed the rings; after each decode step at position p its features are written and a
    draft is made, anchored on the token at p + 1."""

    def __init__(self, model, cfg, device, dtype):
        from mini.model.dspark import DSparkRings
        self.model, self.cfg, self.rings, self.drafts = model, cfg, DSparkRings(cfg, 1, device, dtype), []

    def write(self, batch) -> None:
        from mini.model.dspark import write_rings
        write_rings(self.model.dspark, self.cfg, self.model.target_features, batch.positions,
                    batch.slots[batch.seq_of], self.rings)

    def propose(self, anchor: int, position: int) -> None:
        import torch

        from mini.model.dspark import propose
        dev = self.model.embed.device
        self.drafts.append(propose(self.model.dspark, self.cfg, self.model.embed, self.model.head, self.rings,
                                   torch.tensor([anchor], device=dev), torch.tensor([position], device=dev),
                                   torch.tensor([0], device=dev)))

    def arrays(self) -> dict:
        import numpy as np
        k, V = self.cfg.dspark_block_size, self.cfg.vocab_size

        def stack(field, shape, dtype):
            if not self.drafts:
                return np.zeros((0, *shape), dtype)
            return np.concatenate([getattr(d, field).float().cpu().numpy() for d in self.drafts]).astype(dtype)
        return {"dspark_logits": stack("logits", (k, V), np.float32),
                "dspark_draft_ids": stack("ids", (k,), np.int64),
                "dspark_confidence": stack("confidence", (k,), np.float32)}


def _prompt_with_images(text: str, marker: str, paths: list[str], engine):
    """`mini generate --image`: (prompt ids with each marker expanded to its image's span, [the spans])."""
    from pathlib import Path

    from mini.model.image_input import expand_prompt, load_image, marked_ids
    cfg = engine.config
    if not engine.model.reads_images:
        raise ValueError("this model has no vision tower")
    ids = marked_ids(text, marker, engine.tokenizer.encode, cfg.image_token_id)
    prompt = expand_prompt(ids, [load_image(Path(p).read_bytes(), cfg) for p in paths], cfg)
    return prompt.ids, [prompt.spans()]


def _expand_images(ids: list[int], paths: list[str], cfg):
    """`mini logits --image`: the k-th `image_token_id` of `ids` becomes the span of the k-th image file."""
    from pathlib import Path

    from mini.model.image_input import expand_prompt, load_image
    if not cfg.vision:
        raise ValueError("this model has no vision tower")
    return expand_prompt(ids, [load_image(Path(p).read_bytes(), cfg) for p in paths], cfg)


def _image_rows(model, prompt, device):
    """The prefill's image rows: each span's embeddings (the vision tower, once per image) at its positions."""
    from mini.model.vision import ImageRows
    return ImageRows.of(list(zip(prompt.starts, model.vision.spans(prompt.images))), device)


def cmd_make_checkpoint(args) -> int:
    import shutil
    from pathlib import Path

    from mini.args import REAL_SIZE_BYTES
    from mini.checkpoint.make import checkpoint_bytes, make_checkpoint
    from mini.config import PRESETS
    size = checkpoint_bytes(PRESETS[args.preset])
    out = Path(args.out_dir)
    existing = next((p for p in (out, *out.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(existing).free
    print(f"{args.preset}: {size / 1e9:,.3f} GB of random weights into {out} ({free / 1e9:,.1f} GB free there)",
          file=sys.stderr)
    if size > REAL_SIZE_BYTES and not args.yes:
        raise UsageError(f"{args.preset} is a real-size model ({size / 1e9:,.0f} GB); pass --yes to write it")
    if size > free:
        raise UsageError(f"not enough free space in {existing}: the checkpoint takes {size / 1e9:,.1f} GB, "
                         f"{free / 1e9:,.1f} GB are free")
    make_checkpoint(args.preset, out, seed=args.seed, progress=True)
    print(f"wrote {out}")
    return 0


def cmd_serve(args) -> int:
    from mini.parallel.launch import under_torchrun
    from mini.parallel.serve import serve_local, serve_torchrun
    check_model(args.model)
    resolve_device(args)  # a missing GPU is a usage error here, before any rank starts
    if under_torchrun():
        if args.ep not in (None, 1):
            raise UsageError("--ep starts its own ranks; under torchrun use --nproc-per-node")
        return serve_torchrun(args, serve_dp_http)
    if args.ep is not None and args.ep > 1:
        return serve_local(args, args.ep, serve_dp_http)
    from mini.server import serve
    return serve(args) or 0


def serve_dp_http(args, engine, driver, routes: dict) -> None:
    """Rank 0 of `mini serve` over DP ranks (mini.parallel.serve): the HTTP server over the engine the ranks
    built, its steps run by `driver`, plus GET `routes` (path -> fn() -> dict); serves until stopped."""
    from mini.engine.async_engine import AsyncLLM
    from mini.server import create_app
    from mini.server.app import policy_from_args, run_http
    from mini.server.metrics import ServerMetrics
    metrics = ServerMetrics(engine)  # gauges (cache use, queue) are rank 0's engine only
    llm = AsyncLLM(engine, on_output=metrics.observe, driver=driver)
    try:
        app = create_app(llm, metrics, args.served_model_name or args.model, policy_from_args(args))
        app.router.on_shutdown.append(llm.shutdown)  # before uvicorn re-raises the signal that stopped it
        for path, status in routes.items():
            app.get(path)(status)
        run_http(app, args)
    finally:
        llm.shutdown()


def cmd_bench(argv: list[str]) -> int:
    from mini.bench import main as bench_main
    return bench_main(argv) or 0


def cmd_check(argv: list[str]) -> int:
    from mini.check import main as check_main
    return check_main(argv) or 0


def cmd_profile(argv: list[str]) -> int:
    from mini.bench.profile import main as profile_main
    return profile_main(argv) or 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line instead of the usage block (which `--help` shows)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mini", description="Inference engine for DeepSeek-V4.1-Flash / V4")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(g)
    add_engine_args(g)
    g.set_defaults(max_num_seqs=4)  # one prompt
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=count(1), default=32)
    g.add_argument("--temperature", type=non_negative, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the V4.1 chat format")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image (PNG, JPEG, WebP, GIF) before the prompt's text, in order; repeatable (a model with "
                        "a vision tower, e.g. tiny-v4.1-vl)")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(fn=cmd_generate)
    lg = sub.add_parser("logits", help="write fp32 logits of a prefill and N greedy decode steps (parity checks)")
    add_model_args(lg)
    lg.add_argument("--ids", required=True, help="comma-separated prompt token ids")
    lg.add_argument("--decode", type=count(0), default=0)
    lg.add_argument("--force-tokens", default=None, metavar="IDS",
                    help="comma-separated tokens that the decode steps are fed instead of greedy ones")
    lg.add_argument("--dspark", action="store_true",
                    help="also write DSpark drafts after every decode step (dspark_logits [N, block, V], "
                         "dspark_draft_ids, dspark_confidence); --force-tokens then takes N + 1 ids, the last "
                         "being the last draft's anchor")
    lg.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="an image (PNG, JPEG, WebP, GIF) for the next image_token_id in --ids, in order; "
                         "repeat for several. `prefill` then has a row per position of the expanded prompt, "
                         "`ids` and `token_types` (-1 text, 0 start, 1 image, 2 newline, 3 end) describe it. Without "
                         "--image every id is text, image_token_id too (as the text-only reference takes it)")
    lg.add_argument("--out", required=True)
    lg.set_defaults(fn=cmd_logits)
    mc = sub.add_parser("make-checkpoint", help="write a random checkpoint in the official layout")
    mc.add_argument("preset", choices=_preset_names())
    mc.add_argument("out_dir")
    mc.add_argument("--seed", type=int, default=0)
    mc.add_argument("--yes", action="store_true", help="write a real-size checkpoint (hundreds of GB)")
    mc.set_defaults(fn=cmd_make_checkpoint)
    sv = sub.add_parser("serve", help="OpenAI-compatible server")
    add_serve_args(sv)
    sv.add_argument("--ep", type=count(1), default=None,
                    help="start N local EP/DP ranks (gloo on CPU, NCCL on GPU) and serve on rank 0")
    sv.set_defaults(fn=cmd_serve)
    sub.add_parser("bench", help="benchmark suites: mini bench --help")
    sub.add_parser("check", help="correctness checks beyond the unit tests: mini check --help")
    sub.add_parser("profile", help="per-stage profiler: mini profile --help")
    return p


def _preset_names() -> list[str]:
    from mini.config import PRESETS  # config imports no torch
    return list(PRESETS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # bench, check and profile parse their own arguments (each suite adds its own)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    if argv and argv[0] == "check":
        return cmd_check(argv[1:])
    if argv and argv[0] == "profile":
        return cmd_profile(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:  # a mistake in the command line: one line, no traceback
        print(f"mini {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
