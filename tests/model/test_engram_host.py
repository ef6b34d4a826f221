"""Engram rows looked up ahead in host tables (mini.model.engram_host) == the in-place lookup, bit for bit, and each
step gets its own rows while several are in flight."""
import dataclasses

import pytest
import torch

from mini.testing.rank_model import prefill_batch
from mini.checkpoint import random_state
from mini.config import TINY_V41
from mini.model import EngramInput, Model
from mini.model.engram_host import EngramPrefetcher, PendingEngramRows
from mini.ops.engram import EngramWeights


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _tables(rows: int, seed: int, n: int = 2, head_dim: int = 64) -> list[EngramWeights]:
    """Tables of random bytes: every fp8 code (NaN included) and every E8M0 byte, so a row taken from the wrong place
    or left unwritten (the staging starts as NaN) shows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        vals = torch.randint(0, 256, (rows, head_dim), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        scales = torch.randint(100, 150, (rows, head_dim // 32), generator=g, dtype=torch.uint8)
        out.append(EngramWeights(vals, scales.view(torch.float8_e8m0fnu), None, None))
    return out


@pytest.mark.parametrize("chunk_rows", [1, 7, 1 << 14])
def test_prefetched_rows_equal_the_lookup_bitwise(chunk_rows):
    tables = _tables(1001, seed=1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 1001, (37, 2, 5), generator=g)  # odd sizes: 37 tokens x 5 columns
    pre = EngramPrefetcher(tables, "cpu", threads=3, chunk_rows=chunk_rows)
    try:
        pending = pre.start(ids)
        for i, w in enumerate(tables):
            got = pending.rows(i, torch.bfloat16)
            want = w.lookup(ids[:, i], torch.bfloat16, "cpu")
            assert got.shape == (37, 5, 64) and torch.equal(_bits(got), _bits(want))
        assert pending.gather_ms >= 0 and pending.host_wait_ms >= 0 and pending.gpu_wait_ms() is None
    finally:
        pre.close()


def test_steps_in_flight_each_get_their_own_rows():
    """Three steps started before any is consumed, consumed out of order: each one's rows are its own ids'."""
    tables = _tables(500, seed=3)
    g = torch.Generator().manual_seed(4)
    steps = [torch.randint(0, 500, (n, 2, 3), generator=g) for n in (11, 19, 11)]
    pre = EngramPrefetcher(tables, "cpu", threads=2, chunk_rows=5)
    try:
        pending = [pre.start(ids) for ids in steps]
        for k in (2, 0, 1):
            for i, w in enumerate(tables):
                want = w.lookup(steps[k][:, i], torch.float32, "cpu")
                assert torch.equal(_bits(pending[k].rows(i, torch.float32)), _bits(want))
    finally:
        pre.close()


def test_prefetcher_refuses_what_it_cannot_look_up():
    tables = _tables(50, seed=5)
    pre = EngramPrefetcher(tables, "cpu", threads=1)
    try:
        with pytest.raises(ValueError, match=r"want int64 \[tokens, 2 tables"):
            pre.start(torch.zeros(4, 3, 2, dtype=torch.int64))
        with pytest.raises(ValueError, match="want int64"):
            pre.start(torch.zeros(4, 2, 2, dtype=torch.int32))
    finally:
        pre.close()
    with pytest.raises(ValueError, match="no Engram tables"):
        EngramPrefetcher([], "cpu")
    with pytest.raises(ValueError, match="threads 0"):
        EngramPrefetcher(tables, "cpu", threads=0)
    with pytest.raises(ValueError, match="the prefetcher reads host tables"):
        EngramPrefetcher([dataclasses.replace(tables[0], embed=tables[0].embed.to("meta"))], "cpu")
    with pytest.raises(ValueError, match="ids, rows, prefix or pending"):
        EngramInput("later", torch.zeros(1))


def _tiny(device, dtype):
    cfg = TINY_V41
    model = Model(cfg, random_state(cfg, seed=8), device, dtype, engram_device_bytes=0)  # tables on the host
    g = torch.Generator().manual_seed(9)
    prompts = [[torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lens] for lens in ((13, 8),
                                                                                                         (21,))]
    return cfg, model, prompts


def _forward(model, cfg, tokens, device, dtype, engram=None):
    batch, cache = prefill_batch(cfg, tokens, device, dtype, 16, None)
    if engram is not None:
        batch.engram = engram
    return model.forward(batch, cache)


def _host_ids(cfg, tokens):
    return prefill_batch(cfg, tokens, "cpu", torch.float32, 16, None)[0].engram.data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_with_prefetched_rows_equals_the_in_place_lookup(dtype):
    """Two steps' lookups in flight, run in the other order: each step's logits are bitwise those of the model
    looking up the same host tables in place (EngramInput "ids")."""
    cfg, model, prompts = _tiny("cpu", dtype)
    pre = EngramPrefetcher([b.engram for b in model.blocks if b.engram is not None], "cpu", threads=2, chunk_rows=9)
    try:
        pending = [EngramInput("pending", pre.start(_host_ids(cfg, p))) for p in prompts]
        for k in (1, 0):
            want = _forward(model, cfg, prompts[k], "cpu", dtype)
            got = _forward(model, cfg, prompts[k], "cpu", dtype, pending[k])
            assert torch.equal(_bits(got), _bits(want))
            assert pending[k].data.gather_ms is not None  # the forward took the prefetched rows
        assert isinstance(pending[0].data, PendingEngramRows)
    finally:
        pre.close()


@pytest.fixture
def reference_backend():
    """The plain-PyTorch ops on the GPU (run-to-run deterministic: cuBLAS on one stream, no atomics), so that two
    forwards can be compared bit for bit whatever the fast kernels' run-to-run behaviour."""
    import mini.ops
    before = mini.ops.backend()
    mini.ops.set_backend("reference")
    yield
    mini.ops.set_backend(before)


@pytest.mark.gpu
def test_model_with_prefetched_rows_on_the_gpu_equals_the_in_place_lookup(reference_backend):
    """On CUDA: pinned staging, the side-stream copy and the event wait; three steps in flight over two staging
    slots, each step's rows and logits bitwise those of the in-place lookup; the stall is measured."""
    cfg, model, prompts = _tiny("cuda", torch.bfloat16)
    prompts = prompts + [prompts[0][::-1]]
    tables = [b.engram for b in model.blocks if b.engram is not None]
    pre = EngramPrefetcher(tables, "cuda", threads=4, chunk_rows=9, slots=2)
    try:
        ids = [_host_ids(cfg, p) for p in prompts]
        pending = [pre.start(i) for i in ids]
        for k in (2, 0, 1):
            for i, w in enumerate(tables):
                want = w.lookup(ids[k][:, i], torch.bfloat16, "cuda")
                assert torch.equal(_bits(pending[k].rows(i, torch.bfloat16)), _bits(want)), (k, i)
        pending = [pre.start(i) for i in ids]  # again, now through the model
        for k in (1, 2, 0):
            want = _forward(model, cfg, prompts[k], "cuda", torch.bfloat16)
            got = _forward(model, cfg, prompts[k], "cuda", torch.bfloat16, EngramInput("pending", pending[k]))
            torch.cuda.synchronize()
            assert torch.equal(_bits(got), _bits(want)), k
            assert pending[k].gpu_wait_ms() >= 0
    finally:
        pre.close()


def test_pin_registers_the_tensor_in_spans_that_share_no_page(monkeypatch):
    """pin() without a GPU, against a stand-in cudaHostRegister: the spans cover the tensor's bytes exactly once,
    each at most chunk_bytes, cut at page-aligned addresses (a large tensor starts 64-byte aligned; two
    registrations may not share a page); one refusal makes it False."""
    from mini.model import engram_host
    calls = []

    class FakeCudart:
        refuse = None

        def cudaHostRegister(self, ptr, size, flags):
            calls.append((ptr, size, flags))
            return 1 if ptr == self.refuse else 0

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    t = torch.empty(3 * 8192 + 77, dtype=torch.uint8)[5:]  # an odd start and size
    assert engram_host.pin(t, threads=3, chunk_bytes=8192)
    spans = sorted(calls)
    assert spans[0][0] == t.data_ptr() and sum(s for _, s, _ in spans) == t.numel()
    assert all(a + s == b for (a, s, _), (b, _, _) in zip(spans, spans[1:]))
    assert all(s <= 8192 and (a + s) % 4096 == 0 for a, s, _ in spans[:-1]) and all(f == 0 for _, _, f in spans)
    calls.clear()
    fake.refuse = spans[1][0]
    assert not engram_host.pin(t, threads=2, chunk_bytes=8192)
    assert not engram_host.pin(torch.empty(0, dtype=torch.uint8)) and not engram_host.pin(t[::2])
