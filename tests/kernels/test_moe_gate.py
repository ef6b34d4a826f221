"""The fused MoE gate kernel (mini/kernels/moe_gate.py) against torch on its own logits and scores (debug output):
the selection must be the stable descending sort of score + bias (ties -> lowest expert id; equal to torch.topk
wherever nothing ties), the weights the normalised scores. CPU: Triton's interpreter; gpu: the compiled kernel at
V4.1-Flash's shape."""
import pytest
import torch
import torch.nn.functional as F

from mini.kernels.moe_gate import FEW_ROWS_CANDIDATES, GateConfig, column_blocks, few_rows_tiles, gate_topk
from mini.ops.moe import FEW_ROWS_GATE_MAX_TOKENS

SCALE = 2.5  # route_scale of V4.1


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty comes back filled with NaN / -7, so that an output element the kernel does not write
    shows up."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -7)
    monkeypatch.setattr(torch, "empty", empty)


def _inputs(T, D, E, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    w = (torch.randn(E, D, generator=g) / D ** 0.5).bfloat16()
    bias = torch.randn(E, generator=g) * 0.1
    return x.to(device), w.to(device), bias.to(device)


def _expected(scores, sel, k, eps, normalize=True):
    """The documented result from the kernel's own scores: ids by (sel desc, id asc), weights normalised by the
    sum taken in pick order."""
    ids = torch.sort(sel, dim=1, descending=True, stable=True).indices[:, :k]
    s = scores.gather(1, ids)
    total = s[:, 0].clone()
    for j in range(1, k):
        total = total + s[:, j]
    w = s / (total[:, None] + eps) if normalize else s
    return w * SCALE, ids


def _check(x, w, bias, k, eps=1e-20, normalize=True, bias_img=None, image_mask=None, config=None, few_rows=False):
    weights, ids, logits, scores = gate_topk(x, w, bias, k, SCALE, 1.0, eps, normalize, bias_img, image_mask,
                                             config, debug=True, few_rows=few_rows)
    T, E = x.shape[0], w.shape[0]
    assert weights.shape == (T, k) and ids.shape == (T, k) and ids.dtype == torch.int64
    # logits: fp32 sums of exact bf16 products, the tensor cores' partial sums promoted to fp32 every chunk
    torch.testing.assert_close(logits, x.float() @ w.float().t(), rtol=1e-5, atol=1e-5)
    # libdevice exp / log1p on the GPU (as CUDA's); the interpreter's log(1 + exp) loses digits on small scores
    torch.testing.assert_close(scores, F.softplus(logits).sqrt(), rtol=1e-6 if x.is_cuda else 1e-5, atol=0)
    sel = scores + (bias if image_mask is None else torch.where(image_mask[:, None], bias_img, bias))
    ew, eids = _expected(scores, sel, k, eps, normalize)
    assert torch.equal(ids, eids)
    torch.testing.assert_close(weights, ew, rtol=5e-7, atol=0)  # the same IEEE operations: an ulp or two
    # torch.topk: the same ids in rows where none of the k + 1 largest values tie, the same values everywhere
    top = sel.topk(min(k + 1, E), dim=1)
    tied = (top.values.diff(dim=1) == 0).any(dim=1)
    assert torch.equal(ids[~tied], top.indices[~tied, :k])
    assert torch.equal(sel.gather(1, ids), top.values[:, :k])
    # without the debug outputs: the same kernel, the same results
    w2, ids2 = gate_topk(x, w, bias, k, SCALE, 1.0, eps, normalize, bias_img, image_mask, config, few_rows=few_rows)
    assert torch.equal(ids2, ids) and torch.equal(w2, weights)
    return weights, ids


@pytest.mark.parametrize("T,D,E,k,config", [
    (37, 320, 384, 6, None),  # V4.1's expert count, a row tile past T
    (37, 320, 384, 6, GateConfig(16, 32, 4, 1)),  # several programs, the last one partial
    (70, 200, 100, 6, GateConfig(16, 64, 4, 1)),  # D not a multiple of BK; E = 64 + 36 (second block padded)
    (70, 200, 100, 6, GateConfig(16, 32, 4, 1, steps=3, inner_loop=True)),  # chunks as a loop, the last partial
    (37, 320, 384, 6, GateConfig(16, 32, 4, 1, steps=1)),  # no promotion
    (5, 96, 16, 4, None),  # tiny-v4.1: one column block
    (1, 64, 7, 1, None),  # one token, k = 1
])
def test_gate_kernel_matches_torch_interpreter(interpreter, poisoned, T, D, E, k, config):
    x, w, bias = _inputs(T, D, E)
    _check(x, w, bias, k, config=config)


@pytest.mark.parametrize("T,D,E,k", [(1, 320, 384, 6), (3, 200, 384, 6), (17, 320, 100, 6), (6, 96, 16, 4),
                                     (1, 64, 7, 1)])
def test_few_rows_gate_matches_torch_interpreter(interpreter, poisoned, T, D, E, k):
    """The decode path (experts and K split over the logits' programs, then the epilogue kernel) in the tiling
    chosen by T: the same checks as the fused kernel's, at decode sizes (17 rows: several row blocks; D not a
    multiple of the K piece; E of one or two column blocks, padded), with the V4 normalisation and the image bias
    too."""
    x, w, bias = _inputs(T, D, E, seed=T)
    _check(x, w, bias, k, few_rows=True)
    if T > 1:
        _check(x, w, bias, k, eps=0.0, few_rows=True)
        image_mask = torch.arange(T) % 2 == 0
        _check(x, w, bias, k, bias_img=torch.randn(E) * 0.5, image_mask=image_mask, few_rows=True)


@pytest.mark.parametrize("name", list(FEW_ROWS_CANDIDATES))
@pytest.mark.parametrize("T,D,E,k", [(1, 320, 384, 6), (5, 1088, 100, 6), (17, 200, 100, 6)])
def test_every_few_rows_tiling_matches_torch_interpreter(interpreter, poisoned, name, T, D, E, k):
    """Each candidate tiling the benchmark times, whichever T would choose it: one row; odd T of one and of several
    row blocks; D a multiple of 64 but not of the K piece (1,088: a partial piece); E padded in both column blocks;
    the image bias on odd rows."""
    tiles = FEW_ROWS_CANDIDATES[name]
    x, w, bias = _inputs(T, D, E, seed=T + 100)
    _check(x, w, bias, k, few_rows=tiles)
    if T > 1:
        image_mask = torch.arange(T) % 2 == 1
        _check(x, w, bias, k, bias_img=torch.randn(E) * 0.5, image_mask=image_mask, few_rows=tiles)


def test_few_rows_tiling_by_token_count():
    """Every decode size has a tiling; BT is a power of two covering T up to the tiling's BT_MAX (16 at least on
    the tensor cores), to the few-rows path's last size."""
    for T in range(1, FEW_ROWS_GATE_MAX_TOKENS + 1):
        tiles = few_rows_tiles(T)
        bt = tiles.rows_per_program(T)
        assert bt & (bt - 1) == 0 and (bt >= T or bt == tiles.BT_MAX or (tiles.tensor_cores and bt == 16))
        assert bt >= 16 or not tiles.tensor_cores
    for tiles in FEW_ROWS_CANDIDATES.values():
        assert tiles.K_PIECE % tiles.BK == 0 and tiles.rows_per_program(1) == (16 if tiles.tensor_cores else 1)


def test_gate_kernel_v4_normalisation_and_image_bias_interpreter(interpreter, poisoned):
    x, w, bias = _inputs(23, 128, 48, seed=1)
    _check(x, w, bias, 6, eps=0.0)  # V4: no epsilon
    _check(x, w, bias, 1, normalize=False)  # V4.1 with k = 1: scores as they are
    bias_img = torch.randn(48) * 0.5
    image_mask = torch.rand(23) < 0.5
    assert image_mask.any() and (~image_mask).any()
    _check(x, w, bias, 6, bias_img=bias_img, image_mask=image_mask)


FEW_ROWS_ALL = [False, True, *FEW_ROWS_CANDIDATES.values()]  # the fused kernel, few rows by T, each tiling
FEW_ROWS_IDS = ["fused", "few rows by T", *FEW_ROWS_CANDIDATES]


# (planted ties, seven equal maxima) per expert count, each list in both column blocks (NA + NB, column_blocks):
# V4.1's 384 = 256 + 128, and 48 = 32 + 16 for the explicit tilings, whose logits kernel runs E / BE programs per
# row block under the interpreter (fma 4x2560 at 384: 7 s a call, ~50 s the test; at 48 about a fifth). The pick
# kernel that breaks the ties is the same for every tiling; "few rows by T" runs it at 384.
TIES = {384: ([7, 41, 42, 300, 383], [5, 100, 260, 261, 300, 301, 302]),
        48: ([7, 20, 21, 40, 47], [5, 12, 33, 34, 40, 41, 42])}
TIES_PARAMS = [pytest.param(few_rows, 384 if few_rows in (False, True) else 48, id=name)
               for few_rows, name in zip(FEW_ROWS_ALL, FEW_ROWS_IDS)]


@pytest.mark.parametrize("few_rows,E", TIES_PARAMS)
def test_gate_kernel_breaks_ties_by_lowest_id_interpreter(interpreter, poisoned, few_rows, E):
    """Planted exact ties: zero gate rows (logit 0 in any summation order) with equal biases, in both column
    blocks; the lower expert id goes first, the same on every run."""
    tied, maxima = TIES[E]
    na, nb = column_blocks(E)
    assert nb and min(tied) < na <= max(tied) == E - 1 and min(maxima) < na <= maxima[2]
    x, w, bias = _inputs(5, 128, E, seed=2)
    w[tied] = 0
    bias[tied] = 10.0  # in every token's top 6
    weights, ids = _check(x, w, bias, 6, few_rows=few_rows)
    assert (ids[:, :5] == torch.tensor(tied)).all()
    assert (weights[:, :5] == weights[:, :1]).all()
    again = gate_topk(x, w, bias, 6, SCALE, eps=1e-20, few_rows=few_rows)
    assert torch.equal(again[1], ids) and torch.equal(again[0], weights)

    flat_bias = torch.zeros(E)
    flat_bias[maxima] = 1.0  # seven equal maxima for six places
    w_ids = gate_topk(x, torch.zeros_like(w), flat_bias, 6, SCALE, eps=1e-20, few_rows=few_rows)[1]
    assert (w_ids == torch.tensor(maxima[:6])).all()


@pytest.mark.parametrize("few_rows", FEW_ROWS_ALL, ids=FEW_ROWS_IDS)
def test_gate_kernel_ranks_nan_first_interpreter(interpreter, poisoned, few_rows):
    x, w, bias = _inputs(9, 64, 16, seed=3)
    x[4] = float("nan")
    weights, ids = gate_topk(x, w, bias, 4, SCALE, eps=1e-20, few_rows=few_rows)
    assert torch.equal(ids[4], torch.arange(4)) and weights[4].isnan().all()
    rest = torch.arange(9) != 4
    assert ((ids[rest] >= 0) & (ids[rest] < 16)).all() and weights[rest].isfinite().all()


def test_gate_kernel_of_no_tokens_interpreter(interpreter):
    x, w, bias = _inputs(0, 64, 16)
    weights, ids = gate_topk(x, w, bias, 4, SCALE)
    assert weights.shape == (0, 4) and ids.shape == (0, 4)


def test_column_blocks():
    assert column_blocks(384) == (256, 128) and column_blocks(256) == (256, 0) and column_blocks(100) == (64, 64)
    assert column_blocks(7) == (4, 4) and column_blocks(1) == (1, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4099, 16384])
def test_gate_kernel_at_v41_flash_shape_gpu(T):
    """16,384 tokens x 384 experts x D 5120, k 6: exact selection on the kernel's scores, scores as torch computes
    them from the same logits, and against the unfused fast gate (cuBLAS logits: summation order differs)."""
    _check_v41_shape(T, few_rows=False)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 16, 64, 96, 257, 384, 1023])
def test_few_rows_gate_at_v41_flash_shape_gpu(T):
    """The decode path at decode sizes (the tiling chosen by T), verify steps' B x 6 rows and up to the fused
    kernel's threshold (row blocks past 64), the same checks."""
    _check_v41_shape(T, few_rows=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FEW_ROWS_CANDIDATES))
@pytest.mark.parametrize("T", [1, 3, 16, 64, 257])
def test_every_few_rows_tiling_at_v41_flash_shape_gpu(T, name):
    """Each candidate tiling the benchmark times, compiled, the same checks (the logit error bound included)."""
    _check_v41_shape(T, few_rows=FEW_ROWS_CANDIDATES[name])


def _check_v41_shape(T, few_rows):
    x, w, bias = _inputs(T, 5120, 384, "cuda", seed=T)
    x = x * 3  # logits of a few units: scores across softplus's curved part
    weights, ids = _check(x, w, bias, 6, few_rows=few_rows)
    # the logits' error against float64: within a small factor of the IEEE fp32 GEMM's own (without the promotion
    # the tensor cores' truncation made it ~4e-5, some 30x the fp32 GEMM's)
    logits = gate_topk(x, w, bias, 6, SCALE, debug=True, few_rows=few_rows)[2].double()
    exact = x.double() @ w.double().t()
    ref_logits = x.float() @ w.float().t()  # the reference gate's logits (the unfused fast gate's too)
    err, err_fp32 = (logits - exact).abs().max().item(), (ref_logits.double() - exact).abs().max().item()
    print(f"T={T}: max |logit error| vs float64: kernel {err:.3g}, fp32 GEMM {err_fp32:.3g}")
    assert err <= 4 * err_fp32 + 1e-7, (err, err_fp32)
    ref_scores = F.softplus(ref_logits).sqrt()
    ref_w, ref_ids = _expected(ref_scores, ref_scores + bias, 6, 1e-20)
    same = ids == ref_ids
    assert same.float().mean() > 0.999
    torch.testing.assert_close(weights[same], ref_w[same], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gate_kernel_image_bias_gpu():
    x, w, bias = _inputs(2053, 5120, 384, "cuda", seed=5)
    image_mask = torch.rand(2053, device="cuda") < 0.3
    _check(x, w, bias, 6, bias_img=torch.randn(384, device="cuda") * 0.1, image_mask=image_mask)


def _build_for_sm90() -> None:
    """Builds the gate and routing-plan kernels for sm_90a (Triton -> PTX -> cubin, no GPU needed) at the launch
    parameters the wrappers use for the models' shapes; prints one line each. Run as a script, without
    TRITON_INTERPRET."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mini.kernels import moe_route
    from mini.kernels.moe_gate import CONFIGS, _gate_kernel, _gate_logits_kernel, _gate_pick_kernel

    def build(kernel, ptr_types, consts, num_warps=4, num_stages=2):
        names = kernel.arg_names
        types = {n: "constexpr" if n in consts else ptr_types.get(n, "*i32") if n.endswith("_ptr")
                 else "fp32" if n in ("temp", "route_scale", "eps") else "i32" for n in names}
        src = ASTSource(fn=kernel, signature=types, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps, num_stages=num_stages))
        assert k.metadata.shared <= 227 * 1024, k.metadata.shared
        print(kernel.__name__, consts, "shared", k.metadata.shared, "wgmma" if "wgmma" in k.asm["ptx"] else "", "ok",
              flush=True)

    gate_ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32", "bias_img_ptr": "*fp32", "img_ptr": "*u8",
                 "weights_ptr": "*fp32", "ids_ptr": "*i64", "logits_ptr": "*fp32", "scores_ptr": "*fp32"}
    # V4.1-Flash (+ image bias + debug outputs), V4-Flash, tiny-v4.1; the default config (the others: the bench)
    # (the last: one token, which Triton passes as a constant)
    for D, E, K, img, one in ((5120, 384, 6, False, {}), (5120, 384, 6, True, {}), (4096, 256, 6, False, {}),
                              (64, 16, 4, False, {}), (64, 7, 1, False, {"T": 1})):
        na, nb = column_blocks(E)
        c = CONFIGS[0]
        build(_gate_kernel, gate_ptrs, dict(**one, D=D, E=E, K=K, KP=triton.next_power_of_2(K), NA=na, NB=nb,
                                            NORMALIZE=True, HAS_IMG=img, DEBUG=img, LIBDEVICE=True,
                                            DOT_DTYPE=tl.bfloat16, BM=c.BM, BK=c.BK, STEPS=c.steps,
                                            INNER_LOOP=c.inner_loop),
              c.num_warps, c.num_stages)
        # the decode path (few_rows): each candidate tiling's logits kernel at the row tiles T = 1..64 take, then
        # the epilogue for each piece count
        few = {**gate_ptrs, "part_ptr": "*fp32", "debug_ptr": "*fp32"}
        for tiles, bt in _few_rows_builds():
            build(_gate_logits_kernel, few, dict(D=D, E=E, BT=bt, BE=tiles.BE, BK=tiles.BK, K_PIECE=tiles.K_PIECE,
                                                 TENSOR_CORES=tiles.tensor_cores, DOT_DTYPE=tl.bfloat16),
                  tiles.num_warps)
        for pieces, bm, warps in _pick_builds(D):
            build(_gate_pick_kernel, few, dict(E=E, K=K, KP=triton.next_power_of_2(K), NA=na, NB=nb, NORMALIZE=True,
                                               HAS_IMG=img, DEBUG=img, LIBDEVICE=True, BM=bm, PIECES=pieces,
                                               PP=triton.next_power_of_2(pieces)), warps)
    route_ptrs = {"ids_ptr": "*i64", "weights_ptr": "*fp32", "weight_ptr": "*fp32"}
    for E in (0, 1, 7, 96, 384):
        EB, SUB, STEP = moe_route.launch_sizes(E)
        build(moe_route._count_kernel, route_ptrs, dict(E=E, BLOCK=moe_route.BLOCK, SUB=SUB, EB=EB))
        for tile_m in (0, 128):
            build(moe_route._scan_kernel, route_ptrs, dict(E=E, EB=EB, NBB=STEP, TILE_M=tile_m, TB=STEP))
        # one block of pairs, one tile: Triton passes an integer argument equal to 1 as a constant
        build(moe_route._scan_kernel, route_ptrs, dict(n_blocks=1, n_tiles=1, E=E, EB=EB, NBB=STEP, TILE_M=128,
                                                       TB=STEP))
        build(moe_route._place_kernel, route_ptrs, dict(E=E, K=6, BLOCK=moe_route.BLOCK, SUB=SUB, EB=EB))
        for tile_m in (0, 128):  # a decode step's plan in one program
            build(moe_route._plan_one_kernel, route_ptrs, dict(E=E, K=6, SUB=SUB, EB=EB, TILE_M=tile_m, TB=STEP))


def _few_rows_builds():
    """(tiling, rows per program) of every candidate tiling at the row tiles decode steps of 1..64 tokens take."""
    builds = {}  # one per logits kernel (tilings that differ only in the epilogue share it)
    for t in FEW_ROWS_CANDIDATES.values():
        for T in (1, 64):
            bt = t.rows_per_program(T)
            builds.setdefault((t.BE, t.BK, t.K_PIECE, t.tensor_cores, t.num_warps, bt), (t, bt))
    return list(builds.values())


def _pick_builds(D):
    """(pieces, rows, warps) of the epilogue kernels the candidate tilings launch at width D."""
    import triton
    return sorted({(triton.cdiv(D, t.K_PIECE), t.BM, t.pick_warps) for t in FEW_ROWS_CANDIDATES.values()})


def _sm90_builds() -> int:
    """How many kernels `_build_for_sm90` builds."""
    widths = (5120, 5120, 4096, 64, 64)
    return sum(1 + len(_few_rows_builds()) + len(_pick_builds(D)) for D in widths) + 5 * 7


@pytest.mark.slow
def test_gate_and_route_kernels_build_for_sm90():
    """The interpreter accepts more than the compiler: build for Hopper in a subprocess (this session may have
    switched Triton to its interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" ok") == _sm90_builds(), run.stdout


if __name__ == "__main__":
    _build_for_sm90()
