import os

import pytest
import torch

# Without CUDA every Triton kernel runs under the interpreter. Triton 3.6 reads TRITON_INTERPRET once, when it is
# first imported: set it here, before any test module imports triton (a module-level `import triton` collected
# before tests/kernels/conftest.py made every nested @triton.jit call fail under the interpreter in full runs).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device on this machine (run it on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
