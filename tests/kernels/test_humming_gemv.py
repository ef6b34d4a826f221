"""The decode candidate over Humming's layout (mini/kernels/humming_gemv.py): on CPU under the interpreter, against
the dequantized checkpoint weights (one fp32 sum of the exact products per output, one bf16 rounding), with the
layout written by `layout_codes` / `layout_scales`; on the GPU, those layout functions against the library's own
rewrite (`humming_experts.convert`) and the kernel against Humming's GEMM at V4.1's shapes."""
import pytest
import torch

from mini.formats import dequant_mxfp4
from mini.kernels.humming_gemv import humming_gemv, layout_codes, layout_scales, pieces_for, runs_on


def _experts(E, N, K, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 124, (E, N, K // 32), generator=g, dtype=torch.uint8)
    return codes.to(device), scales.to(device)


def _rows(counts, K, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    offset = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
    a = (torch.randn(int(counts.sum()) + 3, K, generator=g) * 2).bfloat16()  # 3 rows past the local ones
    return a.to(device), offset.to(device)


def _check(out, a, offset, codes, scales):
    """Each local row within half a bf16 ulp of the float64 product plus what another fp32 summation order moves,
    almost all equal to the fp32 GEMM's bf16; rows past the local ones untouched (NaN)."""
    for e in range(codes.shape[0]):
        lo, hi = int(offset[e]), int(offset[e + 1])
        if hi == lo:
            continue
        w = dequant_mxfp4(codes[e], scales[e]).double()
        ref = a[lo:hi].double() @ w.T
        spread = a[lo:hi].double().abs() @ w.abs().T
        err = (out[lo:hi].double() - ref).abs()
        assert (err <= ref.abs() * 2.0 ** -8 + spread * 1e-5).all(), f"expert {e}: max error {err.max():.3g}"
        same = (out[lo:hi] == (a[lo:hi].float() @ w.float().T).bfloat16()).float().mean().item()
        assert same > 0.97, same
    assert out[int(offset[-1]):].isnan().all()


def test_layout_functions_are_permutations():
    """Every code and scale byte lands somewhere, once: the layout moves values, never changes them."""
    codes, scales = _experts(2, 128, 128, seed=0)
    lay = layout_codes(codes)
    assert lay.shape == (2, 128 // 16, 2 * 128) and lay.dtype == torch.int32
    b = lay.view(torch.uint8)
    nib = torch.stack([b & 15, b >> 4], -1)
    want = torch.stack([codes & 15, codes >> 4], -1)
    assert torch.equal(torch.bincount(nib.flatten().long(), minlength=16), torch.bincount(want.flatten().long(),
                                                                                          minlength=16))
    ls = layout_scales(scales)
    assert ls.shape == (2, 128 // 32, 128) and torch.equal(ls.flatten().sort().values, scales.flatten().sort().values)
    # the documented positions: column 16 i3 + 8 i4 + tn, k 8 i5 + 2 tk + i6 at word 4 (4 tn + tk) + i3, nibble
    # 4 i6 + 2 i4 + i5 of slab row s and column block b; scale of column 8c + a at 8a + c
    full = torch.stack([codes & 15, codes >> 4], -1).reshape(2, 128, 128)
    for n, k in ((0, 0), (37, 101), (127, 127), (64 + 9, 17)):
        b_, nn, s, kk = n // 64, n % 64, k // 16, k % 16
        i3, i4, tn, i5, tk, i6 = nn // 16, (nn // 8) % 2, nn % 8, kk // 8, (kk % 8) // 2, kk % 2
        word = lay[1, s, 128 * b_ + 4 * (4 * tn + tk) + i3]
        assert (int(word) >> (4 * (4 * i6 + 2 * i4 + i5))) & 15 == int(full[1, n, k])
        assert int(ls[1, k // 32, 64 * b_ + 8 * (nn % 8) + nn // 8]) == int(scales[1, n, k // 32])


@pytest.mark.parametrize("counts,pieces", [([2, 0, 3], 1), ([1, 0, 0], 2), ([0, 19, 1], 3), ([4, 4, 4], 2)])
def test_rows_match_the_dequantized_product_interpreted(interpreter, poisoned, counts, pieces):
    """3 experts, N = 128, K = 384 (3 steps of 128: 2 pieces hold 2 + 1 steps), rows per expert 0-19 (a second
    16-row chunk), split over K or not."""
    if not runs_on(torch.empty(0)):
        pytest.skip("Triton < 3.7's interpreter cannot run this kernel's loop (its run-time bound); CUDA runs it")
    E, N, K = 3, 128, 384
    codes, scales = _experts(E, N, K, seed=sum(counts) + pieces)
    a, offset = _rows(counts, K, seed=pieces)
    out = humming_gemv(a, layout_codes(codes), layout_scales(scales), offset, touched=E, pieces=pieces)
    _check(out, a, offset, codes, scales)


def test_pieces_fill_the_gpu():
    assert pieces_for(4608, 5120, touched=1) > 1  # one expert's 72 column blocks alone: split K
    assert pieces_for(4608, 5120, touched=96) == 1
    assert 1 <= pieces_for(5120, 2304, touched=2) <= 2304 // 64


def test_bad_input_is_refused():
    codes, scales = _experts(2, 128, 128, seed=1)
    w, s = layout_codes(codes), layout_scales(scales)
    a, offset = _rows([1, 1], 128, seed=1)
    with pytest.raises(ValueError, match="row-major bf16"):
        humming_gemv(a.float(), w, s, offset, touched=2)
    with pytest.raises(ValueError, match="K of 128"):
        c2, s2 = _experts(2, 128, 192, seed=2)
        humming_gemv(_rows([1, 1], 192, seed=1)[0], layout_codes(c2), layout_scales(s2), offset, touched=2)
    with pytest.raises(ValueError, match="expert_offset"):
        humming_gemv(a, w, s, offset[:2], touched=2)
    with pytest.raises(ValueError, match="out must be"):
        humming_gemv(a, w, s, offset, touched=2, out=torch.empty(1, 128, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4608, 5120), (5120, 2304), (256, 256)])
def test_layout_functions_write_the_librarys_layout_gpu(N, K):
    """`layout_codes` / `layout_scales` == the bytes `humming_experts.convert` leaves (the library's own transform
    behind it), so the kernel reads what Humming's GEMM reads."""
    from mini.kernels import humming_experts as hx
    if not hx.available():
        pytest.skip("humming-kernels is not importable on an SM90 GPU here")
    codes, scales = _experts(2, N, K, seed=N, device="cuda")
    want_w, want_s = layout_codes(codes), layout_scales(scales)
    stack = hx.convert(codes.clone(), scales.clone())
    assert torch.equal(stack.weight, want_w)
    assert torch.equal(stack.scale.view(torch.uint8), want_s)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[4, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 1, 1, 1, 0], [0, 16, 2, 0, 5, 0, 0, 9]])
def test_matches_the_dequantized_product_at_v41_shapes_gpu(counts):
    """V4.1's w1|w3 and w2 shapes, 8 experts in Humming's layout: the dequantized product's bf16 within the
    summation-order bound, and almost all equal to Humming's own GEMM on the same bytes (both one fp32 sum and one
    rounding, in different orders: a sum near a rounding boundary may land one bf16 ulp apart)."""
    from mini.kernels import humming_experts as hx
    for N, K in ((4608, 5120), (5120, 2304)):
        codes, scales = _experts(len(counts), N, K, seed=N + sum(counts), device="cuda")
        a, offset = _rows(counts, K, seed=K, device="cuda")
        out = torch.full((a.shape[0], N), float("nan"), dtype=torch.bfloat16, device="cuda")
        humming_gemv(a, layout_codes(codes), layout_scales(scales), offset, touched=sum(c > 0 for c in counts),
                     out=out)
        _check(out.cpu(), a.cpu(), offset.cpu(), codes.cpu(), scales.cpu())
        if hx.available():
            stack = hx.convert(codes.clone(), scales.clone())
            ref = hx.grouped_gemm(a, stack, offset, sum(counts))
            n = int(offset[-1])
            assert ((out[:n].float() - ref[:n].float()).abs() <= ref[:n].float().abs() * 2.0 ** -6 + 1e-6).all()
            assert (out[:n] == ref[:n]).float().mean().item() > 0.99
