import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # the engine tests' fake model

from fake_model import FakeConfig, FakeModel, FakeTokenizer  # noqa: E402

from mini.server.app import build_app  # noqa: E402
from mini.testing.background_server import BackgroundServer  # noqa: E402

MODEL = "fake"


def fake_app(**opts):
    cfg = FakeConfig()
    opts = {"num_blocks": 256, "block_tokens": 4, "device": "cpu", "dtype": torch.float32, "max_num_seqs": 16,
            "max_num_batched_tokens": 64, "tokenizer": FakeTokenizer(), **opts}
    return build_app(FakeModel(cfg), MODEL, config=cfg, **opts)


def tiny_server(num_blocks: int = 64):
    """tiny-v4.1 on CPU (fp32), served as MODEL; context = num_blocks blocks of 16 tokens. Yields (url, app)."""
    app = build_app("tiny-v4.1", MODEL, device="cpu", dtype=torch.float32, num_blocks=num_blocks, block_tokens=16,
                    max_num_seqs=8)
    with BackgroundServer(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def server():
    """tiny-v4.1 with a 1,024-token context."""
    yield from tiny_server()
