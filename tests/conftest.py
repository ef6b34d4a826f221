import gc
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


@pytest.fixture(autouse=True)
def _switches():
    """Each test starts and ends with mini.switches' record read from the environment as it then is (it is read
    once per process; pytest's monkeypatch gives the environment back only after the test)."""
    from mini import switches
    switches.refresh()
    yield
    switches.refresh()


@pytest.fixture
def monkeypatch(monkeypatch):
    """pytest's monkeypatch, whose setenv / delenv also drop mini.switches' record, so that the next use reads the
    variable as the test set it (the process's code reads the environment once)."""
    from mini import switches
    setenv, delenv = monkeypatch.setenv, monkeypatch.delenv

    def _setenv(*args, **kwargs):
        setenv(*args, **kwargs)
        switches.refresh()

    def _delenv(*args, **kwargs):
        delenv(*args, **kwargs)
        switches.refresh()
    monkeypatch.setenv, monkeypatch.delenv = _setenv, _delenv
    return monkeypatch


@pytest.fixture(autouse=True)
def _ops_state():
    """Each test leaves mini.ops' process-wide switches (backend, interpreted fast path on CPU, deterministic mode)
    as it found them. A test or a bench it runs that switches one would otherwise change the numbers of whatever
    runs next in the same worker (test_serve_dp's greedy tokens changed after an ep-exchange bench test that set
    the interpreted fast backend)."""
    import mini.ops
    saved = mini.ops.backend(), mini.ops.interpreting_on_cpu(), mini.ops.deterministic()
    holds = mini.ops._holds, mini.ops._found
    yield
    if (mini.ops._holds, mini.ops._found) != holds:
        # an engine that held the deterministic mode (LLMEngine enters it while it lives) left unclosed: collect
        # it, so its hold ends now; one still referenced somewhere loses its hold here, so that the mode it kept
        # on does not change the numbers of whatever runs next in this worker (CI at 194b4f2: 7 such failures)
        gc.collect()
        mini.ops._holds, mini.ops._found = holds
    if (mini.ops.backend(), mini.ops.interpreting_on_cpu()) != saved[:2]:
        mini.ops.set_backend(saved[0], interpret_on_cpu=saved[1])
    if mini.ops.deterministic() != saved[2]:
        mini.ops.set_deterministic(saved[2])
