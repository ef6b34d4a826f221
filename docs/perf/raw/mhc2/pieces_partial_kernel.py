"""The `pieces` family of ab.py as measured: mini/kernels/mhc_norm.py's split-K pass at that time (the previous
loop over hc copies with three chained MMAs per copy, fn's pieces loaded instead of split in registers, the
delayed pre loaded once). Kept for the record only; to re-run it, put this kernel in place of the package's."""
import triton
import triton.language as tl

from mini.kernels.mhc_norm import _dot_pieces


@triton.jit
def _mhc_partial_kernel(
    h_ptr, fn_ptr, pieces_ptr, pre_in_ptr, part_ptr, y_ptr, T,
    D: tl.constexpr, HC: tl.constexpr, NM: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, COLLAPSE: tl.constexpr, SPLIT_BF16: tl.constexpr, OP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    s = tl.program_id(1)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    K: tl.constexpr = HC * D
    row0 = toks.to(tl.int64)[:, None] * K  # start of each token's [hc, D] block
    kk = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 32)  # fn rows 0..NM-1 (pre, post, comb); rows NM.. read as 0
    col_ok = cols < NM
    copies = tl.arange(0, HC)
    # the delayed pre of every copy, loaded once: loads inside the loop would each wait on a round trip
    pre_w = tl.load(pre_in_ptr + toks[:, None] * HC + copies[None, :], mask=tok_ok[:, None], other=0.0)

    sumsq = tl.zeros([BLOCK_T], tl.float32)
    ysq = tl.zeros([BLOCK_T], tl.float32)
    m = tl.zeros([BLOCK_T, 32], tl.float32)
    for d0 in range(0, CHUNK, BLOCK_K):
        d = s * CHUNK + d0 + kk
        d_ok = d < D
        ok = tok_ok[:, None] & d_ok[None, :]
        y = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for c in tl.static_range(HC):
            x = tl.load(h_ptr + row0 + c * D + d[None, :], mask=ok, other=0.0)
            xf = x.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
            if SPLIT_BF16:  # fn's bf16 pieces [3, K, 32] (fn_pieces), loaded straight into the MMAs
                p = pieces_ptr + (c * D + d)[:, None] * 32 + cols[None, :]
                hi = tl.load(p, mask=d_ok[:, None], other=0.0)
                mid = tl.load(p + K * 32, mask=d_ok[:, None], other=0.0)
                lo = tl.load(p + 2 * K * 32, mask=d_ok[:, None], other=0.0)
                m = _dot_pieces(x, hi, mid, lo, m, OP)
            else:
                f = tl.load(fn_ptr + cols[None, :] * K + c * D + d[:, None],
                            mask=d_ok[:, None] & col_ok[None, :], other=0.0)
                m = tl.dot(xf, f, m, input_precision=PRECISION)
            if COLLAPSE:
                w = tl.sum(tl.where(copies[None, :] == c, pre_w, 0.0), axis=1)  # column c of pre_w, exactly
                y += w[:, None] * xf
        if COLLAPSE:
            y = y.to(y_ptr.dtype.element_ty)
            yf = y.to(tl.float32)
            ysq += tl.sum(yf * yf, axis=1)
            tl.store(y_ptr + toks.to(tl.int64)[:, None] * D + d[None, :], y, mask=ok)
    m = tl.where((cols == NM)[None, :], sumsq[:, None], tl.where((cols == NM + 1)[None, :], ysq[:, None], m))
    tl.store(part_ptr + (s * T + toks.to(tl.int64))[:, None] * 32 + cols[None, :], m, mask=tok_ok[:, None])
