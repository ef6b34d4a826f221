"""The deterministic mode's GEMM (mini/kernels/batch_invariant.py): parity with torch, and a row's bits do not
depend on how many rows the call has (rows alone == the same rows inside a larger batch, bit for bit). On CPU
under Triton's interpreter; the gpu test checks the compiled kernel and the aten overrides."""
import pytest
import torch

from mini.kernels import batch_invariant as bi


@pytest.fixture
def bf16_interpreter(interpreter):
    from mini.kernels.interpreter import patch_bf16
    patch_bf16()


def _data(M, K, N, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = torch.randn(N, K, generator=g).to(dtype).to(device)  # [N, K] like a linear weight
    return a, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_torch(bf16_interpreter, dtype):
    a, w = _data(37, 96, 70, dtype)
    got = bi.matmul(a, w.t(), out_dtype=torch.float32)
    want = a.double() @ w.double().t()
    tol = 1e-5 if dtype == torch.float32 else 1e-5  # bf16 products are exact in fp32: only fp32 sums differ
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    out = torch.full((37, 70), float("nan"), dtype=dtype)
    bi.matmul(a, w.t(), out=out)
    assert not out.isnan().any()
    assert torch.equal(out, got.to(dtype))  # one rounding of the same fp32 sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_alone_equal_rows_in_a_larger_batch(bf16_interpreter, dtype):
    """The property the mode needs: row r's bits depend only on row r (and B), for any M, including M = 1 and
    row counts that are not multiples of the tile. K = 200: several K steps and a partial last one."""
    a, w = _data(150, 200, 72, dtype, seed=1)
    full = bi.matmul(a, w.t())
    for lo, hi in ((0, 1), (5, 6), (3, 40), (64, 129), (149, 150)):
        part = bi.matmul(a[lo:hi], w.t())
        assert torch.equal(part, full[lo:hi]), (lo, hi)
    # the same rows in another batch (other neighbours, other position in the tile)
    mixed = torch.cat([torch.randn(9, 200).to(dtype), a[10:20]])
    assert torch.equal(bi.matmul(mixed, w.t())[9:], full[10:20])


def test_a_config_per_weight_shape_keeps_rows_invariant(bf16_interpreter, monkeypatch):
    """Calls of TUNED_MIN_ROWS rows or more take their weight shape's TUNED tile, smaller ones the default: a row
    computed alone, among 7, 300 and 4,096 rows (at four positions in the tile) gives the same bits (the tile,
    here 16 x 32 with GROUP_M 3 against the default 64 x 128, only says which program computes an element; BK is
    the default's). K = 96: a partial last K step."""
    a, w = _data(4096, 96, 40, torch.bfloat16, seed=4)
    tuned = bi.TileConfig(16, 32, bi.CONFIGS[torch.bfloat16].BK, num_warps=4, num_stages=2, GROUP_M=3)
    monkeypatch.setitem(bi.TUNED, (torch.bfloat16, 40, 96), tuned)
    assert bi.config_for(torch.bfloat16, 40, 96, 4096) == tuned
    assert bi.config_for(torch.bfloat16, 40, 96, bi.TUNED_MIN_ROWS - 1) == bi.CONFIGS[torch.bfloat16]
    assert bi.config_for(torch.bfloat16, 40, 64, 4096) == bi.CONFIGS[torch.bfloat16]
    f32 = torch.float32  # the fp32 sums themselves (a bf16 output would hide a last-bit difference)
    full = bi.matmul(a, w.t(), out_dtype=f32)
    for r in (0, 1, 2049, 4095):
        alone = bi.matmul(a[r:r + 1], w.t(), out_dtype=f32)
        assert torch.equal(alone, full[r:r + 1]), r
        for m in (7, 300):
            lo = max(0, min(r - m // 2, 4096 - m))
            assert torch.equal(bi.matmul(a[lo:lo + m], w.t(), out_dtype=f32)[r - lo], full[r]), (r, m)
    assert torch.equal(bi.matmul(a[5:12], w.t(), out_dtype=f32, config=tuned), full[5:12])
    assert torch.equal(bi.matmul(a[:1000], w.t()), full[:1000].bfloat16())  # bf16 out: one rounding of those
    # a BK of its own would not do (the interpreter rounds once per BK step): this is what the test can see
    other_bk = bi.TileConfig(16, 32, 32, num_warps=4, num_stages=2)
    assert not torch.equal(bi.matmul(a[:300], w.t(), out_dtype=f32, config=other_bk), full[:300])


def test_tuned_tiles_keep_the_default_reduction():
    """Every TUNED entry is for a dtype the kernel takes and sums in the default's BK steps (the tile may differ:
    that only places the programs)."""
    for (dtype, n, k), cfg in bi.TUNED.items():
        assert dtype in bi.CONFIGS and n > 0 and k > 0
        assert cfg.BK == bi.CONFIGS[dtype].BK, (dtype, n, k, cfg)
        assert cfg.BM >= 16 and cfg.BN >= 16 and cfg.num_warps in (4, 8)
        assert cfg.kernel in bi.KERNELS and cfg.kernel != "fma-rows", (dtype, n, k, cfg)


def test_fp32_few_rows_take_the_small_tile_with_the_same_sums(bf16_interpreter):
    """fp32 calls of at most SMALL_ROWS rows (the head at decode) take SMALL_FP32 (the FMA-chain kernel; under the
    interpreter, whose tl.fma rounds twice, the 16-row dot tile SMALL_FP32_DOT), larger ones the default 64 x 64: a
    row alone, among 2..16 rows (small tile) and among 40 and 150 (default tile) gives the same bits. K = 200:
    several K steps and a partial last one; N = 150: a partial column tile. (The FMA-chain kernel's bits against
    the dot tile's: test_fp32_small_rows_tile_equals_the_default_tile_gpu.)"""
    f32 = torch.float32
    assert bi.SMALL_FP32.kernel == "fma-rows" and bi.SMALL_FP32_DOT.kernel == "pointer"
    small = bi.SMALL_FP32_DOT if bi._INTERPRET else bi.SMALL_FP32
    assert bi.config_for(f32, 129280, 5120, 1) == small
    assert bi.config_for(f32, 129280, 5120, bi.SMALL_ROWS) == small
    assert bi.config_for(f32, 129280, 5120, bi.SMALL_ROWS + 1) == bi.CONFIGS[f32]
    assert bi.config_for(torch.bfloat16, 129280, 5120, 1) == bi.CONFIGS[torch.bfloat16]
    assert bi.SMALL_FP32_DOT.BK == bi.CONFIGS[f32].BK and bi.SMALL_FP32_DOT.BM == 16
    a, w = _data(150, 200, 150, f32, seed=5)
    full = bi.matmul(a, w.t())  # 150 rows: the default tile
    for lo, hi in ((0, 1), (7, 8), (149, 150), (3, 5), (10, 26), (100, 140)):
        out = torch.full((hi - lo, 150), float("nan"))
        bi.matmul(a[lo:hi], w.t(), out=out)
        assert torch.equal(out, full[lo:hi]), (lo, hi)
    assert torch.equal(bi.matmul(a[:16], w.t(), config=bi.CONFIGS[f32]), full[:16])


@pytest.mark.parametrize("kernel", ["tma", "tma-persistent", "tma-persistent-flat"])
def test_tma_kernels_give_the_pointer_kernels_bits(bf16_interpreter, kernel):
    """The TMA-descriptor kernels (one program per tile, persistent, persistent and flattened) compute the pointer
    kernel's sums: the same bits for a linear layer's transposed weight and a [K, N] one, a partial last K step,
    partial row / column tiles, alpha and an addend, and bmm over batches whose tiles run past a batch's rows.
    (On the GPU, tools/det_profile.py --variants-only checks them at the rank4 shapes before any is used.)"""
    bf = torch.bfloat16
    cfg = bi.TileConfig(32, 32, bi.CONFIGS[bf].BK, num_warps=4, num_stages=2, GROUP_M=3, kernel=kernel)
    a, w = _data(70, 200, 48, bf, seed=6)
    f32 = torch.float32
    want = bi.matmul(a, w.t(), out_dtype=f32)
    assert torch.equal(bi.matmul(a, w.t(), out_dtype=f32, config=cfg), want)
    assert torch.equal(bi.matmul(a, w.t().contiguous(), out_dtype=f32, config=cfg), want)  # b as [K, N]
    bias = torch.randn(48).to(bf)
    got = bi.matmul(a, w.t(), add=bias, alpha=0.5, beta=2.0, config=cfg)
    assert torch.equal(got, bi.matmul(a, w.t(), add=bias, alpha=0.5, beta=2.0))
    x, y = torch.randn(3, 40, 128).to(bf), torch.randn(3, 24, 128).to(bf)  # 40 rows: tiles cross batches
    want_b = bi.bmm(x, y.transpose(1, 2), out_dtype=f32)
    out = torch.full((3, 40, 24), float("nan"))
    bi.bmm(x, y.transpose(1, 2), out=out, config=cfg)
    assert torch.equal(out, want_b)
    # attention's grouped output projection: a = o [T, G, k] transposed (groups side by side in a row), b = wo_a
    # [G, r, k] transposed, out [T, G, r] transposed
    o, wo_a = torch.randn(40, 3, 128).to(bf), torch.randn(3, 24, 128).to(bf)
    assert bi._tma_operands(o.transpose(0, 1), wo_a.transpose(1, 2), cfg)[2] is True  # a's batches in columns
    out = torch.full((40, 3, 24), float("nan"), dtype=bf)
    bi.bmm(o.transpose(0, 1), wo_a.transpose(1, 2), out=out.transpose(0, 1), config=cfg)
    assert torch.equal(out.transpose(0, 1), bi.bmm(o.transpose(0, 1), wo_a.transpose(1, 2)))
    o2 = torch.randn(40, 3, 100).to(bf)  # a partial K step: would read the next group's columns, so not TMA
    assert bi._tma_operands(o2.transpose(0, 1), torch.randn(3, 100, 24).to(bf), cfg) is None
    # [K, N] b over batches with a K tail: a descriptor would read the next batch's rows, so the pointer kernel
    x2, y2 = torch.randn(2, 9, 100).to(bf), torch.randn(2, 100, 24).to(bf)
    assert bi._tma_operands(x2, y2, cfg) is None
    assert torch.equal(bi.bmm(x2, y2, out_dtype=f32, config=cfg), bi.bmm(x2, y2, out_dtype=f32))


def test_fma_rows_kernel_is_a_gemm_and_row_invariant(bf16_interpreter):
    """The fp32 few-rows kernel ("fma-rows"): each element's FMA chain over k in order. Under the interpreter
    (whose tl.fma rounds the product and the sum apart) only checked against float64 and for rows alone ==
    among up to 16; the GPU sweep (tools/det_profile.py --variants-only) checks its bits against the dot kernel's.
    K = 203: a partial last group of 8."""
    f32 = torch.float32
    cfg = bi.TileConfig(16, 32, bi.CONFIGS[f32].BK, num_warps=1, num_stages=1, kernel="fma-rows")
    a, w = _data(16, 203, 70, f32, seed=7)
    want = a.double() @ w.double().t()
    full = bi.matmul(a, w.t(), config=cfg)
    assert torch.allclose(full.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for lo, hi in ((0, 1), (5, 8), (15, 16), (2, 11)):
        assert torch.equal(bi.matmul(a[lo:hi], w.t(), config=cfg), full[lo:hi]), (lo, hi)
    bias = torch.randn(70)
    got = bi.matmul(a[:3], w.t(), add=bias, config=cfg)
    assert torch.allclose(got.double(), want[:3] + bias.double(), rtol=1e-5, atol=1e-4)
    x, y = torch.randn(2, 3, 203), torch.randn(2, 203, 40)  # batched, b as [K, N] (its k strided)
    got = bi.bmm(x, y, config=cfg)
    assert torch.allclose(got.double(), x.double() @ y.double(), rtol=1e-5, atol=1e-4)
    a2, _ = _data(37, 203, 70, f32, seed=8)  # more rows than a program holds: 3 row blocks
    got = bi.matmul(a2, w.t(), config=cfg)
    assert torch.allclose(got.double(), a2.double() @ w.double().t(), rtol=1e-5, atol=1e-4)
    assert torch.equal(bi.matmul(a2[20:21], w.t(), config=cfg), got[20:21])
    with pytest.raises(ValueError, match="unknown kernel 'fast'"):
        bi.matmul(a, w.t(), config=bi.TileConfig(16, 32, 32, 4, 2, kernel="fast"))


@pytest.mark.slow
def test_kernels_build_for_sm90():
    """Every kernel and variant builds for Hopper (sm_90a; batch_invariant_sm90_build.py, in a subprocess: this
    session may run Triton's interpreter), so that a variant the GPU sweep would try cannot fail to compile."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("batch_invariant_sm90_build.py"))], env=env,
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" ok") == 21, run.stdout


def test_addmm_and_bmm_forms(bf16_interpreter):
    a, w = _data(21, 64, 40, torch.float32, seed=2)
    bias = torch.randn(40)
    got = bi.matmul(a, w.t(), add=bias, alpha=1.0, beta=1.0)
    assert torch.allclose(got, torch.addmm(bias, a, w.t()), rtol=1e-5, atol=1e-5)
    x = torch.randn(3, 17, 64)
    y = torch.randn(3, 64, 24)
    b = bi.bmm(x, y)
    assert torch.allclose(b, torch.bmm(x, y), rtol=1e-5, atol=1e-5)
    assert torch.equal(bi.bmm(x[:, 4:9], y), b[:, 4:9])
    # strided operands (a transposed view, as F.linear passes the weight)
    assert torch.equal(bi.matmul(a.t().contiguous().t(), w.t()), bi.matmul(a, w.t().contiguous()))


def test_refuses_what_it_has_no_kernel_for():
    with pytest.raises(NotImplementedError, match="float64"):
        bi.matmul(torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="bfloat16 x torch.float32"):
        bi.matmul(torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2))


@pytest.mark.gpu
def test_overrides_make_cuda_gemms_batch_invariant():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch.nn.functional as F
    cases = {}
    for dtype in (torch.bfloat16, torch.float32):  # the float64 oracle first: the mode refuses float64 GEMMs
        a, w = _data(4096, 5120, 1536, dtype, device="cuda", seed=3)
        cases[dtype] = a, w, a.double() @ w.double().t()
    bi.enable()
    try:
        for dtype, (a, w, want) in cases.items():
            full = F.linear(a, w)
            rel = float((full.double() - want).norm() / want.norm())
            # fp32: one IEEE sum over K = 5120 in order, ~sqrt(K) roundings of 2^-24 (1.3e-6 seen on the H200)
            assert rel < (5e-6 if dtype == torch.float32 else 4e-3), rel
            for n in (1, 3, 17, 64, 100, 1000):
                assert torch.equal(F.linear(a[:n], w), full[:n]), (dtype, n)
            x = a[:300].view(3, 100, 5120)
            assert torch.equal(torch.einsum("btk,nk->btn", x, w)[1], full[100:200])
            if hasattr(torch.ops.aten.mm, "dtype") and dtype == torch.bfloat16:
                f32 = torch.mm(a, w.t(), out_dtype=torch.float32)
                assert torch.equal(torch.mm(a[:5], w.t(), out_dtype=torch.float32), f32[:5])
    finally:
        bi.disable()
    # cuBLAS again
    a, w = _data(8, 64, 8, torch.float32, device="cuda")
    assert torch.allclose(F.linear(a, w), (a.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_fp32_small_rows_tile_equals_the_default_tile_gpu():
    """On the compiled kernel (FMA dots): an fp32 row alone and among 2..16 rows (SMALL_FP32's 16-row tile) has
    the bits it has among 17, 300 and 4,096 rows (the default 64 x 64 tile), through F.linear as the head calls it;
    and it stays a GEMM (float64 oracle)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch.nn.functional as F
    a, w = _data(4096, 5120, 4099, torch.float32, device="cuda", seed=20)
    want = a[:16].double() @ w.double().t()
    bi.enable()
    try:
        full = F.linear(a, w)
        rel = float((full[:16].double() - want).norm() / want.norm())
        assert rel < 5e-6, rel
        for lo, hi in ((0, 1), (1, 2), (4095, 4096), (0, 16), (3, 10), (100, 117), (1000, 1300)):
            assert torch.equal(F.linear(a[lo:hi], w), full[lo:hi]), (lo, hi)
    finally:
        bi.disable()


@pytest.mark.gpu
def test_grouped_linear_rows_invariant_gpu():
    """Attention's grouped output projection as the model calls it (mini.ops.linear.grouped_linear: bmm
    of o [T, 8, 4096] transposed by wo_a [8, 1024, 4096] transposed into out [T, 8, 1024] transposed) on the
    compiled kernels: 4,096 rows take the TUNED TMA kernel with the groups side by side in a's rows, 1, 7 and 300
    rows the default pointer tile; a row's bits are the same in each, and it stays a GEMM."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mini.ops.linear import grouped_linear
    g = torch.Generator(device="cuda").manual_seed(30)
    o = torch.randn(4096, 8, 4096, device="cuda", generator=g).bfloat16()
    wo_a = torch.randn(8, 1024, 4096, device="cuda", generator=g).bfloat16()
    cfg = bi.config_for(torch.bfloat16, 1024, 4096, 4096)
    assert cfg.kernel.startswith("tma") and bi._tma_operands(o.transpose(0, 1), wo_a.transpose(1, 2), cfg)[2]
    want = torch.einsum("tgd,grd->tgr", o[:64].double(), wo_a.double()).flatten(1)
    bi.enable()
    try:
        full = grouped_linear(o, wo_a)
        rel = float((full[:64].double() - want).norm() / want.norm())
        assert rel < 4e-3, rel
        for lo, hi in ((0, 1), (4095, 4096), (1000, 1007), (2000, 2300), (10, 1510)):
            assert torch.equal(grouped_linear(o[lo:hi], wo_a), full[lo:hi]), (lo, hi)
    finally:
        bi.disable()


@pytest.mark.gpu
def test_every_weight_shape_config_keeps_rows_invariant_gpu():
    """Each `TUNED` entry (and the bf16 default) on the compiled kernel: a row alone, among 7, 300, 1,500 and
    4,096 rows (the default tile below TUNED_MIN_ROWS, the tuned one from it) gives the same bits, through the aten
    override (F.linear) as the model calls it and as fp32 sums; and it stays a GEMM (float64 oracle within bf16's
    rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch.nn.functional as F
    shapes = sorted({(n, k) for (dt, n, k) in bi.TUNED if dt == torch.bfloat16} | {(1536, 5120)})
    for i, (n, k) in enumerate(shapes):
        a, w = _data(4096, k, n, torch.bfloat16, device="cuda", seed=10 + i)
        want = a[:256].double() @ w.double().t()  # (a float64 oracle of 256 rows: ~60 s for all of them)
        bi.enable()
        try:
            full = F.linear(a, w)
            rel = float((full[:256].double() - want).norm() / want.norm())
            assert rel < 4e-3, (n, k, rel)
            f32 = bi.matmul(a, w.t(), out_dtype=torch.float32)  # the sums before bf16 hides a last bit
            for r in (0, 1234, 4095):
                assert torch.equal(F.linear(a[r:r + 1], w), full[r:r + 1]), (n, k, r)
                assert torch.equal(bi.matmul(a[r:r + 1], w.t(), out_dtype=torch.float32), f32[r:r + 1]), (n, k, r)
                for m in (7, 300, 1500):
                    lo = max(0, min(r - m // 2, 4096 - m))
                    assert torch.equal(F.linear(a[lo:lo + m], w)[r - lo], full[r]), (n, k, r, m)
                    got = bi.matmul(a[lo:lo + m], w.t(), out_dtype=torch.float32)[r - lo]
                    assert torch.equal(got, f32[r]), (n, k, r, m)
        finally:
            bi.disable()
