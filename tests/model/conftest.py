import pytest
import torch
import torch.nn.functional as F

from mini.checkpoint.make import random_state
from mini.checkpoint.tiny_tokenizer import build_tiny_tokenizer
from mini.config import preset
from mini.model import Model
from mini.ops.engram import EngramHasher
from mini.tokenizer import compressed_token_map


@pytest.fixture
def batch_invariant_gemms(monkeypatch):
    """fp32 GEMMs (F.linear, einsum, @) accumulate in fp64: a row's result then no longer depends on how many rows
    share the call.

    CPU BLAS picks different kernels (and summation orders) for different row counts, e.g. one decode token vs a
    prefill chunk. In fp32 that moves results by an ulp, which now and then flips an FP8/FP4 fake-quant rounding or
    a routing choice, and the difference then travels down the sequence through the caches. With fp64 accumulation
    the fp32 results are the correctly rounded sums, the same for every batch shape."""
    linear, einsum, matmul = F.linear, torch.einsum, torch.Tensor.__matmul__

    def linear64(x, w, b=None):
        if x.dtype != torch.float32:
            return linear(x, w, b)
        return linear(x.double(), w.double(), None if b is None else b.double()).float()

    def einsum64(eq, *ops):
        if not all(o.dtype == torch.float32 for o in ops):
            return einsum(eq, *ops)
        return einsum(eq, *(o.double() for o in ops)).float()

    def matmul64(a, b):
        if a.dtype != torch.float32 or b.dtype != torch.float32:
            return matmul(a, b)
        return matmul(a.double(), b.double()).float()

    monkeypatch.setattr(F, "linear", linear64)
    monkeypatch.setattr(torch, "einsum", einsum64)
    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul64)


@pytest.fixture(scope="session")
def tiny_model():
    """name -> (a random fp32 model of that tiny preset, its Engram hasher or None), built once per process; its
    Engram tables count as on the device (engram_on_device)."""
    models: dict = {}

    def get(name: str) -> tuple[Model, EngramHasher | None]:
        if name not in models:
            cfg = preset(name)
            hasher = None
            if cfg.engram_layer_ids:
                hasher = EngramHasher(cfg, compressed_token_map(build_tiny_tokenizer(cfg.vocab_size)))
            model = Model(cfg, random_state(cfg, seed=0), "cpu", torch.float32)
            model.hasher = hasher  # tables "on the device" (the CPU): the model can also hash there
            models[name] = model, hasher
        return models[name]

    return get


@pytest.fixture
def layout_invariant_rounding(monkeypatch):
    """Two official roundings that depend on a step's layout, replaced by layout-invariant ones, for tests that
    compare one prefill, chunked prefill, decode and batching with each other (the official code's own results
    move between those layouts: its prefix vs single prefill noise, tests/fixtures/v41_reference/README.md):
    * the indexer breaks exact score ties toward the newer group instead of torch.topk's order at the row's width
      (ties are common: relu zeroes whole groups' scores);
    * sparse attention lists every query's window as W keys p-W+1..p and runs its softmax over one block of all
      keys, instead of the reference's list (as long as the chunk for a chunk that starts its sequence, W
      otherwise) in the kernel's blocks of 64: both move the fp32 sums' rounding with the layout."""
    from mini.ops import attention, indexer
    monkeypatch.setattr(indexer, "RANK_AS_OFFICIAL", False)
    monkeypatch.setattr(attention, "reference_window_rows", attention.layout_invariant_window_rows)
    monkeypatch.setattr(attention, "SOFTMAX_BLOCK", 1 << 30)
