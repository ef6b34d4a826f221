"""Manifold-constrained hyper-connections (spec §2.2): the residual stream is `hc` copies `[T, hc, D]`.

`mixes` turns one site's stream into the pre weights (collapse), post weights (expand) and a doubly stochastic
`comb` [T, hc, hc] (Sinkhorn), all in fp32. `collapse` folds the copies into one sub-layer input; `expand` writes
the sub-layer output back into every copy while mixing the residual copies through `comb`. `pre_norm` is a site's
whole input step (mixes, collapse, the block's RMSNorm; one fused kernel on the fast path). V4 ends with
`hc_head` (a sigmoid-only pre mix); V4.1 has no head and collapses with the last FFN site's `pre`.
"""
import torch

from mini.ops import deterministic, use_fast
from mini.ops.norm import rms_norm
from mini.ops.stages import staged


def _projected(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """(flatten(h) @ fn^T) * rsqrt(mean(flatten(h)^2) + eps): ONE statistic over all hc*D values per token."""
    x = h.flatten(-2).float()
    inv_rms = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return (x @ fn.float().T) * inv_rms


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] logits -> doubly stochastic matrix, in the reference kernel's order: row softmax + eps, column
    normalise, then (iters - 1) x (rows, columns). Each normalisation divides by (sum + eps)."""
    c = torch.exp(logits - logits.amax(-1, keepdim=True))  # the kernel's softmax, spelled out: same rounding
    c = c / c.sum(-1, keepdim=True) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, hc_mult: int, iters: int,
          hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, hc, D], fn [(2+hc)*hc, hc*D], scale [3], base [(2+hc)*hc] -> pre [T, hc], post [T, hc],
    comb [T, hc, hc] (comb[t, j, k]: weight of residual copy j in output copy k), all fp32."""
    if use_fast(h) and h.dtype == torch.bfloat16 and hc_mult == 4:
        from mini.kernels.mhc_norm import mhc_norm
        _, pre, post, comb = mhc_norm(h, fn, scale, base, None, pre_in=None, iters=iters, hc_eps=hc_eps,
                                      norm_eps=norm_eps, collapse=False, invariant=deterministic())
        return pre, post, comb
    n = hc_mult
    m = _projected(h, fn, norm_eps)
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = (m[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))  # row-major: entry 2n + n*j + k
    return pre, post, sinkhorn(comb, iters, hc_eps)


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_c pre[t, c] * h[t, c] in fp32 -> [T, D] in h.dtype."""
    return (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)


@staged("hc_norm_other.mhc")
def expand(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[t, k] = post[t, k] * f[t] + sum_j comb[t, j, k] * residual[t, j], fp32 math, result in f.dtype."""
    if use_fast(f, residual) and f.dtype == residual.dtype == torch.bfloat16:
        from mini.kernels.mhc_expand import mhc_expand, supported
        if supported(residual.shape[1]):
            return mhc_expand(f, residual, post, comb)  # same order, no FMA contraction: bit-identical
    comb, res = comb.float(), residual.float()
    mixed = comb[:, 0, :, None] * res[:, 0, None, :]
    for j in range(1, res.shape[1]):  # sequential over j, as the reference's sum: bit-identical results
        mixed = mixed + comb[:, j, :, None] * res[:, j, None, :]
    return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(f.dtype)


@staged("hc_norm_other.mhc")
def pre_norm(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
             pre_in: torch.Tensor | None, *, hc_mult: int, iters: int, hc_eps: float,
             norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A site's input: its mixes, then rms_norm(collapse(h, pre_in)) with the delayed pre of the previous site
    (V4.1), or with this site's own pre when pre_in is None (V4). Returns (x [T, D] in h.dtype, pre, post, comb)."""
    if use_fast(h) and h.dtype == torch.bfloat16 and hc_mult == 4:
        from mini.kernels.mhc_norm import mhc_norm
        return mhc_norm(h, fn, scale, base, norm_weight, pre_in=pre_in, iters=iters, hc_eps=hc_eps,
                        norm_eps=norm_eps, invariant=deterministic())  # the deterministic mode: tiles not by T
    pre, post, comb = mixes(h, fn, scale, base, hc_mult=hc_mult, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    return rms_norm(collapse(h, pre if pre_in is None else pre_in), norm_weight, norm_eps), pre, post, comb


def hc_head(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """V4's final collapse: pre = sigmoid(m * scale + base) + eps with m = normalised h @ fn^T ([hc, hc*D]),
    no Sinkhorn; returns [T, D] in h.dtype."""
    pre = torch.sigmoid(_projected(h, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return collapse(h, pre)
