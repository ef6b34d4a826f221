"""The apps the server tests serve: a fake model (the engine tests' fake_model) and tiny-v4.1 on CPU.

A module of its own, not conftest.py: several test folders have a conftest.py, and `from conftest import ...`
takes whichever of them pytest imported last (it failed when tests/server and tests/tools ran in one session)."""
import sys
from pathlib import Path

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
