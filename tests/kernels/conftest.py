"""Kernel tests. Without CUDA, the Triton kernels run under Triton's interpreter: TRITON_INTERPRET is read when a
kernel is decorated, so it is set here, before any test imports mini.kernels (mini.ops imports kernels lazily),
with mini/kernels/interpreter.py's bf16 semantics."""
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from mini.kernels.interpreter import patch_bf16
    patch_bf16()  # bf16 tiles computed as on the GPU (the shipped interpreter works on their raw bits)


@pytest.fixture
def interpreter():
    """For the small CPU tests: they pass CPU tensors, which only the interpreter accepts."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test: runs on CPU machines; the gpu tests cover the compiled kernel here")


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty / empty_like comes back filled with NaN, so that an output element the kernel does not
    write shows up."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan(empty_like(*a, **kw)))


@dataclass
class FlatBatch:
    """The index tensors of design.md's flat batch that the attention-side kernels read."""
    positions: torch.Tensor  # [T]
    seq_of: torch.Tensor  # [T]
    slots: torch.Tensor  # [B]
    start_pos: torch.Tensor  # [B]
    lens: torch.Tensor  # [B]
    block_table: torch.Tensor  # [B, nb] int32
    n_blocks: int

    def to(self, device):
        return FlatBatch(*(getattr(self, f).to(device) for f in ("positions", "seq_of", "slots", "start_pos", "lens",
                                                                 "block_table")), self.n_blocks)


def random_flat_batch(lens, starts, block_tokens, device) -> FlatBatch:
    """Chunks of the given lengths and start positions, random distinct slots and shuffled pool blocks."""
    B = len(lens)
    nb = max((s + n + block_tokens - 1) // block_tokens for s, n in zip(starts, lens))
    n_blocks = B * nb + 3
    block_table = torch.randperm(n_blocks)[: B * nb].view(B, nb).to(torch.int32)
    slots = torch.randperm(B + 3)[:B]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    seq_of = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    b = FlatBatch(positions, seq_of, slots, torch.tensor(starts), torch.tensor(lens), block_table, n_blocks)
    return b.to(device)


@pytest.fixture
def flat_batch():
    return random_flat_batch


@pytest.fixture
def reference_ops():
    """mini.ops dispatches to these very kernels on CUDA; parity tests compare against the plain reference."""
    import mini.ops
    prev = mini.ops.backend()
    mini.ops.set_backend("reference")
    yield
    mini.ops.set_backend(prev)


@pytest.fixture
def fast_interpreted():
    """The fast backend serving CPU tensors through Triton's interpreter (the ops' dispatch, interpreted)."""
    import mini.ops
    prev = mini.ops.backend()
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    yield
    mini.ops.set_backend(prev)


@pytest.fixture(params=[16, 1, 0], ids=lambda n: f"per_sm{n}")
def looped(request, monkeypatch):
    """Passes over rows whose count lives on the device loop over row tiles (device_info.looped_row_programs): at
    the default one wave (a tile a program at the tests' sizes), at 1 program an SM (several tiles each, unevenly)
    and at 0 (a single program along the rows takes every tile)."""
    monkeypatch.setattr("mini.kernels.device_info.LOOPED_PROGRAMS_PER_SM", request.param)
