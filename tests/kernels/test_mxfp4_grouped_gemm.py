"""Grouped MXFP4 GEMMs (weights decoded in the main loop) against the same math in plain PyTorch on dequantized
weights. Both GEMMs sum exact bf16 x bf16 products in fp32, so they agree to the summation order; the plain GEMM is
checked bit for bit on small-integer data (where every sum is exact), the SwiGLU one to the last FP8 rounding."""
import pytest
import torch
import torch.nn.functional as F

from mini.formats import dequant_mxfp4, fake_quant_fp8, quantize_mxfp4
from mini.kernels.moe_route import plan_routes
from mini.kernels.mxfp4_grouped_gemm import grouped_down, grouped_swiglu, swiglu_rows
from mini.ops.linear import QWeight
from mxfp4_probe import N_ROWS, expected, mismatches, probe_weights

SMALL = dict(BN=32, BK=64, num_warps=4, num_stages=1)
SMALL_SWAPPED = dict(SMALL, SWAP_AB=True)
GPU_CONFIGS = [None, dict(BN=128, BK=64, num_warps=8, num_stages=4, SWAP_AB=True),
               dict(BN=128, BK=128, num_warps=8, num_stages=3, SWAP_AB=False)]


def random_experts(E, N, K, device, spread=6):
    """Stacked MXFP4 weights whose rows span 2^spread in magnitude (so the E8M0 scales differ)."""
    w = torch.randn(E, N, K) * torch.logspace(-spread / 2, spread / 2, N, base=2.0)[:, None] * 0.05
    data, scale = quantize_mxfp4(w)
    return QWeight("mxfp4", data.to(device), scale.to(device), 32)


def routes(T, k, n_experts, experts, device, block_m):
    ids = torch.stack([torch.randperm(n_experts)[:k] for _ in range(T)]).to(device)
    return ids, plan_routes(ids, torch.rand(T, k, device=device), experts, block_m)


def row_expert(ids, plan, experts):
    """Local expert index of each valid sorted row, and the number of valid rows."""
    local = (ids >= experts.start) & (ids < experts.stop)
    n = int(local.sum())
    e = torch.empty(plan.n_rows, dtype=torch.long, device=ids.device)
    e[plan.slot_row[local].long()] = (ids[local] - experts.start).long()
    return e[:n], n


def reference_swiglu(x, plan, w1, w3, e_of_row, limit, quant_block):
    n = e_of_row.numel()
    xs = x[plan.token[:n].long()].float()
    W1 = dequant_mxfp4(w1.data, w1.scale)[e_of_row]  # [n, I, D]
    W3 = dequant_mxfp4(w3.data, w3.scale)[e_of_row]
    g = torch.einsum("nd,nid->ni", xs.double(), W1.double()).float().to(x.dtype).float()
    u = torch.einsum("nd,nid->ni", xs.double(), W3.double()).float().to(x.dtype).float()
    h = F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit) * plan.weight[:n, None]
    h = h.to(x.dtype)
    return fake_quant_fp8(h, quant_block) if quant_block else h


def assert_fp8_close(out, ref):
    """Equal except for rare FP8 roundings that land on the other side of a tie (one e4m3 step, < 1% of them)."""
    diff = out.float() != ref.float()
    assert diff.float().mean() < 0.01, f"{int(diff.sum())} of {diff.numel()} differ"
    step = torch.maximum(out.float().abs(), ref.float().abs()) / 8
    assert ((out.float() - ref.float()).abs() <= step + 1e-30).all()


def _swiglu_case(T, k, n_experts, experts, D, I, device, dtype, block_m, config, limit=2.0):
    ids, plan = routes(T, k, n_experts, experts, device, block_m)
    w1, w3 = random_experts(len(experts), I, D, device), random_experts(len(experts), I, D, device)
    x = fake_quant_fp8((torch.randn(T, D) * 2).to(device).to(dtype), 32)
    e_of_row, n = row_expert(ids, plan, experts)
    out = torch.full((plan.n_rows, I), float("nan"), dtype=dtype, device=device)
    h = grouped_swiglu(x, plan, w1, w3, limit, 32, out=out, config=config)
    assert torch.isfinite(h[:n]).all() and h[n:].isnan().all(), "rows written must be exactly the local ones"
    assert_fp8_close(h[:n], reference_swiglu(x, plan, w1, w3, e_of_row, limit, 32))


def _down_case(T, k, n_experts, experts, D, I, device, dtype, block_m, config):
    """Small-integer data: activations j/8 and weights with E8M0 scale 2^0..2^1 keep every fp32 sum exact."""
    ids, plan = routes(T, k, n_experts, experts, device, block_m)
    E = len(experts)
    codes = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8)
    scale = torch.randint(127, 129, (E, D, I // 32), dtype=torch.uint8)
    w2 = QWeight("mxfp4", codes.to(device), scale.to(device), 32)
    h = (torch.randint(-16, 17, (plan.n_rows, I)) / 8).to(device).to(dtype)
    e_of_row, n = row_expert(ids, plan, experts)
    out = torch.full((plan.n_rows, D), float("nan"), dtype=dtype, device=device)
    y = grouped_down(h, plan, w2, out=out, config=config)
    W2 = dequant_mxfp4(w2.data, w2.scale)[e_of_row]
    ref = torch.einsum("ni,ndi->nd", h[:n].double(), W2.double()).to(dtype)
    assert y[n:].isnan().all()
    assert torch.equal(y[:n], ref)


@pytest.mark.parametrize("config", [SMALL, SMALL_SWAPPED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [96, 128])  # 96: K not a multiple of BK
def test_swiglu_matches_reference_interpreter(dtype, D, config, interpreter):
    _swiglu_case(9, 4, 16, range(3, 11), D, 64, "cpu", dtype, 16, config)


@pytest.mark.parametrize("config", [SMALL, SMALL_SWAPPED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_down_is_exact_on_exact_data_interpreter(dtype, config, interpreter):
    _down_case(11, 3, 12, range(0, 5), 80, 96, "cpu", dtype, 8, config)


def _decode_case(device, config, K=64):
    """Every E2M1 code under every E8M0 scale byte 0..255 (mxfp4_probe.py), through the plain GEMM with one-hot
    activations, into a NaN-poisoned output: each output is one decoded weight, bit for bit as the CPU decoder
    gives it (denormal scale 2^-127 at byte 0, inf where fp32 overflows, NaN at byte 255)."""
    codes, scales = probe_weights(K)
    w = QWeight("mxfp4", codes[None].to(device), scales[None].to(device), 32)
    ids = torch.zeros(K, 1, dtype=torch.long, device=device)
    plan = plan_routes(ids, torch.ones(K, 1, device=device), range(0, 1), 64)
    out = torch.full((plan.n_rows, N_ROWS), float("nan"), dtype=torch.bfloat16, device=device)
    y = grouped_down(torch.eye(K, device=device, dtype=torch.bfloat16), plan, w, out=out, config=config)
    assert y[K:].isnan().all(), "rows past the routed ones must stay unwritten"
    n_bad, first = mismatches(y[:K], expected(codes, scales), codes, scales)
    assert n_bad == 0, f"{n_bad} outputs differ: {first}"


@pytest.mark.parametrize("config", [SMALL, SMALL_SWAPPED])
def test_decode_all_codes_and_scales_interpreter(config, interpreter):
    _decode_case("cpu", config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS)
@pytest.mark.parametrize("K", [64, 96])  # 96: the last K step is partial (masked loads)
def test_decode_all_codes_and_scales_gpu(config, K):
    _decode_case("cuda", config, K)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS)
@pytest.mark.parametrize("T,k,experts,block_m", [(1, 6, range(0, 48), 64), (300, 6, range(16, 40), 64),
                                                 (1000, 4, range(0, 48), 128)])
def test_swiglu_gpu(T, k, experts, block_m, config):
    _swiglu_case(T, k, 48, experts, 1024, 352, "cuda", torch.bfloat16, block_m, config, limit=10.0)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS)
@pytest.mark.parametrize("T,k,experts", [(1, 6, range(0, 48)), (300, 6, range(16, 40)), (1000, 4, range(0, 48))])
def test_down_gpu(T, k, experts, config):
    _down_case(T, k, 48, experts, 1056, 320, "cuda", torch.bfloat16, 64, config)


def _swiglu_rows_case(R, n_valid, N, quant_block, device, limit=3.0):
    """The epilogue as its own pass (for library GEMMs): the same formula as reference_swiglu after its GEMMs.
    g and u are the two halves of one [R, 2N] GEMM output (w1 and w3 side by side)."""
    gu = (torch.randn(R, 2 * N) * 3).bfloat16().to(device)
    g, u = gu[:, :N], gu[:, N:]
    route_w = torch.rand(R, device=device)
    out = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device=device)
    h = swiglu_rows(g, u, route_w, torch.tensor([n_valid], dtype=torch.int32, device=device), limit, quant_block,
                    out=out)
    ref = F.silu(g[:n_valid].float().clamp(max=limit)) * u[:n_valid].float().clamp(-limit, limit)
    ref = (ref * route_w[:n_valid, None]).bfloat16()
    ref = fake_quant_fp8(ref, quant_block) if quant_block else ref
    assert h[n_valid:].isnan().all(), "rows past n_valid must stay unwritten"
    assert_fp8_close(h[:n_valid], ref)


@pytest.mark.parametrize("quant_block", [0, 32, 128])
def test_swiglu_rows_matches_formula_interpreter(quant_block, looped, interpreter):
    _swiglu_rows_case(37, 29, 256, quant_block, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("quant_block", [0, 32])
def test_swiglu_rows_matches_formula_gpu(quant_block, looped):
    _swiglu_rows_case(3001, 2890, 2304, quant_block, "cuda")
