"""Ops: each file holds one op's plain-PyTorch reference and its fast backends side by side.

The backend is chosen once at start-up: "reference" (plain PyTorch, any device) or "fast" (Triton kernels and
carried libraries on CUDA, falling back to the reference for an op that has no fast path).
"""
import contextlib

import torch

from mini import switches

_BACKENDS = ("reference", "fast")
_backend: str | None = None  # None until first asked: MINI_BACKEND (mini.switches), else by device
# Tests only: the fast backend also takes CPU tensors, running the Triton kernels under Triton's interpreter
# (TRITON_INTERPRET=1), so that the fast path's dispatch and kernels can be checked on a CPU machine.
_interpret_on_cpu = False


def backend() -> str:
    """The active backend: `set_backend`'s, else MINI_BACKEND's, else "fast" when CUDA is available, else
    "reference"."""
    global _backend
    if _backend is None:
        _backend = switches.current().backend or ("fast" if torch.cuda.is_available() else "reference")
    return _backend


def set_backend(name: str, interpret_on_cpu: bool | None = None) -> None:
    """Choose the backend. `interpret_on_cpu` (tests): True lets CPU tensors take the fast path too, its Triton
    kernels running under the interpreter, which must then be on (TRITON_INTERPRET=1 before triton is imported);
    False: the fast backend serves CUDA tensors only and CPU tensors run the reference; None keeps the setting
    (so that code switching backends back and forth leaves a test's choice alone)."""
    global _backend, _interpret_on_cpu
    if name not in _BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    if interpret_on_cpu:
        import triton
        if not triton.knobs.runtime.interpret:
            raise ValueError("interpret_on_cpu needs TRITON_INTERPRET=1, set before triton is imported")
        from mini.kernels.interpreter import patch_bf16
        patch_bf16()  # the interpreter as shipped computes bf16 tiles on their raw bits
    _backend = name
    if interpret_on_cpu is not None:
        _interpret_on_cpu = interpret_on_cpu


@contextlib.contextmanager
def using_backend(name: str):
    """Run the block under backend `name`, then restore the previous one (checks and tests that compare them)."""
    before = backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(before)


def interpreting_on_cpu() -> bool:
    """Whether the fast backend runs CPU tensors through the Triton interpreter (set_backend(interpret_on_cpu))."""
    return _interpret_on_cpu


def use_fast(*tensors: torch.Tensor) -> bool:
    """True when the fast backend is active and every given tensor lives on a CUDA device (or, with
    set_backend("fast", interpret_on_cpu=True), every one on the CPU)."""
    if backend() != "fast":
        return False
    return all(t.is_cuda for t in tensors) or (_interpret_on_cpu and not any(t.is_cuda for t in tensors))


def fast_on(device: torch.device) -> bool:
    """`use_fast` for tensors on `device` (a step's plan asks it once, mini.ops.step_plan)."""
    return backend() == "fast" and (device.type == "cuda" or (_interpret_on_cpu and device.type != "cuda"))


_deterministic = False


def deterministic() -> bool:
    """Whether the deterministic mode is on (`set_deterministic`)."""
    return _deterministic


_holds = 0  # contexts holding the mode on now
_found = False  # the mode the first of them found


@contextlib.contextmanager
def deterministic_mode(on: bool = True):
    """Run the block in the deterministic mode (`on`) or out of it, then restore the mode found: the mode as a
    context, entered and left by whoever owns the work (an engine while it lives, a test, a check, a benchmark's
    A/B), instead of a process flag flipped and left behind. Holds of the mode are counted: engines end in any
    order (one garbage-collected while the next runs), and the mode stays on until the last hold is left."""
    global _holds, _found
    if not on:
        before = _deterministic
        set_deterministic(False)
        try:
            yield
        finally:
            set_deterministic(before)
        return
    if _holds == 0:
        _found = _deterministic
    _holds += 1
    set_deterministic(True)
    try:
        yield
    finally:
        _holds -= 1
        if _holds == 0:
            set_deterministic(_found)


def set_deterministic(on: bool) -> None:
    """The deterministic mode, process-wide (`--deterministic`, EngineOptions.deterministic): every fast-path
    choice that would depend on how many rows a step has is fixed, so a request's result does not depend on what
    else is batched with it (docs/design.md, Determinism). On CUDA it also routes aten's GEMMs through the
    fixed-tile kernel of mini/kernels/batch_invariant.py instead of cuBLAS; on the CPU through the row-by-row
    products of mini/ops/cpu_batch_invariant.py instead of MKL's M-dependent kernels."""
    global _deterministic
    _deterministic = bool(on)
    from mini.ops import cpu_batch_invariant
    (cpu_batch_invariant.enable if on else cpu_batch_invariant.disable)()
    if torch.cuda.is_available():
        from mini.kernels import batch_invariant
        (batch_invariant.enable if on else batch_invariant.disable)()
