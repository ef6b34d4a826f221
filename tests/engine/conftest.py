import pytest

import mini.ops


@pytest.fixture(scope="module")
def kernels_deterministic():
    """The kernels' deterministic mode for a whole module: a row's result does not depend on its step's rows, so a
    verify chunk's rows equal the decode steps they replace bit for bit (the speculation tests' premise)."""
    with mini.ops.deterministic_mode():
        yield
