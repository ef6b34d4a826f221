"""MoE combine: per token, the sum of its local experts' rows in slot order (fp32), written once."""
import pytest
import torch

from mini.kernels.moe_combine import combine


def _case(T, k, D, n_experts, experts, device, dtype):
    ids = torch.stack([torch.randperm(n_experts)[:k] for _ in range(T)]).to(device)
    R = T * k + 7
    # each (token, slot) gets its own row, in a shuffled order; rows of remote experts and spare rows are NaN
    slot_row = torch.randperm(R)[: T * k].view(T, k).to(torch.int32).to(device)
    y = torch.full((R, D), float("nan"), dtype=dtype, device=device)
    local = (ids >= experts.start) & (ids < experts.stop)
    rows = slot_row[local].long()
    y[rows] = torch.randn(rows.numel(), D, device=device).to(dtype)
    return ids, slot_row, y, local


def _reference(y, ids, slot_row, local, add, out_dtype):
    out = torch.zeros(ids.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(ids.shape[1]):  # slot order
        rows = y[slot_row[:, j].long()].float()
        out = out + torch.where(local[:, j, None], rows, torch.zeros_like(rows))
    if add is not None:
        out = out + add.float()
    return out.to(out_dtype)


def _check(T, k, D, device, dtype, out_dtype, with_add):
    experts = range(3, 9)
    ids, slot_row, y, local = _case(T, k, D, 12, experts, device, dtype)
    add = torch.randn(T, D, device=device).to(dtype) if with_add else None
    poisoned = torch.full((T, D), float("nan"), dtype=out_dtype, device=device)
    out = combine(y, ids, slot_row, experts, out_dtype, add=add, out=poisoned)
    assert out.data_ptr() == poisoned.data_ptr()
    assert torch.isfinite(out).all(), "a row of a remote expert was read, or an element was left unwritten"
    assert torch.equal(out, _reference(y, ids, slot_row, local, add, out_dtype))


@pytest.mark.parametrize("T,k", [(1, 1), (5, 6), (300, 4)])
def test_combine_reads_only_local_rows_in_slot_order(T, k, interpreter):
    _check(T, k, 1030, "cpu", torch.float32, torch.float32, with_add=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_adds_and_rounds_once(dtype, interpreter):
    _check(7, 4, 96, "cpu", dtype, dtype, with_add=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T,k", [(1, 1), (5, 6), (300, 4)])
@pytest.mark.parametrize("dtype,out_dtype,with_add", [(torch.bfloat16, torch.float32, False),
                                                      (torch.bfloat16, torch.bfloat16, True),
                                                      (torch.float32, torch.float32, True)])
def test_combine_gpu(T, k, dtype, out_dtype, with_add):
    _check(T, k, 1030, "cuda", dtype, out_dtype, with_add)
