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


def _check_add_at(T, k, D, A, add_at, device):
    """The EP exchange's use: the shared expert of this rank's A tokens added to the gathered rows add_at.., ids
    a strided view (the rows of the received byte buffer) whose padding rows hold -1 (no expert)."""
    experts = range(3, 9)
    ids, slot_row, y, local = _case(T, k, D, 12, experts, device, torch.bfloat16)
    ids[-1] = -1
    local[-1] = False
    wide = torch.full((T, 3 * k), 7, dtype=ids.dtype, device=device)
    wide[:, k: 2 * k] = ids
    ids = wide[:, k: 2 * k]  # stride 3k, unit column stride
    add = torch.randn(A, D, device=device).bfloat16()
    out = combine(y, ids, slot_row, experts, torch.float32, add=add, add_at=add_at,
                  out=torch.full((T, D), float("nan"), device=device))
    full_add = torch.zeros(T, D, device=device)
    full_add[add_at: add_at + A] = add.float()
    assert torch.equal(out, _reference(y, ids, slot_row, local, full_add, torch.float32))
    # the unfused order (combine, then the add in its own pass) gives the same bits
    apart = combine(y, ids, slot_row, experts, torch.float32)
    apart[add_at: add_at + A] += add.float()
    assert torch.equal(out, apart)


@pytest.mark.parametrize("T,A,add_at", [(9, 4, 4), (9, 0, 9), (5, 5, 0)])
def test_combine_adds_a_row_range_interpreter(T, A, add_at, interpreter):
    _check_add_at(T, 3, 96, A, add_at, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("T,A,add_at", [(8192, 4096, 4096), (16384, 4093, 4096)])
def test_combine_adds_a_row_range_gpu(T, A, add_at):
    _check_add_at(T, 6, 5120, A, add_at, "cuda")


def test_combine_refuses_an_add_past_the_rows():
    ids = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="add_at"):
        combine(torch.zeros(8, 32), ids, ids.int(), range(0, 1), torch.float32, add=torch.zeros(3, 32), add_at=2)
