"""Ops: each file holds one op's plain-PyTorch reference and its fast backends side by side.

The backend is chosen once at start-up: "reference" (plain PyTorch, any device) or "fast" (Triton kernels and
carried libraries on CUDA, falling back to the reference for an op that has no fast path).
"""
import os

import torch

_BACKENDS = ("reference", "fast")
_backend: str | None = os.environ.get("MINI_BACKEND") or None


def backend() -> str:
    """The active backend; defaults to "fast" when CUDA is available, else "reference"."""
    global _backend
    if _backend is None:
        _backend = "fast" if torch.cuda.is_available() else "reference"
    return _backend


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    _backend = name


def use_fast(*tensors: torch.Tensor) -> bool:
    """True when the fast backend is active and every given tensor lives on a CUDA device."""
    return backend() == "fast" and all(t.is_cuda for t in tensors)


def library_choice(env: str, library: str, available) -> str:
    """An optional library's switch, read from the environment variable `env`: "auto" (the default) picks the
    library where `available()` says it imports on this GPU, else "triton" (our kernels); naming the library forces
    it (an error if it is missing); "triton" keeps our kernels. Returns `library`, "auto-" + `library` (chosen by
    auto, so the caller may still check it on first use) or "triton". Call sites resolve it once per process."""
    want = os.environ.get(env, "auto").strip().lower()
    if want not in ("auto", library, "triton"):
        raise ValueError(f"{env}={want!r}: choose auto, {library} or triton")
    if want == library and not available():
        raise RuntimeError(f"{env}={library}, but {library} does not import on an SM90 GPU here")
    if want == "auto":
        return f"auto-{library}" if available() else "triton"
    return want
