"""Sweep-only variant (not in the package): the split-K pass with fn's three bf16 pieces side by side along N
([K, 128]: hi in cols 0..31, mid 32..63, lo 64..95, zero 96..127), so one MMA per h tile instead of three chained
ones; the three per-piece sums are added at the end. Same finishing pass as mini.kernels.mhc_norm."""
import weakref

import torch
import triton
import triton.language as tl

from mini.formats import quant as _fq
from mini.kernels.mhc_norm import PART_COLS, _INTERPRET, _mhc_finish_kernel
from mini.kernels.quant import kind_code


@triton.jit
def _partial_nstack_kernel(
    h_ptr, pieces_ptr, pre_in_ptr, part_ptr, y_ptr, T,
    D: tl.constexpr, HC: tl.constexpr, NM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, COLLAPSE: tl.constexpr, OP: tl.constexpr,
):
    s = tl.program_id(1)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    K: tl.constexpr = HC * D
    row0 = toks.to(tl.int64)[:, None] * K
    kk = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 32)
    pc = tl.arange(0, 128)
    copies = tl.arange(0, HC)
    pre_w = tl.load(pre_in_ptr + toks[:, None] * HC + copies[None, :], mask=tok_ok[:, None], other=0.0)
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    ysq = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, 128], tl.float32)
    for d0 in range(0, CHUNK, BLOCK_K):
        d = s * CHUNK + d0 + kk
        d_ok = d < D
        ok = tok_ok[:, None] & d_ok[None, :]
        y = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for c in tl.static_range(HC):
            x = tl.load(h_ptr + row0 + c * D + d[None, :], mask=ok, other=0.0)
            xf = x.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
            p = tl.load(pieces_ptr + (c * D + d)[:, None] * 128 + pc[None, :], mask=d_ok[:, None], other=0.0)
            acc = tl.dot(x.to(OP), p.to(OP), acc)
            if COLLAPSE:
                w = tl.sum(tl.where(copies[None, :] == c, pre_w, 0.0), axis=1)
                y += w[:, None] * xf
        if COLLAPSE:
            y = y.to(y_ptr.dtype.element_ty)
            yf = y.to(tl.float32)
            ysq += tl.sum(yf * yf, axis=1)
            tl.store(y_ptr + toks.to(tl.int64)[:, None] * D + d[None, :], y, mask=ok)
    m = tl.sum(tl.reshape(acc, [BLOCK_T, 4, 32]), axis=1)
    m = tl.where((cols == NM)[None, :], sumsq[:, None], tl.where((cols == NM + 1)[None, :], ysq[:, None], m))
    tl.store(part_ptr + (s * T + toks.to(tl.int64))[:, None] * 32 + cols[None, :], m, mask=tok_ok[:, None])


@triton.jit
def _partial_nstack_kcat_kernel(
    h_ptr, pieces_ptr, pre_in_ptr, part_ptr, y_ptr, T,
    D: tl.constexpr, HC: tl.constexpr, NM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, COLLAPSE: tl.constexpr, OP: tl.constexpr,
):
    """The copies of a D step along K as well: one [block_t, hc*block_k] x [hc*block_k, 128] MMA per step."""
    s = tl.program_id(1)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    K: tl.constexpr = HC * D
    row0 = toks.to(tl.int64)[:, None] * K
    j = tl.arange(0, HC * BLOCK_K)
    jc = j // BLOCK_K
    jd = j % BLOCK_K
    kk = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 32)
    pc = tl.arange(0, 128)
    copies = tl.arange(0, HC)
    pre_w = tl.load(pre_in_ptr + toks[:, None] * HC + copies[None, :], mask=tok_ok[:, None], other=0.0)
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    ysq = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, 128], tl.float32)
    for d0 in range(0, CHUNK, BLOCK_K):
        d = s * CHUNK + d0 + jd
        d_ok = d < D
        x = tl.load(h_ptr + row0 + (jc * D + d)[None, :], mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
        p = tl.load(pieces_ptr + (jc * D + d)[:, None] * 128 + pc[None, :], mask=d_ok[:, None], other=0.0)
        acc = tl.dot(x.to(OP), p.to(OP), acc)
        if COLLAPSE:
            y = tl.sum(tl.reshape(xf, [BLOCK_T, HC, BLOCK_K]) * pre_w[:, :, None], axis=1)
            y = y.to(y_ptr.dtype.element_ty)
            yf = y.to(tl.float32)
            ysq += tl.sum(yf * yf, axis=1)
            dy = s * CHUNK + d0 + kk
            tl.store(y_ptr + toks.to(tl.int64)[:, None] * D + dy[None, :], y, mask=tok_ok[:, None] & (dy < D)[None, :])
    m = tl.sum(tl.reshape(acc, [BLOCK_T, 4, 32]), axis=1)
    m = tl.where((cols == NM)[None, :], sumsq[:, None], tl.where((cols == NM + 1)[None, :], ysq[:, None], m))
    tl.store(part_ptr + (s * T + toks.to(tl.int64))[:, None] * 32 + cols[None, :], m, mask=tok_ok[:, None])


def pieces_nstack(fn):
    f = fn.float()
    hi = f.bfloat16()
    rest = f - hi.float()
    mid = rest.bfloat16()
    lo = (rest - mid.float()).bfloat16()
    out = torch.zeros(f.shape[1], 128, dtype=torch.bfloat16, device=f.device)
    for i, p in enumerate((hi, mid, lo)):
        out[:, 32 * i:32 * i + f.shape[0]] = p.T
    return out


_CACHE = {}


def mhc_norm(h, fn, scale, base, norm_weight, *, pre_in, iters, hc_eps, norm_eps, quant=None, quant_block=32,
             collapse=True, block_t=64, block_k=32, split=10, num_warps=4, num_stages=2, finish_block_t=8,
             block_d=512, finish_warps=4, kcat=False):
    T, HC, D = h.shape
    NM = (2 + HC) * HC
    assert h.dtype == torch.bfloat16
    hit = _CACHE.get(id(fn))
    if hit is None or hit[0]() is not fn:
        hit = _CACHE[id(fn)] = (weakref.ref(fn), pieces_nstack(fn))
    pieces = hit[1]
    h = h.contiguous()
    scale, base = scale.float().contiguous(), base.float().contiguous()
    dev = h.device
    pre = torch.empty(T, HC, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(T, HC, HC, dtype=torch.float32, device=dev)
    y = torch.empty(T, D, dtype=h.dtype, device=dev) if collapse else None
    if not _fq._enabled:
        quant = None
    chunk = triton.cdiv(triton.cdiv(D, block_k), split) * block_k
    nsplit = triton.cdiv(D, chunk)
    part = torch.empty(nsplit, T, PART_COLS, dtype=torch.float32, device=dev)
    delayed = pre_in is not None
    pre_in_t = pre_in.float().contiguous() if delayed else pre
    (_partial_nstack_kcat_kernel if kcat else _partial_nstack_kernel)[(triton.cdiv(T, block_t), nsplit)](
        h, pieces, pre_in_t, part, y if collapse else h, T, D=D, HC=HC, NM=NM, CHUNK=chunk, BLOCK_T=block_t,
        BLOCK_K=block_k, COLLAPSE=collapse and delayed, OP=tl.float32 if _INTERPRET else tl.bfloat16,
        num_warps=num_warps, num_stages=num_stages)
    _mhc_finish_kernel[(triton.cdiv(T, finish_block_t),)](
        h, part, scale, base, norm_weight if collapse else h, pre_in_t, pre, post, comb, y if collapse else h,
        T, norm_eps, hc_eps, D=D, HC=HC, ITERS=iters, NSPLIT=nsplit, BLOCK_T=finish_block_t, BLOCK_D=block_d,
        DELAYED=delayed, COLLAPSE=collapse, QUANT=kind_code(quant), QBLOCK=quant_block, num_warps=finish_warps)
    return y, pre, post, comb
