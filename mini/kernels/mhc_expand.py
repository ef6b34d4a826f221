"""mHC site output (hc_post), fused: out[t, k] = post[t, k] * f[t] + sum_j comb[t, j, k] * residual[t, j].

Same function as mini/ops/mhc.py `expand`, in the same fp32 order: the residual copies are summed j = 0..hc-1
starting from comb[0, k] * residual[0], then post * f is added, one rounding to the output dtype at the end. The
kernel is compiled without FMA contraction (enable_fp_fusion=False), so every product and sum is rounded on its
own as in the eager reference: the results are bit-identical to it.

A program handles BLOCK_T tokens x BLOCK_D columns of all hc output copies: f and the hc residual rows are read
once, the [BLOCK_T, hc, BLOCK_D] output is written once (memory-bound: 2 + 4·hc bytes in, 2·hc out per element).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _mhc_expand_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, T,
                       D: tl.constexpr, HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    kk = tl.arange(0, HC)
    tok_ok = toks < T
    ok = tok_ok[:, None] & (d < D)[None, :]
    row = toks.to(tl.int64)[:, None] * (HC * D)  # start of each token's [hc, D] block
    mixed = tl.zeros([BLOCK_T, HC, BLOCK_D], tl.float32)
    for j in tl.static_range(HC):
        r = tl.load(res_ptr + row + j * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        c = tl.load(comb_ptr + toks[:, None] * (HC * HC) + j * HC + kk[None, :], mask=tok_ok[:, None], other=0.0)
        term = c[:, :, None] * r[:, None, :]  # comb[t, j, k] * residual[t, j]
        if j == 0:
            mixed = term
        else:
            mixed = mixed + term
    f = tl.load(f_ptr + toks.to(tl.int64)[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + toks[:, None] * HC + kk[None, :], mask=tok_ok[:, None], other=0.0)
    out = post[:, :, None] * f[:, None, :] + mixed
    tl.store(out_ptr + row[:, :, None] + kk[None, :, None] * D + d[None, None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok[:, None, :])


def supported(hc: int) -> bool:
    """hc is a tile dimension: a power of two (others run mini.ops.mhc.expand's reference)."""
    return hc & (hc - 1) == 0


def mhc_expand(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
               block_t: int = 2, block_d: int = 512, num_warps: int = 4) -> torch.Tensor:
    """f [T, D], residual [T, hc, D] (same dtype), post [T, hc], comb [T, hc, hc] fp32 -> [T, hc, D] in f.dtype."""
    T, HC, D = residual.shape
    assert f.shape == (T, D) and post.shape == (T, HC) and comb.shape == (T, HC, HC)
    if not supported(HC):
        raise ValueError(f"mhc_expand kernel: hc {HC} is not a power of two")
    f, residual = f.contiguous(), residual.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty(T, HC, D, dtype=f.dtype, device=f.device)
    if T:
        _mhc_expand_kernel[(triton.cdiv(T, block_t), triton.cdiv(D, block_d))](
            f, residual, post, comb, out, T, D=D, HC=HC, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps,
            enable_fp_fusion=False)  # separate mul and add roundings, as the eager reference
    return out
