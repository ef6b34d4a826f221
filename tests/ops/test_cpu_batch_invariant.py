"""mini/ops/cpu_batch_invariant.py: with the deterministic mode's CPU kernels on, a row's result does not depend on
how many rows share the call (GEMMs through F.linear, @, einsum / bmm, addmm; sigmoid, silu, softplus), and the
results stay torch's to rounding. Without them, the same checks find differing rows (what the module is for)."""
import pytest
import torch
import torch.nn.functional as F

import mini.ops
from mini.ops import cpu_batch_invariant


@pytest.fixture
def invariant():
    cpu_batch_invariant.enable()
    yield
    cpu_batch_invariant.disable()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _gemm_cases(g: torch.Generator, K: int, N: int) -> list:
    """(name, fn of X [M, K]) for each way the model multiplies."""
    W, b, wo_a = torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.randn(2, 4, K // 2, generator=g)
    return [("linear", lambda x: F.linear(x, W)),
            ("linear+bias", lambda x: F.linear(x, W, b)),
            ("matmul", lambda x: x @ W.T),
            ("addmm beta/alpha", lambda x: torch.addmm(b, x, W.T, beta=0.5, alpha=2.0)),
            ("einsum tgd,grd (the grouped out projection)",
             lambda x: torch.einsum("tgd,grd->tgr", x.view(x.shape[0], 2, -1), wo_a)),
            ("3-d linear", lambda x: F.linear(x.view(x.shape[0], 1, K), W))]


def _rows_differ(fn, X) -> bool:
    full = fn(X)
    return any(not torch.equal(_bits(fn(X[:m])), _bits(full[:m])) for m in (1, 2, 3, 5, 17))


@pytest.mark.parametrize("K,N", [(256, 24), (64, 512), (1024, 64), (96, 7)])
def test_gemm_rows_do_not_depend_on_the_row_count(K, N, invariant):
    g = torch.Generator().manual_seed(K + N)
    X = torch.randn(40, K, generator=g)
    for name, fn in _gemm_cases(g, K, N):
        assert not _rows_differ(fn, X), name
        cpu_batch_invariant.disable()
        want = fn(X)
        cpu_batch_invariant.enable()
        torch.testing.assert_close(fn(X), want, rtol=1e-5, atol=1e-4)


def test_without_it_cpu_gemm_rows_depend_on_the_row_count():
    """The defect the module removes, on this machine's BLAS (if a later torch made its GEMMs row-invariant, this
    test would say so, and the mode's slow path could go)."""
    g = torch.Generator().manual_seed(0)
    X, W = torch.randn(40, 256, generator=g), torch.randn(24, 256, generator=g)
    assert _rows_differ(lambda x: x @ W.T, X)


@pytest.mark.parametrize("op", ["sigmoid", "silu", "softplus", "softplus(beta=2, threshold=1)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_rows_do_not_depend_on_the_row_count(op, dtype, invariant):
    fn = {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus,
          "softplus(beta=2, threshold=1)": lambda x: F.softplus(x, beta=2, threshold=1)}[op]
    g = torch.Generator().manual_seed(1)
    for width in (4, 16, 24, 100):
        x = (3 * torch.randn(1, width, generator=g)).to(dtype)
        alone = fn(x)
        for m in (2, 3, 5, 33, 3000):  # 3000 x 100: several pieces
            assert torch.equal(_bits(fn(x.expand(m, width).contiguous())[:1]), _bits(alone)), (width, m)
        assert torch.equal(_bits(fn(x.expand(7, width)[:, 1:3])[:1]), _bits(fn(x[:, 1:3])))  # non-contiguous
        cpu_batch_invariant.disable()
        want = fn(x)
        cpu_batch_invariant.enable()
        torch.testing.assert_close(alone, want, rtol=2e-6 if dtype == torch.float32 else 1e-2, atol=1e-7)


def test_deterministic_mode_switches_it(invariant):
    cpu_batch_invariant.disable()
    with mini.ops.deterministic_mode():
        assert cpu_batch_invariant.enabled() and mini.ops.deterministic()
        with mini.ops.deterministic_mode(False):  # nested: the outer mode comes back
            assert not cpu_batch_invariant.enabled() and not mini.ops.deterministic()
        assert cpu_batch_invariant.enabled() and mini.ops.deterministic()
    assert not cpu_batch_invariant.enabled() and not mini.ops.deterministic()


def test_out_of_the_wrong_shape_is_refused(invariant):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with pytest.raises(RuntimeError, match="out= of shape"):
        torch.mm(a, b, out=torch.empty(2, 5))
    out = torch.full((3, 5), float("nan"))
    torch.mm(a, b, out=out)
    torch.testing.assert_close(out, a.double().mm(b.double()).float())
