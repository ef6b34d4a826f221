"""The vision tower of V4.1 (spec §2.8, official `vision.py`): patches -> ViT -> aligner -> LLM-width rows.

    x = patch_embed(patches)                       # Linear over 3*p*p pixels, with bias
    for block: x = x + attn(norm1(x)); x = x + mlp(norm2(x))
    v = norm(x)                                    # [n_vit_h * n_vit_w, vision_dim]: ViT output
    y = w2(gelu(w1(unshuffle_3x3(v))))             # [n_llm_h * n_llm_w, dim]: aligner output, reading order

Attention is bidirectional over the patches of one image, with 2D RoPE: each head's dims are split in halves
(rotate-half pairs x_i, x_{i + hd/2}); of the hd/2 angles, the first hd/4 turn with the patch's row, the last hd/4
with its column, at frequencies theta^(-2j / (hd/2)). The MLP is SwiGLU (w1 = [gate; up]); norms are RMSNorm with
eps 1e-6 (the ViT's own, not the text model's). Linears are bf16 with bias (no FP8), as the checkpoint stores them.
The aligner pads the patch grid to multiples of 3 with zeros and folds each 3x3 cell channel-major
(F.unfold: c * 9 + row * 3 + col), then a GELU (erf) MLP.

Reference: one image at a time, the official ops (SDPA over [1, heads, n, hd]). Fast path (`use_fast`): the
images of a step in one pass: every Linear, norm and RoPE over all their patches at once, attention image by image
(an unmasked SDPA call each), the aligner over all cells at once; each residual add folded into the norm after it
and, on the fast backend, the elementwise steps as Triton kernels (mini/kernels/vision_{norm,rope,swiglu}.py). Its
attention and norms sum in another order than the reference's, so it agrees to bf16 rounding, not bitwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from mini.config import ModelConfig
from mini.ops import use_fast
from mini.ops.norm import rms_norm
from mini.ops.stages import staged

VIT_NORM_EPS = 1e-6


@dataclass
class ViTBlockWeights:
    norm1: torch.Tensor  # [C]
    wqkv: torch.Tensor  # [3C, C], bias [3C]: q, k, v stacked
    wqkv_bias: torch.Tensor
    wo: torch.Tensor  # [C, C], bias [C]
    wo_bias: torch.Tensor
    norm2: torch.Tensor  # [C]
    w1: torch.Tensor  # [2I, C]: gate rows, then up rows
    w2: torch.Tensor  # [C, I]


@dataclass
class VisionWeights:
    patch: torch.Tensor  # [C, 3*p*p], bias [C]
    patch_bias: torch.Tensor
    blocks: list[ViTBlockWeights]
    norm: torch.Tensor  # [C]
    aligner_w1: torch.Tensor  # [D, C*r*r], bias [D]
    aligner_b1: torch.Tensor
    aligner_w2: torch.Tensor  # [D, D], bias [D]
    aligner_b2: torch.Tensor
    n_heads: int
    ratio: int  # the aligner's downsample ratio
    rope_theta: float

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], cfg: ModelConfig, dtype=torch.bfloat16) -> "VisionWeights":
        """From checkpoint tensors `vision.*` and `aligner.*` (all bf16 in the release), in `dtype`."""
        def get(name):
            return state[name].to(dtype)

        blocks = [ViTBlockWeights(*(get(f"vision.blocks.{i}.{n}") for n in (
            "norm1.weight", "attn.wqkv.weight", "attn.wqkv.bias", "attn.wo.weight", "attn.wo.bias", "norm2.weight",
            "mlp.w1.weight", "mlp.w2.weight"))) for i in range(cfg.vision_n_layers)]
        return cls(get("vision.patch_embed.proj.weight"), get("vision.patch_embed.proj.bias"), blocks,
                   get("vision.norm.weight"), get("aligner.w1.weight"), get("aligner.w1.bias"),
                   get("aligner.w2.weight"), get("aligner.w2.bias"), cfg.vision_n_heads,
                   cfg.vision_downsample_ratio, cfg.vision_rope_theta)


@lru_cache(maxsize=16)
def _rope_table(n_h: int, n_w: int, half: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [n_h * n_w, 1, half] (CPU): angles (row * f, col * f) with f = theta^(-2j/half), j < half/2."""
    freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
    rows = torch.arange(n_h).unsqueeze(1).expand(n_h, n_w)
    cols = torch.arange(n_w).unsqueeze(0).expand(n_h, n_w)
    angles = (torch.stack([rows, cols], -1).reshape(-1, 2, 1).float() * freq).flatten(1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rope_table(n_h: int, n_w: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_table_on(n_h, n_w, head_dim // 2, theta, str(torch.device(device)))


@lru_cache(maxsize=16)
def _rope_table_on(n_h: int, n_w: int, half: int, theta: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`_rope_table` kept on `device` too: an image size seen again costs no host-to-device copy (2 MB at the
    largest image, a synchronous copy from pageable memory)."""
    cos, sin = _rope_table(n_h, n_w, half, theta)
    return cos.to(device), sin.to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 over [n, heads, hd]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------- a block's elementwise steps
# `fused`: one Triton pass each (the fast backend, mini/kernels/vision_*.py); else the reference's torch ops.
def add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, fused: bool):
    """(s, rms_norm(s)) with s = x + delta (x when delta is None): a residual add and the norm after it (kernel:
    mini/kernels/vision_norm.py; the sum's bits, the norm to rounding)."""
    if fused:
        from mini.kernels.vision_norm import add_rms_norm
        return add_rms_norm(x, delta, weight, VIT_NORM_EPS)
    s = x if delta is None else x + delta
    return s, rms_norm(s, weight, VIT_NORM_EPS)


def split_rope(qkv: torch.Tensor, n_heads: int, cos, sin, fused: bool):
    """The qkv GEMM's output [n, 3C] -> q, k, v [n, heads, hd], q and k rotated (`rotate`; kernel:
    mini/kernels/vision_rope.py, the same bits)."""
    if fused:
        from mini.kernels.vision_rope import split_rope as kernel
        return kernel(qkv, cos.flatten(1), sin.flatten(1), n_heads).unbind(0)
    q, k, v = (t.unflatten(-1, (n_heads, -1)) for t in qkv.chunk(3, dim=-1))
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def swiglu(gu: torch.Tensor, fused: bool) -> torch.Tensor:
    """The MLP's SwiGLU: silu(gate) * up of the w1 GEMM's output [n, 2I] (gate columns, then up; kernel:
    mini/kernels/vision_swiglu.py, to rounding)."""
    if fused:
        from mini.kernels.vision_swiglu import swiglu as kernel
        return kernel(gu)
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------- reference: one image
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention of one image, q, k, v [n, heads, hd] -> [n, heads, hd]: scores, softmax and the
    value sum in fp32, rounded once (the bits of the official SDPA call as the fixtures' CPU run computed it)."""
    dtype = v.dtype
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    p = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
    return (p @ v).transpose(0, 1).to(dtype)


def vit_one(patches: torch.Tensor, n_h: int, n_w: int, w: VisionWeights) -> torch.Tensor:
    """ViT output [n_h * n_w, C] of one image's patches [n_h * n_w, 3, p, p]."""
    if patches.shape[0] != n_h * n_w:
        raise ValueError(f"{patches.shape[0]} patches for a {n_h}x{n_w} grid")
    x = F.linear(patches.flatten(1).to(w.patch.dtype), w.patch, w.patch_bias)
    cos, sin = rope_table(n_h, n_w, x.shape[-1] // w.n_heads, w.rope_theta, x.device)
    for b in w.blocks:
        qkv = F.linear(rms_norm(x, b.norm1, VIT_NORM_EPS), b.wqkv, b.wqkv_bias)
        x = x + F.linear(attend(*split_rope(qkv, w.n_heads, cos, sin, fused=False)).flatten(1), b.wo, b.wo_bias)
        x = x + F.linear(swiglu(F.linear(rms_norm(x, b.norm2, VIT_NORM_EPS), b.w1), fused=False), b.w2)
    return rms_norm(x, w.norm, VIT_NORM_EPS)


def unshuffle(v: torch.Tensor, n_h: int, n_w: int, ratio: int) -> torch.Tensor:
    """[n_h * n_w, C] -> [ceil(n_h/r) * ceil(n_w/r), C * r * r]: the grid zero-padded to multiples of r, each r x r
    cell flattened channel-major (F.unfold's order), cells in reading order."""
    grid = F.pad(v.view(n_h, n_w, -1).permute(2, 0, 1), (0, -n_w % ratio, 0, -n_h % ratio))
    return F.unfold(grid.unsqueeze(0), ratio, stride=ratio).squeeze(0).transpose(0, 1)


def align(cells: torch.Tensor, w: VisionWeights) -> torch.Tensor:
    """The aligner's MLP over unshuffled cells [n, C*r*r] -> [n, D]."""
    return F.linear(F.gelu(F.linear(cells, w.aligner_w1, w.aligner_b1)), w.aligner_w2, w.aligner_b2)


# ----------------------------------------------------------------------------------- fast: the images of a step
def vit_batched(patches: list[torch.Tensor], grids: list[tuple[int, int]], w: VisionWeights) -> list[torch.Tensor]:
    """vit_one over several images in one pass: the GEMMs, norms and RoPE over all their rows at once, attention
    image by image on its own rows. Unmasked SDPA calls, not one padded call with a key mask: a mask rules out
    the flash kernel on CUDA, and at the largest image (8,649 patches) attention is over half the encoder's FLOPs
    (H200, tools/vision_speed.py: 99 ms masked, docs/perf/013). Each residual add is folded into the norm after
    it (the last one into the final norm); on the fast backend the elementwise steps are Triton kernels (the add
    and norm, the qkv split with its RoPE, SwiGLU: ~22 of the 60 ms at the largest image were torch's
    elementwise kernels, docs/perf/013), elsewhere the reference's own ops."""
    lens = [h * wd for h, wd in grids]
    x = F.linear(torch.cat([p.flatten(1) for p in patches]).to(w.patch.dtype), w.patch, w.patch_bias)
    hd, device, fused = x.shape[-1] // w.n_heads, x.device, use_fast(x)
    tables = [rope_table(h, wd, hd, w.rope_theta, device) for h, wd in grids]
    cos, sin = torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])

    def per_image(q, k, v):  # [rows, heads, hd] each -> [rows, heads * hd]
        heads_first = [t.split(lens) for t in (q, k, v)]
        # [1, heads, rows, hd]: the fused kernels take 4-dimensional inputs only
        outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in qkv))[0].transpose(0, 1)
                for qkv in zip(*heads_first)]
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(x.shape)

    delta = None  # the last block's MLP output, added to the stream by the next norm
    for b in w.blocks:
        x, h = add_norm(x, delta, b.norm1, fused)
        q, k, v = split_rope(F.linear(h, b.wqkv, b.wqkv_bias), w.n_heads, cos, sin, fused)
        x, h = add_norm(x, F.linear(per_image(q, k, v), b.wo, b.wo_bias), b.norm2, fused)
        delta = F.linear(swiglu(F.linear(h, b.w1), fused), b.w2)
    return list(add_norm(x, delta, w.norm, fused)[1].split(lens))


@staged("vision")
def encode_images(patches: list[torch.Tensor], grids: list[tuple[int, int]], w: VisionWeights,
                  batched: bool | None = None) -> list[torch.Tensor]:
    """Aligner rows [n_llm_h * n_llm_w, D] of each image (patches [n_vit_h * n_vit_w, 3, p, p], grids (n_vit_h,
    n_vit_w)). `batched` None: the fast path where `use_fast`, else one image at a time (the reference)."""
    if not patches:
        return []
    if batched is None:
        batched = use_fast(patches[0])
    vit = vit_batched(patches, grids, w) if batched else [vit_one(p, h, wd, w) for p, (h, wd) in zip(patches, grids)]
    cells = [unshuffle(v, h, wd, w.ratio) for v, (h, wd) in zip(vit, grids)]
    if batched:
        return list(align(torch.cat(cells), w).split([c.shape[0] for c in cells]))
    return [align(c, w) for c in cells]
