"""Fuzz tests. Without CUDA the fast path runs on CPU tensors under Triton's interpreter (mini.ops.set_backend(...,
interpret_on_cpu=True)); TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test
imports mini.kernels."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def fast_on_cpu():
    """The fast backend on CPU tensors (interpreter) for the test, the previous backend after it."""
    import mini.ops
    prev = mini.ops.backend()
    mini.ops.set_backend("reference", interpret_on_cpu=True)
    yield
    mini.ops.set_backend(prev, interpret_on_cpu=False)
