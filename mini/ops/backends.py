"""Every backend choice of the process in one frozen object (`Backends`), resolved at start-up (`resolve`: the
model runner calls it and logs the result) and recorded in every benchmark's JSON (mini.testing.suites.environment).

* ops: "reference" (plain PyTorch, any device) or "fast" (Triton kernels and carried libraries on CUDA), from
  MINI_BACKEND or `mini.ops.set_backend` (default: fast where CUDA is available). Tests switch it at run time, so
  `current()` reads it each time;
* moe_gemm: the routed experts' grouped GEMMs on the fast path, "humming" or "triton" (MINI_MOE_GEMM,
  mini/ops/moe.py);
* sparse_attn: the sparse attention core's kernel for prefill-sized steps on the fast path, "flashmla", "triton",
  or "auto-flashmla": FlashMLA, kept only if its first output matches ours (MINI_SPARSE_ATTN,
  mini/ops/attention.py; `settle_sparse_attn` records the verdict);
* deterministic: the deterministic mode (mini.ops.set_deterministic), which fixes every choice that depends on
  a step's size (e.g. the sparse attention core follows each chunk, not the step).
The library switches come from mini.switches (the environment, read once per process) and are resolved against
what imports here on first use: a later change of a variable does not apply.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import mini.ops
from mini import switches

log = logging.getLogger("mini.backends")


@dataclass(frozen=True)
class Backends:
    ops: str  # "reference" | "fast"
    moe_gemm: str  # "humming" | "triton"
    sparse_attn: str  # "flashmla" | "auto-flashmla" | "triton"
    deterministic: bool = False

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return (f"ops {self.ops}, MoE GEMMs {self.moe_gemm}, sparse attention {self.sparse_attn}"
                f"{', deterministic' if self.deterministic else ''}")


_libraries: dict[str, str] = {}  # field name -> the library switch as resolved (once per process)
_logged: Backends | None = None


def library_choice(env: str, want: str, library: str, available) -> str:
    """An optional library's switch `want` (the value of the variable `env`, mini.switches): "auto" (the default)
    picks the library where `available()` says it imports on this GPU, else "triton" (our kernels); naming the
    library forces it (an error if it is missing); "triton" keeps our kernels. Returns `library`, "auto-" +
    `library` (chosen by auto, so the caller may still check it on first use) or "triton"."""
    if want == library and not available():
        raise RuntimeError(f"{env}={library}, but {library} does not import on an SM90 GPU here")
    if want == "auto":
        return f"auto-{library}" if available() else "triton"
    return want


def moe_gemm() -> str:
    """The routed experts' grouped GEMM library on CUDA: "humming" (default where it imports on an SM90 GPU) or
    "triton"."""
    if "moe_gemm" not in _libraries:
        from mini.kernels.humming_experts import available
        _libraries["moe_gemm"] = library_choice("MINI_MOE_GEMM", switches.current().moe_gemm, "humming",
                                                 available).removeprefix("auto-")
    return _libraries["moe_gemm"]


def sparse_attn() -> str:
    """The sparse attention core's kernel for the steps FlashMLA serves: "flashmla", "auto-flashmla" (default where
    it imports on an SM90 GPU; checked against ours on its first call) or "triton". FlashMLA serves prefill-sized
    steps over a scratch and decode-shaped steps of more rows than our kernel splits over the cache's KeyStore
    (mini.ops.attention.core_kernel); other steps (a few decode rows, other head counts or widths, a capture
    before auto's check) run the Triton kernel either way."""
    if "sparse_attn" not in _libraries:
        from mini.kernels.flashmla_attention import available
        _libraries["sparse_attn"] = library_choice("MINI_SPARSE_ATTN", switches.current().sparse_attn, "flashmla",
                                                    available)
    return _libraries["sparse_attn"]


def settle_sparse_attn(kernel: str) -> None:
    """Record auto's verdict after FlashMLA's first checked call: "flashmla" (kept) or "triton"."""
    if kernel not in ("flashmla", "triton"):
        raise ValueError(f"sparse attention kernel {kernel!r}")
    _libraries["sparse_attn"] = kernel
    log.info("backends: %s", current())


def current() -> Backends:
    """The process's choices now (the library switches resolved on first use)."""
    return Backends(mini.ops.backend(), moe_gemm(), sparse_attn(), mini.ops.deterministic())


def resolve() -> Backends:
    """Resolve every choice now (start-up) and log it, with the switches asked for, once per distinct result."""
    global _logged
    b = current()
    if b != _logged:
        log.info("backends: %s (switches: %s)", b, switches.current())
        _logged = b
    return b
