"""Command-line arguments of the entry points, declared once: the model (`--model --device --dtype --backend`),
the engine (one flag per EngineOptions field), and the server (`--host --port --api-key` ...).

`mini generate`, `mini serve`, `mini bench tiny-goodput` and the DP ranks of `mini serve --ep` all read them
from here. Nothing here imports torch at module level, so `mini --help` stays fast. Bad values stop argparse
(one line, exit code 2); `resolve_device` and `check_model` raise UsageError for the mistakes argparse cannot see
(no GPU, no such checkpoint), which the CLI prints as one line with exit code 2.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from mini import switches


class UsageError(Exception):
    """A mistake in the command line: the CLI prints the message as one line and exits with code 2."""


# ---------------------------------------------------------------------------------------------------- value types
def count(minimum: int):
    """argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def _number(text: str, ok, want: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    return _number(text, lambda v: 0 < v <= 1, "in (0, 1]")


def drafter_name(text: str) -> str:
    """argparse type: a drafter for speculative decoding (EngineOptions.speculative): "dspark"."""
    if text != "dspark":
        raise argparse.ArgumentTypeError(f"the one drafter is 'dspark' (the model's own mtp.* module), got {text!r}")
    return text


def unit_interval(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    return _number(text, lambda v: 0 <= v <= 1, "in [0, 1]")


def non_negative(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number(text, lambda v: 0 <= v < float("inf"), "a finite number >= 0")


def device_name(text: str) -> str:
    """argparse type: cpu, cuda or cuda:N."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


# ---------------------------------------------------------------------------------------------------- model
def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-v4.1", help="checkpoint directory or preset name (default: tiny-v4.1)")
    p.add_argument("--device", default=None, type=device_name,
                   help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation dtype")
    p.add_argument("--backend", default=None, choices=["reference", "fast"], help="ops backend (default: fast on CUDA)")


def resolve_device(args) -> tuple[str, object]:
    """(device, torch dtype) of the parsed model arguments; sets the ops backend when one was asked for."""
    import torch

    from mini import ops
    if args.backend:
        ops.set_backend(args.backend)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise UsageError(f"--device {device}: no CUDA GPU is visible (torch {torch.__version__} is {build}); "
                         "use --device cpu")
    return device, getattr(torch, args.dtype)


# a preset bigger than this is a real-size model: its random checkpoint is only written when asked for explicitly
REAL_SIZE_BYTES = 4 << 30


def check_model(name: str) -> None:
    """UsageError unless `name` is a checkpoint directory, or a preset whose random checkpoint is small or already
    written (a real-size one is hundreds of GB: `mini make-checkpoint PRESET DIR --yes` writes it on purpose)."""
    from mini.config import PRESETS
    path = Path(name)
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {name}: {path} has no config.json (not a checkpoint directory)")
        return
    if name not in PRESETS:
        raise UsageError(f"--model {name}: no such directory, and not a preset (presets: {', '.join(PRESETS)})")
    from mini.checkpoint.make import checkpoint_bytes
    from mini.model.load import cache_dir
    size = checkpoint_bytes(PRESETS[name])
    if size > REAL_SIZE_BYTES and not (cache_dir() / f"{name}-seed0" / "config.json").exists():
        raise UsageError(f"--model {name}: a random checkpoint of this preset takes {size / 1e9:,.0f} GB; write it on "
                         f"purpose with `mini make-checkpoint {name} DIR --yes` and pass --model DIR")


# ---------------------------------------------------------------------------------------------------- engine
@dataclass(frozen=True)
class Flag:
    """One engine flag; `dest` is the EngineOptions field it sets."""
    name: str
    default: object
    help: str
    type: object = None  # None: a boolean (--x / --no-x)

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


ENGINE_FLAGS = (
    Flag("--max-num-seqs", 64, "sequences in a batch", count(1)),
    Flag("--max-num-batched-tokens", 2048, "token budget of one step", count(1)),
    Flag("--block-tokens", 128, "positions per cache block", count(1)),
    Flag("--num-blocks", None, "cache blocks (default: from free GPU memory; 1 GiB on CPU)", count(1)),
    Flag("--gpu-memory-utilization", 0.9, "fraction of GPU memory mini may use; the cache gets what the model leaves",
         fraction),
    Flag("--enable-prefix-caching", True, "reuse the cache of repeated prompt prefixes"),
    Flag("--num-snapshots", 32, "state snapshots kept for prefix caching", count(0)),
    Flag("--snapshot-prompt-end", False, "split each prompt at its last block boundary so that its first repeat "
         "hits the prefix cache (one extra step of TTFT)"),
    Flag("--max-model-len", None, "longest prompt + output in tokens (default: the model's, capped by the cache)",
         count(2)),
    Flag("--enforce-eager", False, "run decode steps eagerly (default on CUDA: replay CUDA graphs captured at "
         "start-up)"),
    Flag("--deterministic", False, "a request's tokens and logprobs do not depend on what else is batched with "
         "it: batch-invariant kernels, fixed prefill chunks, prefix caching off (docs/design.md, Determinism)"),
    Flag("--speculative", None, "speculative decoding with this drafter: 'dspark', the model's own mtp.* module "
         "(each step verifies its drafts; outputs equal plain decode's; eager steps; docs/engine.md)", drafter_name),
    Flag("--spec-tokens", None, "the longest draft with --speculative (default: the drafter's own, DSpark's "
         "block of 5)", count(1)),
    Flag("--spec-min-confidence", 0.0, "with --speculative: a draft stops at its first token whose confidence "
         "(DSpark's head, a probability) is below this (0: fixed length)", unit_interval),
    Flag("--spec-max-rows", 384, "with --speculative: a step's verify rows (1 + draft length per decoding sequence) "
         "at most; drafts shrink, to none, as the batch grows (the default is from proxy cost figures; "
         "docs/engine.md)", count(1)),
    Flag("--spec-adaptive", True, "with --speculative: each sequence's draft is as long as its drafts' past "
         "acceptance (beside the engine's) pays by measured step costs, none where they keep failing (two-token "
         "probes every 32 steps "
         "see a drafter that turns good); --no-spec-adaptive: drafts always as long as the other rules allow "
         "(docs/engine.md)"),
)


def add_engine_args(p: argparse.ArgumentParser, unset: bool = False) -> None:
    """The engine flags. `unset`: every default is None (a benchmark that forwards only the flags given to the
    server it starts, which then applies its own defaults)."""
    for f in ENGINE_FLAGS:
        default = None if unset else f.default
        if f.type is None:
            p.add_argument(f.name, action=argparse.BooleanOptionalAction, default=default, help=f.help)
        else:
            shown = "" if f.default is None or unset else f" (default: {f.default})"
            p.add_argument(f.name, type=f.type, default=default, help=f.help + shown)


def engine_argv(args) -> list[str]:
    """The engine flags of parsed `args` that are set, as command-line arguments again."""
    argv = []
    for f in ENGINE_FLAGS:
        value = getattr(args, f.dest, None)
        if value is None:
            continue
        argv += [f.name if value else "--no-" + f.name[2:]] if f.type is None else [f.name, str(value)]
    return argv


def engine_opts(args) -> dict:
    """EngineOptions keyword arguments of parsed model + engine arguments (device and dtype resolved)."""
    device, dtype = resolve_device(args)
    opts = {f.dest: getattr(args, f.dest) for f in ENGINE_FLAGS if getattr(args, f.dest, None) is not None}
    return {**opts, "device": device, "dtype": dtype, **({"seed": args.seed} if hasattr(args, "seed") else {})}


# ---------------------------------------------------------------------------------------------------- server
DEFAULT_MAX_BODY_MB = 16  # mini.server.guard.DEFAULT_MAX_BODY_BYTES, in MB


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`mini serve`: model, engine and server flags."""
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=count(0), default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--seed", type=int, default=0, help="seeds requests that bring none")
    p.add_argument("--api-key", default=switches.current().api_key,
                   help="clients must send `Authorization: Bearer KEY` (everything but /health); "
                        "default: $MINI_API_KEY, else no key")
    p.add_argument("--responses-db", default=str(Path("~/.cache/mini/responses.sqlite3").expanduser()),
                   help="SQLite file of the Responses API's stored responses, kept across restarts "
                        "(default: ~/.cache/mini/responses.sqlite3; ':memory:' keeps none)")
    p.add_argument("--responses-max", type=count(1), default=10_000,
                   help="stored responses kept; the oldest beyond go (default: 10000)")
    p.add_argument("--metrics-need-key", action="store_true",
                   help="/metrics takes the API key too (default: open to scrapers, as /health is)")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs in chat requests (public addresses only, 20 MB, 10 s; default: "
                        "only inline data: URLs)")
    p.add_argument("--allowed-origins", default="", help="comma-separated browser origins allowed to call the API "
                   "cross-origin (e.g. http://localhost:3000; default: none)")
    p.add_argument("--allowed-hosts", default=None, help="comma-separated Host header values accepted "
                   "('*': any; default: localhost names and --host)")
    p.add_argument("--max-body-mb", type=count(1), default=DEFAULT_MAX_BODY_MB,
                   help=f"largest request body in MB, larger get 413 (default: {DEFAULT_MAX_BODY_MB})")
    p.add_argument("--request-timeout", type=non_negative, default=30.0,
                   help="seconds a client may take to send a request's headers, and its body between chunks")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="before answering, run the step shapes the first requests use, so that their kernels are "
                        "compiled (default: on CUDA)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def split_list(text: str | None) -> tuple[str, ...]:
    return tuple(s.strip() for s in (text or "").split(",") if s.strip())
