"""The biased greedy pick (mini/ops/greedy.py, mini/kernels/add_argmax.py): out = a + b and argmax(out) per row,
against torch's add and argmax on the same device: the sums bit for bit, the ids equal, on rows with ties, NaN,
±0 and ±inf, strided rows (a draft's position i of [B, k, V] logits), outputs poisoned with NaN before the run."""
import pytest
import torch

from mini.kernels.add_argmax import BLOCK, add_argmax, supported


def rows(R, N, device, seed):
    """[R, k=3, N] base logits and [R, N] biases with the pick's edge cases planted in some rows."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(R, 3, N, generator=g)
    b = torch.randn(R, N, generator=g)
    if R > 1:  # a tie across chunks: the first column wins
        a[1, :, :] = -5.0
        b[1] = 0.0
        a[1, :, [N - 1, 7, N // 2]] = 3.0
    if R > 2:  # NaN is the largest (the first NaN), above +inf
        a[2, :, N - 2] = float("nan")
        a[2, :, 3] = float("inf")
    if R > 3:  # -0.0 equals +0.0: the first of them, in a row of negatives
        a[3] = -1.0
        b[3] = 0.0
        a[3, :, N - 3] = 0.0
        a[3, :, 5] = -0.0
    if R > 4:  # only -inf
        a[4], b[4] = float("-inf"), 0.0
    return a.to(device), b.to(device)


def check(a, b):
    """Position 1 of every row, as the Markov chain reads it (a strided view), against torch."""
    want = torch.empty_like(a)
    ref_ids = torch.add(a[:, 1], b, out=want[:, 1]).argmax(-1)
    out = torch.full_like(a, float("nan"))
    ids = add_argmax(a[:, 1], b, out[:, 1])
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids), (ids, ref_ids)
    assert torch.equal(out[:, 1].view(torch.int32), want[:, 1].view(torch.int32))  # the sums, bit for bit
    assert out[:, 0].isnan().all() and out[:, 2].isnan().all()  # nothing else written


def test_add_argmax_interpreter(interpreter):
    for R, N in ((5, 3 * BLOCK + 17), (1, 33)):
        check(*rows(R, N, "cpu", seed=R))


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 5, 64, 3])
def test_add_argmax_gpu(R):
    check(*rows(R, 129280, "cuda", seed=R))  # V4.1's vocabulary
    check(*rows(R, 1000, "cuda", seed=R + 1))  # one partial chunk


def test_add_argmax_refuses_what_it_cannot_take():
    a = torch.zeros(2, 8)
    assert not supported(a.double(), a.double(), a.double()) and not supported(a.t(), a.t(), a.t())
    with pytest.raises(ValueError, match="add_argmax"):
        add_argmax(a[:, ::2], a[:, ::2], a[:, ::2])
