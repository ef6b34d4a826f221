import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Spawned ranks already share the cores; the references computed in the test process take one thread too
    (oversubscribed BLAS threads on a busy 2-core machine make tiny ops 100x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
