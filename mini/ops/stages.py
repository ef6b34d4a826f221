"""Named stages of the forward step: the rows of `mini profile` (timed by mini/testing/stage_times.py) and named
ranges in its torch.profiler trace. Model and op code marks a stage with `@staged("name")` on a function or
`with stage("name"):` around a call; names nest with dots ("moe.routed.combine" is a part of "moe.routed").

Nothing is recorded unless a profiler installs a recorder (`recording`): then every marked call runs inside
`recorder(name)`, a context manager. Without one a marked call costs one check of a module global.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager

_recorder: Callable[[str], ContextManager] | None = None
_NULL = nullcontext()


def stage(name: str) -> ContextManager:
    """A context manager marking the code it runs as the stage `name`."""
    return _NULL if _recorder is None else _recorder(name)


def staged(name: str):
    """Decorator: every call of the function is the stage `name`."""
    def mark(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if _recorder is None:
                return fn(*args, **kwargs)
            with _recorder(name):
                return fn(*args, **kwargs)
        return run
    return mark


@contextmanager
def recording(recorder: Callable[[str], ContextManager]):
    """Run the marked stages inside `recorder(name)` while this context is open (one recorder at a time)."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("a stage recorder is already installed")
    _recorder = recorder
    try:
        yield
    finally:
        _recorder = None
