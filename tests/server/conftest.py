import pytest

from server_apps import tiny_server


@pytest.fixture(scope="module")
def server():
    """tiny-v4.1 with a 1,024-token context."""
    yield from tiny_server()
