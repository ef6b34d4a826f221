"""The top-k keys kernel (mini/kernels/order_keys.py) against the torch form (mini.ops.indexer._order_keys under the
reference backend): equal keys, bit for bit, on fresh random bf16 rows with every special value (±0, ±inf,
subnormals, ties), odd widths and row counts, outputs poisoned; NaNs of both signs become CUDA's one NaN (0x7FFF);
the op's dispatch (the fast backend takes the kernel where `supported` holds, the torch form elsewhere); the same
top-k through `topk_recent`. CPU: Triton's interpreter; gpu: compiled, at decode and prefill shapes."""
import pytest
import torch

import mini.ops
from mini.kernels import order_keys as kernel_module  # after tests/kernels/conftest.py chose the interpreter or not
from mini.ops.indexer import _order_keys, topk_recent

pytestmark = pytest.mark.usefixtures("reference_ops")
POISON = -7  # no key: its order bits 0xFFFF are a negative NaN's, which the kernel writes as 0x7FFF


def rows(shape, device, seed):
    """bf16 scores with ties, ±0, ±inf, NaNs of both signs and subnormals sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 4).bfloat16()
    ties = x[..., 1::7]  # every 7th column copies its right neighbour (a width of 7n + 1 has one column more)
    x[..., ::7][..., :ties.shape[-1]] = ties
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40]).bfloat16()
    pick = torch.randint(0, special.numel(), shape, generator=g)
    where = torch.rand(shape, generator=g) < 0.2
    x = torch.where(where, special[pick], x)
    bits = x.view(torch.int16)
    bits[..., -1:][torch.rand(bits[..., -1:].shape, generator=g) < 0.5] = -1  # 0xFFFF: a negative NaN
    return x.to(device)


def check(got, x, want):
    """Keys equal where the value is a number; a NaN's key is 0x7FFF above its column."""
    number = ~x.isnan()
    assert torch.equal(got[number], want[number])
    cols = torch.arange(x.shape[-1], dtype=torch.int32).expand(x.shape).to(x.device)
    assert torch.equal(got[~number], (0x7FFF << 16) | cols[~number])


def poisoned_keys(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(POISON)
                        if kw.get("dtype") == torch.int32 else empty(*a, **kw))


@pytest.mark.parametrize("shape", [(1, 1), (1, 37), (3, 1000), (5, 2049), (2, 3, 130), (2, 4096)])
def test_keys_equal_the_torch_form_interpreter(interpreter, monkeypatch, shape):
    x = rows(shape, "cpu", seed=shape[-1])
    want = _order_keys(x)  # the reference backend: torch
    poisoned_keys(monkeypatch)
    got = kernel_module.order_keys(x)
    assert got.dtype == torch.int32 and got.shape == x.shape
    check(got, x, want)


def test_strided_rows_and_the_limits_interpreter(interpreter):
    x = rows((4, 300), "cpu", seed=1)
    check(kernel_module.order_keys(x[:, ::2]), x[:, ::2], _order_keys(x[:, ::2]))  # a strided view
    assert kernel_module.order_keys(x[:0]).shape == (0, 300)
    assert kernel_module.supported(torch.zeros(1, 1 << 16, dtype=torch.bfloat16))
    assert not kernel_module.supported(torch.zeros(1, (1 << 16) + 1, dtype=torch.bfloat16))
    assert not kernel_module.supported(x.float())
    with pytest.raises(ValueError, match="bf16 rows"):
        kernel_module.order_keys(x.float())


def test_the_fast_backend_takes_the_kernel_where_supported_interpreter(interpreter, monkeypatch):
    calls, real = [], kernel_module.order_keys
    monkeypatch.setattr(kernel_module, "order_keys", lambda x: calls.append(x.shape) or real(x))
    x = rows((3, 500), "cpu", seed=2)
    x = torch.where(x.isnan(), torch.zeros_like(x), x)  # numbers only: the same top-k as the torch form
    want_keys, want_topk = _order_keys(x), topk_recent(x, 40)
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    assert torch.equal(_order_keys(x), want_keys)
    values, indices = topk_recent(x, 40)
    assert torch.equal(indices, want_topk[1]) and torch.equal(values.view(torch.int16), want_topk[0].view(torch.int16))
    assert calls == [(3, 500), (3, 500)]
    _order_keys(x.float())  # fp32 rows: the torch form's int64 keys
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1024), (64, 8192), (4096, 4096), (7, 65536), (3, 1001)])
def test_keys_equal_the_torch_form_gpu(shape):
    """Compiled: keys equal the torch form's (a NaN's: 0x7FFF, as torch's CUDA add makes it), and the top-k of
    number rows picks the same columns."""
    x = rows(shape, "cuda", seed=shape[-1])
    check(kernel_module.order_keys(x), x, _order_keys(x))
    x = torch.where(x.isnan(), torch.zeros_like(x), x)
    k = min(64, shape[-1])
    assert torch.equal(kernel_module.order_keys(x).topk(k, dim=-1).indices, _order_keys(x).topk(k, dim=-1).indices)
