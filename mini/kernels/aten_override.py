"""Replacing aten's implementation of a few ops for one device type, process-wide, and restoring it.

The deterministic mode (`mini.ops.set_deterministic`) swaps aten's GEMMs (and on CPU a few elementwise ops) for
batch-invariant versions, so every call site (F.linear, @, einsum, torch.mm(..., out_dtype=)) takes them without
being touched. `mini/kernels/batch_invariant.py` (CUDA) and `mini/ops/cpu_batch_invariant.py` (CPU) each hold one
`AtenOverride`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


class AtenOverride:
    """`impls` (aten op name, e.g. "mm.out" -> function) registered for `device` ("CUDA", "CPU") on `enable()`,
    dropped on `disable()`. An op the running torch does not have (e.g. "mm.dtype" before it existed) is skipped."""

    def __init__(self, device: str, impls: dict[str, Callable]):
        self.device, self.impls = device, impls
        self._lib: torch.library.Library | None = None

    def enable(self) -> None:  # idempotent
        if self._lib is not None:
            return
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            for name, fn in self.impls.items():
                op, _, overload = name.partition(".")
                if overload and not hasattr(getattr(torch.ops.aten, op), overload):
                    continue
                lib.impl(name, fn, self.device)
        self._lib = lib

    def disable(self) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None

    def enabled(self) -> bool:
        return self._lib is not None


def check_out(out: torch.Tensor, shape: tuple) -> None:
    """aten resizes an out= tensor; the overrides' callers pass it sized, which is checked, not resized."""
    if tuple(out.shape) != tuple(shape):
        raise RuntimeError(f"deterministic mode: out= of shape {tuple(out.shape)}, expected {tuple(shape)}")
