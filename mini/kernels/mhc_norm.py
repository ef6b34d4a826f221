"""mHC site input, fused: mixes (one rsqrt over hc·D, the 24-wide projection, sigmoids, 20 Sinkhorn iterations on
the 4×4 comb in registers), the collapse of the hc copies and the weighted RMSNorm of the collapsed row, with an
optional FP8 1×block fake quant of the normed output. `mini.ops.mhc.pre_norm` calls it at every mHC site. Also a plain RMSNorm kernel with the same optional quant
(`rms_norm`, not dispatched yet: its GPU parity test has not run).

Same functions as mini/ops/mhc.py (`mixes`, `collapse`) and mini/ops/norm.py (`rms_norm`):
* the projection is an fp32 dot, by default as 3xTF32 on the tensor cores (fp32-level error, unlike plain tf32:
  m feeds sigmoids and a softmax); precision="ieee" gives the FMA dot;
* the collapse sums the copies in order c = 0..hc-1 in fp32 and rounds to the stream dtype before the norm;
* V4.1 collapses with the previous site's `pre` (delayed, known before this site's mixes); V4 passes none and
  the kernel collapses with the `pre` it just computed.
A program handles BLOCK_T tokens: pass 1 streams h once for the statistic and the projection; pass 2 re-reads h
(mostly from L2), writes the collapsed row and its sum of squares; pass 3 normalises the row in place.
"""
import torch
import triton
import triton.language as tl

from mini.formats import quant as _fq
from mini.kernels.quant import fake_quant_tile, kind_code


@triton.jit
def _mhc_norm_kernel(
    h_ptr, fn_ptr, scale_ptr, base_ptr, norm_w_ptr, pre_in_ptr,
    pre_ptr, post_ptr, comb_ptr, y_ptr,
    T, norm_eps, hc_eps,
    D: tl.constexpr, HC: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DELAYED: tl.constexpr, COLLAPSE: tl.constexpr, QUANT: tl.constexpr, QBLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    NC: tl.constexpr = HC * HC  # comb entries
    NP: tl.constexpr = 2 * HC  # pre + post entries, padded to 16 columns for the dot
    t0 = tl.program_id(0) * BLOCK_T
    toks = t0 + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    K: tl.constexpr = HC * D
    kk = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 16)
    # fn rows: comb entries NP..NP+15 in one tile, pre/post rows 0..NP-1 in another (padding rows read as 0)
    comb_rows = NP + cols
    pp_rows = cols
    pp_ok = cols < NP

    sumsq = tl.zeros([BLOCK_T], tl.float32)
    m_comb = tl.zeros([BLOCK_T, 16], tl.float32)
    m_pp = tl.zeros([BLOCK_T, 16], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        x = tl.load(h_ptr + toks[:, None].to(tl.int64) * K + k[None, :], mask=tok_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        f_c = tl.load(fn_ptr + comb_rows[None, :] * K + k[:, None], mask=k_ok[:, None], other=0.0)
        f_p = tl.load(fn_ptr + pp_rows[None, :] * K + k[:, None], mask=k_ok[:, None] & pp_ok[None, :], other=0.0)
        m_comb = tl.dot(x, f_c, m_comb, input_precision=PRECISION)
        m_pp = tl.dot(x, f_p, m_pp, input_precision=PRECISION)
    inv_rms = 1.0 / tl.sqrt(sumsq / K + norm_eps)
    m_comb = m_comb * inv_rms[:, None]
    m_pp = m_pp * inv_rms[:, None]

    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    # pre (cols 0..HC-1) and post (cols HC..2HC-1)
    z = m_pp * tl.where(cols < HC, s0, s1)[None, :] + tl.load(base_ptr + cols, mask=pp_ok, other=0.0)[None, :]
    sig = 1.0 / (1.0 + tl.exp(-z))
    pp = tl.where((cols < HC)[None, :], sig + hc_eps, 2.0 * sig)
    c_idx = tl.where(cols < HC, cols, cols - HC)
    tl.store(pre_ptr + toks[:, None] * HC + c_idx[None, :], pp, mask=tok_ok[:, None] & (cols < HC)[None, :])
    tl.store(post_ptr + toks[:, None] * HC + c_idx[None, :], pp,
             mask=tok_ok[:, None] & ((cols >= HC) & pp_ok)[None, :])

    # comb: row softmax + eps, column normalise, then (ITERS - 1) x (rows, columns)
    c = m_comb * s2 + tl.load(base_ptr + NP + cols)[None, :]
    c = tl.reshape(c, [BLOCK_T, HC, HC])
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = c / tl.sum(c, axis=2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + toks[:, None] * NC + cols[None, :], tl.reshape(c, [BLOCK_T, NC]), mask=tok_ok[:, None])

    if COLLAPSE:
        if DELAYED:
            pre_src = pre_in_ptr
        else:
            pre_src = pre_ptr
            tl.debug_barrier()  # this program's `pre` stores above must land before they are read back
        dd = tl.arange(0, BLOCK_D)
        ysq = tl.zeros([BLOCK_T], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + dd
            ok = tok_ok[:, None] & (d < D)[None, :]
            y = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
            for ci in tl.static_range(HC):
                w = tl.load(pre_src + toks * HC + ci, mask=tok_ok, other=0.0)
                hv = tl.load(h_ptr + toks[:, None].to(tl.int64) * K + ci * D + d[None, :], mask=ok, other=0.0)
                y += w[:, None] * hv.to(tl.float32)
            y = y.to(y_ptr.dtype.element_ty)
            yf = y.to(tl.float32)
            ysq += tl.sum(yf * yf, axis=1)
            tl.store(y_ptr + toks[:, None] * D + d[None, :], y, mask=ok)
        tl.debug_barrier()  # pass 3 reads rows other threads of this program wrote
        inv = 1.0 / tl.sqrt(ysq / D + norm_eps)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + dd
            ok = tok_ok[:, None] & (d < D)[None, :]
            yf = tl.load(y_ptr + toks[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
            wn = tl.load(norm_w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            out = fake_quant_tile(wn[None, :] * (yf * inv[:, None]), BLOCK_T, BLOCK_D, QBLOCK, QUANT)
            tl.store(y_ptr + toks[:, None] * D + d[None, :], out.to(y_ptr.dtype.element_ty), mask=ok)


def mhc_norm(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             norm_weight: torch.Tensor | None, *, pre_in: torch.Tensor | None, iters: int, hc_eps: float,
             norm_eps: float, quant: str | None = None, quant_block: int = 32, collapse: bool = True,
             block_t: int = 32, block_k: int = 128, block_d: int = 256, num_warps: int = 4,
             precision: str = "tf32x3"):
    """h [T, hc, D] -> (y [T, D] = rms_norm(collapse(h, pre_in or pre)) in h.dtype (None when collapse=False),
    pre [T, hc], post [T, hc], comb [T, hc, hc] fp32). quant='fp8' fake-quantizes y in 1×quant_block blocks."""
    T, HC, D = h.shape
    assert HC * HC == 16, "the kernel's comb tile is 4x4"
    assert fn.shape == ((2 + HC) * HC, HC * D)
    h = h.contiguous()
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    dev = h.device
    pre = torch.empty(T, HC, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(T, HC, HC, dtype=torch.float32, device=dev)
    y = torch.empty(T, D, dtype=h.dtype, device=dev) if collapse else None
    if not _fq._enabled:
        quant = None
    if quant is not None:
        assert D % quant_block == 0 and block_d % quant_block == 0
    if T:
        pre_in_t = pre_in.float().contiguous() if pre_in is not None else pre
        _mhc_norm_kernel[(triton.cdiv(T, block_t),)](
            h, fn, scale, base, norm_weight if collapse else h, pre_in_t, pre, post, comb, y if collapse else h,
            T, norm_eps, hc_eps,
            D=D, HC=HC, ITERS=iters, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_D=block_d, DELAYED=pre_in is not None,
            COLLAPSE=collapse, QUANT=kind_code(quant), QBLOCK=quant_block, PRECISION=precision,
            num_warps=num_warps)
    return y, pre, post, comb


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                     QUANT: tl.constexpr, QBLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    ok = (rows < R)[:, None] & (d < D)[None, :]
    ptrs = rows.to(tl.int64)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + ptrs, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = (w[None, :] * (x * inv[:, None])).to(out_ptr.dtype.element_ty)
    if QUANT != 0:  # the reference quantizes the rounded norm output
        y = fake_quant_tile(y.to(tl.float32), BLOCK_R, BLOCK_D, QBLOCK, QUANT).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ptrs, y, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: str | None = None, quant_block: int = 32,
             num_warps: int = 4) -> torch.Tensor:
    """mini.ops.norm.rms_norm over the last dim (fp32 statistics, result in x.dtype), optionally followed by the
    FP8 1×quant_block fake quant of its consumer GEMM (quant='fp8'). One row tile per program, in registers."""
    D = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    R = x.numel() // D
    if not _fq._enabled:
        quant = None
    if quant is not None:
        assert D % quant_block == 0
    if R:
        block_d = triton.next_power_of_2(D)
        block_r = max(1, min(16, 4096 // block_d))
        _rms_norm_kernel[(triton.cdiv(R, block_r),)](x, weight, out, R, eps, D=D, BLOCK_D=block_d, BLOCK_R=block_r,
                                                     QUANT=kind_code(quant), QBLOCK=quant_block,
                                                     num_warps=num_warps)
    return out
