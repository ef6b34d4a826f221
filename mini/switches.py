"""Every `MINI_*` environment variable, read and checked in one place (docs/design.md, "Switches").

This module is the only reader of `os.environ` for `MINI_*` names (tests/test_switches.py holds it to that): the
rest of mini asks `current()`, the process's one frozen `Switches` record, read on first use and kept. A bad value
is refused when the record is built, with the variable's name and the values it takes, never at the import of an
op file. What a switch *means* stays with the code that acts on it (named in each field's comment); the record
only says what was asked for. It is logged at start-up (mini.ops.backends.resolve, `mini serve`'s start-up line)
and stamped into every benchmark's JSON (mini.testing.suites.environment).

The record is read once per process, so a later change of the environment does not apply by itself: tests that
change a variable call `refresh()` (tests/conftest.py's `monkeypatch` does it for them).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path.home() / ".cache" / "mini"


@dataclass(frozen=True)
class Switches:
    # MINI_BACKEND, mini.ops.backend: "reference" | "fast"; None = unset (fast where CUDA is available)
    backend: str | None = None
    # MINI_MOE_GEMM, mini.ops.backends.moe_gemm: the routed experts' grouped GEMM library, "auto" | "humming" | "triton"
    moe_gemm: str = "auto"
    # MINI_SPARSE_ATTN, mini.ops.backends.sparse_attn: the sparse attention core's library for prefill-sized steps
    # and decode / verify steps of more than a few rows (FlashMLA over the cache's KeyStore), "auto" | "flashmla" |
    # "triton"
    sparse_attn: str = "auto"
    # MINI_DET_SPARSE_ATTN, mini.kernels.flashmla_attention: the deterministic mode's kernel for the queries of
    # multi-token chunks, "flashmla" | "triton"
    det_sparse_attn: str = "flashmla"
    # MINI_GEMV_WEIGHTS, mini.ops.linear: what the decode GEMV reads of an FP8 weight, "fp8" (the checkpoint's bytes
    # and scales, mini/kernels/gemv.py: half the bytes; at one row on the CUDA cores, the shared expert's w2 too;
    # at 2-16 rows on the tensor cores, on CUDA at 2-8 rows in the Gluon build gemv.MMA_REGISTERS, wo_a's groups and
    # the shared w2 too) | "fp8_triton" (so, but the Triton build at 2-16 rows: the Gluon build's A/B) | "fp8_row"
    # (so at one row only, the copy at 2-16) | "bf16" (its dequantized copy at every row count)
    gemv_weights: str = "fp8"
    # MINI_EP_GLUE, mini.parallel.exchange: the EP exchange's glue, "fused" | "eager"
    ep_glue: str = "fused"
    # MINI_EP_OVERLAP, mini.parallel.exchange: micro-batches per MoE layer's exchange (1 = not overlapped)
    ep_overlap: int = 1
    # MINI_EP_OVERLAP_MIN_TOKENS, mini.parallel.exchange: the fewest rows of the largest rank per micro-batch
    ep_overlap_min_tokens: int = 256
    # MINI_CACHE, mini.model.load: where preset checkpoints are written
    cache_dir: Path = DEFAULT_CACHE
    # MINI_API_KEY, mini.args: the default of `mini serve --api-key` (None: no key)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # MINI_WARMUP_TRACE, mini.engine.warmup_trace: the file the warm-up trace is written to (None: no trace)
    warmup_trace: str | None = None

    def as_dict(self) -> dict:
        """JSON-ready (a benchmark's record): the API key is never written out, only whether one is set."""
        d = dataclasses.asdict(self)
        d["cache_dir"] = str(self.cache_dir)
        d["api_key"] = "set" if self.api_key else None
        return d

    def __str__(self) -> str:
        """The switches that differ from their defaults, as VARIABLE=value (the key hidden), or "defaults"."""
        default = Switches()
        changed = [f"{VARIABLES[f.name]}={'***' if f.name == 'api_key' else getattr(self, f.name)}"
                   for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)]
        return " ".join(changed) or "defaults"


# field -> its variable: every MINI_* name mini reads (docs/design.md's table lists the same ones)
VARIABLES = {
    "backend": "MINI_BACKEND",
    "moe_gemm": "MINI_MOE_GEMM",
    "sparse_attn": "MINI_SPARSE_ATTN",
    "det_sparse_attn": "MINI_DET_SPARSE_ATTN",
    "gemv_weights": "MINI_GEMV_WEIGHTS",
    "ep_glue": "MINI_EP_GLUE",
    "ep_overlap": "MINI_EP_OVERLAP",
    "ep_overlap_min_tokens": "MINI_EP_OVERLAP_MIN_TOKENS",
    "cache_dir": "MINI_CACHE",
    "api_key": "MINI_API_KEY",
    "warmup_trace": "MINI_WARMUP_TRACE",
}


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    """A name among `choices` (spaces and case ignored); unset or empty: `default`."""
    value = env.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={env.get(name)!r}: choose {', '.join(choices[:-1])} or {choices[-1]}")
    return value


def _overlap(env: Mapping[str, str]) -> int:
    text = env.get("MINI_EP_OVERLAP", "").strip().lower() or "1"
    micro_batches = {"off": 1, "on": 2}.get(text)
    if micro_batches is None:
        try:
            micro_batches = int(text)
        except ValueError:
            micro_batches = 0
    if micro_batches < 1:
        raise ValueError(f"MINI_EP_OVERLAP={text!r}: give the micro-batches per MoE layer (1 = off, 2, 4, ...),"
                         " or off / on")
    return micro_batches


def _min_tokens(env: Mapping[str, str]) -> int:
    text = env.get("MINI_EP_OVERLAP_MIN_TOKENS", "256")
    if not text.strip().isdigit():
        raise ValueError(f"MINI_EP_OVERLAP_MIN_TOKENS={text!r}: give a whole number of tokens")
    return int(text)


def read(env: Mapping[str, str] | None = None) -> Switches:
    """Build the record from `env` (default: the process environment), checking every value."""
    env = os.environ if env is None else env
    backend = env.get("MINI_BACKEND") or None
    if backend is not None and backend not in ("reference", "fast"):
        raise ValueError(f"MINI_BACKEND={backend!r}: choose reference or fast")
    return Switches(
        backend=backend,
        moe_gemm=_choice(env, "MINI_MOE_GEMM", ("auto", "humming", "triton"), "auto"),
        sparse_attn=_choice(env, "MINI_SPARSE_ATTN", ("auto", "flashmla", "triton"), "auto"),
        det_sparse_attn=_choice(env, "MINI_DET_SPARSE_ATTN", ("flashmla", "triton"), "flashmla"),
        gemv_weights=_choice(env, "MINI_GEMV_WEIGHTS", ("fp8", "fp8_triton", "fp8_row", "bf16"), "fp8"),
        ep_glue=_choice(env, "MINI_EP_GLUE", ("fused", "eager"), "fused"),
        ep_overlap=_overlap(env),
        ep_overlap_min_tokens=_min_tokens(env),
        cache_dir=Path(env["MINI_CACHE"]) if env.get("MINI_CACHE") else DEFAULT_CACHE,
        api_key=env.get("MINI_API_KEY") or None,
        warmup_trace=env.get("MINI_WARMUP_TRACE") or None,
    )


_current: Switches | None = None


def current() -> Switches:
    """The process's switches: read from the environment on first use, then kept."""
    global _current
    if _current is None:
        _current = read()
    return _current


def refresh() -> None:
    """Drop the record: the next `current()` reads the environment again (tests that change a variable; a
    process's own code never needs it)."""
    global _current
    _current = None
