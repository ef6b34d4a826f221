"""Issue 28: fewer small kernels per layer in a decode step, with the same bits. The rewritten ops equal the forms
they replace bit for bit (on the CPU here, on the GPU under the gpu mark), and what a step's layers share is built
once per step, not per layer."""
import pytest
import torch

import mini.ops
from mini.ops.norm import rms_norm

def _three_op_rms_norm(x, weight, eps):
    """RMSNorm as it was written before (the reference's form): fp32 weight, fp32 product, then the cast."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * (xf * inv_rms)).to(x.dtype)


def _rms_norm_cases(device):
    g = torch.Generator().manual_seed(0)
    for x_dtype in (torch.bfloat16, torch.float32):
        for w_dtype in (torch.bfloat16, torch.float32):
            for shape in ((1, 64), (5, 512), (3, 4, 128), (2, 7168)):
                x = (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 4, shape[:-1] + (1,), generator=g))
                w = torch.randn(shape[-1], generator=g) + 1
                yield x.to(device, x_dtype), w.to(device, w_dtype)


def _check_rms_norm(device):
    for x, w in _rms_norm_cases(device):
        for eps in (1e-20, 1e-6):
            with mini.ops.using_backend("reference"):  # the torch ops (the fast backend's kernel: test_rms_norm.py)
                got = rms_norm(x, w, eps)
            want = _three_op_rms_norm(x, w, eps)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32))


def test_rms_norm_one_mul_equals_three_op_form_cpu():
    _check_rms_norm(torch.device("cpu"))


@pytest.mark.gpu
def test_rms_norm_one_mul_equals_three_op_form_gpu():
    _check_rms_norm(torch.device("cuda"))


def _check_swiglu_rows_constants(device):
    """The shared expert's SwiGLU pass without weight and count tensors equals it with ones and the row count."""
    from mini.kernels.mxfp4_grouped_gemm import swiglu_rows
    g = torch.Generator().manual_seed(1)
    for R, quant_block in ((1, 128), (5, 0), (37, 128)):
        gu = (torch.randn(R, 512, generator=g) * 4).to(device, torch.bfloat16)
        gu[0, :3] = torch.tensor([float("inf"), -float("inf"), -0.0])
        ones = torch.ones(R, dtype=torch.float32, device=device)
        n = torch.full((1,), R, dtype=torch.int32, device=device)
        want = swiglu_rows(gu[:, :256], gu[:, 256:], ones, n, 7.0, quant_block)
        got = swiglu_rows(gu[:, :256], gu[:, 256:], None, None, 7.0, quant_block)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_swiglu_rows_without_constant_tensors_cpu():
    _check_swiglu_rows_constants(torch.device("cpu"))


@pytest.mark.gpu
def test_swiglu_rows_without_constant_tensors_gpu():
    _check_swiglu_rows_constants(torch.device("cuda"))


def test_top_groups_ordered_from_the_topks_own_sort():
    """The index sources' top-k in attention's order from the top-k's own sort: ordered_ids(top_groups(...))."""
    from mini.ops.indexer import ordered_ids, top_groups, top_groups_ordered
    g = torch.Generator().manual_seed(2)
    for T, N, k in ((1, 24, 24), (5, 40, 24), (6, 7, 24), (3, 300, 64)):
        scores = torch.randint(-3, 4, (T, N), generator=g).to(torch.bfloat16)  # many ties
        scores[torch.rand(T, N, generator=g) < 0.4] = float("-inf")
        scores[0] = float("-inf")  # a query that sees nothing
        want_ids, want_n = ordered_ids(top_groups(scores, k))
        got_ids, got_n = top_groups_ordered(scores, k)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_n, want_n)


def test_decode_step_builds_shared_index_tensors_once(monkeypatch):
    """One static decode step of tiny-v4.1 (one emulated EP4 rank) on the fast path: the window widths of the
    sparse attention kernel and the index scores kernel's grid plan are built once for the step, not once per layer;
    each index source's top-k reaches the kernel ordered, with its count; the ring write takes kv whole."""
    from mini.bench import rank4_decode as rd
    from mini.checkpoint import expert_range
    from mini.config import preset
    from mini.kernels import indexer_scores as isk
    from mini.kernels import sparse_attention as sa
    from mini.testing.emulated_ep import EmulatedEP
    from mini.testing.rank_model import rank_model
    cfg, cpu = preset("tiny-v4.1"), torch.device("cpu")
    mini.ops.set_backend("fast", interpret_on_cpu=True)  # the conftest gives the backend back
    ex = EmulatedEP(4, 0, "uniform", expert_range(cfg, 0, 4))
    model = rank_model(cfg, cpu, torch.bfloat16, 0, expert_range(cfg, 0, 4), None, ex)
    run = rd.DecodeRun(model, cfg, ex, 2, 40, 5, 16, cpu, torch.bfloat16, 0)
    calls, kernel_kwargs, grid_plans = [], [], []
    real_widths, real_kernel, real_programs = sa.window_widths, sa.sparse_mla_attention, isk._programs
    monkeypatch.setattr(sa, "window_widths", lambda *a: calls.append(a) or real_widths(*a))
    monkeypatch.setattr(sa, "sparse_mla_attention",
                        lambda *a, **k: kernel_kwargs.append((a, k)) or real_kernel(*a, **k))
    monkeypatch.setattr(isk, "_programs", lambda *a: grid_plans.append(a) or real_programs(*a))
    run.fill()
    run.replay()
    assert len(calls) == 1 and len(grid_plans) == 1
    widths = [k["width"] for _, k in kernel_kwargs]
    assert len(widths) == len(cfg.layers) and widths[0] is not None and all(w is widths[0] for w in widths)
    with_pool = [(a[11], k["comp_valid"]) for a, k in kernel_kwargs if a[11] is not None]
    assert len(with_pool) == sum(1 for p in cfg.layers if p.ratio) and all(v is not None for _, v in with_pool)
    for ids, n_valid in with_pool:  # valid ids first, in ascending order, then the -1s; n_valid counts them
        assert torch.equal(n_valid, (ids >= 0).sum(-1, dtype=torch.int32))
        j = torch.arange(ids.shape[1])
        assert torch.equal(ids >= 0, j < n_valid[:, None].long())
        assert bool((ids[:, 1:] > ids[:, :-1])[(j[1:] < n_valid[:, None].long())].all())
    assert run.buffers.batch(2).layout(16, cfg.window_size).ring_write_row == slice(None)  # kv whole: a view


def _decode_logits(device: torch.device, shared: bool) -> list[torch.Tensor]:
    """Two decode steps (B = 2) of one emulated EP4 rank of tiny-v4.1 with V4.1-Flash's kernel choices (a 32-wide
    RoPE tail: the fused norm/RoPE/quant kernel takes its shapes) on the fast path. `shared=False` builds what the
    step's layers share in every layer again, as before issue 28: per layer window widths, top-k ordering and
    counting (in the kernel), index grid plans, n_visible, group RoPE tables."""
    import mini.model.attn_layer as attn_layer
    from mini.bench import rank4_decode as rd
    from mini.checkpoint import expert_range
    from mini.config import preset
    from mini.model.layout import StepLayout
    from mini.testing.emulated_ep import EmulatedEP
    from mini.testing.rank_model import rank_model
    with pytest.MonkeyPatch.context() as mp:
        if not shared:  # the kernel orders and counts the ids and builds the window widths itself, in every layer
            core = attn_layer.sparse_attention
            mp.setattr(attn_layer, "sparse_attention",
                       lambda *a, **k: core(*a, **dict(k, window_width=None, comp_valid=None)))
            mp.setattr(StepLayout, "table", lambda self, name, make: make())
        cfg = preset("tiny-v4.1").replace(rope_head_dim=32, index_head_dim=64)
        ex = EmulatedEP(4, 0, "uniform", expert_range(cfg, 0, 4))
        model = rank_model(cfg, device, torch.bfloat16, 0, expert_range(cfg, 0, 4), None, ex)
        run = rd.DecodeRun(model, cfg, ex, 2, 40, 5, 16, device, torch.bfloat16, 0)
        logits = []
        for _ in range(2):
            run.fill()
            logits.append(run.eager().clone())
        return logits


def _check_shared_equals_per_layer(device: torch.device):
    got, want = _decode_logits(device, True), _decode_logits(device, False)
    assert all(torch.isfinite(g).all() for g in got)
    assert all(torch.equal(g.view(torch.int32), w.view(torch.int32)) for g, w in zip(got, want))


def test_shared_step_values_give_the_per_layer_bits_cpu():
    mini.ops.set_backend("fast", interpret_on_cpu=True)  # the conftest gives the backend back
    _check_shared_equals_per_layer(torch.device("cpu"))


@pytest.mark.gpu
def test_shared_step_values_give_the_per_layer_bits_gpu():
    mini.ops.set_backend("fast")
    _check_shared_equals_per_layer(torch.device("cuda"))
