"""Engram's gate and update in one pass: mini.ops.engram.gated_update's fast path, where the torch ops are ~20
elementwise and reduction kernels per Engram layer (a few microseconds each at decode; issue 28).

For token t and copy c, from h [T, hc, D] and wkv's output kv [T, (hc + 1) * D] (hc keys, then the value):
    inv  = rsqrt(sum(h_c²) · (1/D) + eps) · rsqrt(sum(key_c²) · (1/D) + eps)
    dot  = sum((h_c · w_c) · key_c) · inv · D^-0.5
    gate = sigmoid(copysign(sqrt(max(|dot|, floor)), dot)), 0 where token_mask is False (floor: engram.GATE_FLOOR)
    out  = h_c + gate · value, rounded once to h's dtype
in fp32 and the reference's order, but for the three sums (each a tree over its D chunks: a statistic may move by an
fp32 ulp from torch's) and the sigmoid's exp (the GPU's fast exp2 where torch uses expf); the update is built
without FMA contraction (enable_fp_fusion=False), a product and a sum rounded each as in the eager reference, so an
output moves only where the gate did, by one step of its dtype, rarely. One program per (token, copy): two passes
over D in BLOCK_D chunks (the sums, then the update; the second reads h, key and value again, from cache at
decode). Rows are independent and the tiles follow D only: batch-invariant.
"""
import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _engram_gate_kernel(h_ptr, kv_ptr, w_ptr, mask_ptr, out_ptr, eps, scale, floor,
                        HC: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    dd = tl.arange(0, BLOCK_D)
    h_row = h_ptr + (t * HC + c) * D
    k_row = kv_ptr + t * ((HC + 1) * D) + c * D
    v_row = kv_ptr + t * ((HC + 1) * D) + HC * D
    hh = tl.zeros([BLOCK_D], tl.float32)
    kk = tl.zeros([BLOCK_D], tl.float32)
    hk = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        ok = d < D
        hv = tl.load(h_row + d, mask=ok, other=0.0).to(tl.float32)
        kv = tl.load(k_row + d, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c * D + d, mask=ok, other=0.0)
        hh += hv * hv
        kk += kv * kv
        hk += (hv * w) * kv
    inv = tl.math.rsqrt(tl.sum(hh) * (1.0 / D) + eps) * tl.math.rsqrt(tl.sum(kk) * (1.0 / D) + eps)
    dot = tl.sum(hk) * inv * scale
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), floor))
    signed = tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root)  # copysign: -0.0 counts as negative
    gate = 1.0 / (1.0 + tl.exp(-signed))
    if HAS_MASK:
        gate = tl.where(tl.load(mask_ptr + t) != 0, gate, 0.0)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        ok = d < D
        hv = tl.load(h_row + d, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_row + d, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + (t * HC + c) * D + d, (hv + gate * v).to(out_ptr.dtype.element_ty), mask=ok)


def supported(h: torch.Tensor, kv: torch.Tensor, gate_weight: torch.Tensor,
              token_mask: torch.Tensor | None = None) -> bool:
    """Whether the kernel takes these tensors (else the op runs its torch code): h [T, hc, D] and kv
    [T, (hc + 1) * D] of float dtypes, an fp32 gate weight [hc, D], a bool token mask [T] or none, one device."""
    if h.dim() != 3 or h.dtype not in DTYPES or kv.dtype not in DTYPES or gate_weight.dtype != torch.float32:
        return False
    T, hc, D = h.shape
    mask_ok = token_mask is None or (token_mask.dtype == torch.bool and token_mask.shape == (T,)
                                     and token_mask.device == h.device)
    return (D > 0 and kv.shape == (T, (hc + 1) * D) and gate_weight.shape == (hc, D) and mask_ok
            and kv.device == h.device == gate_weight.device)


def engram_gate(h: torch.Tensor, kv: torch.Tensor, gate_weight: torch.Tensor, eps: float, floor: float,
                token_mask: torch.Tensor | None = None, block_d: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """h + gate * value [T, hc, D] in h.dtype (module docstring); `supported(h, kv, gate_weight, token_mask)` must
    hold."""
    if not supported(h, kv, gate_weight, token_mask):
        raise ValueError(f"engram_gate kernel: h {tuple(h.shape)} {h.dtype}, kv {tuple(kv.shape)} {kv.dtype}, gate "
                         f"weight {tuple(gate_weight.shape)} {gate_weight.dtype}, token mask "
                         f"{None if token_mask is None else (tuple(token_mask.shape), token_mask.dtype)}: want "
                         "h [T, hc, D], kv [T, (hc + 1) * D], an fp32 weight [hc, D], a bool mask [T], one device")
    T, hc, D = h.shape
    h, kv = h.contiguous(), kv.contiguous()
    out = torch.empty_like(h)
    if T:
        block_d = min(block_d, triton.next_power_of_2(D))
        _engram_gate_kernel[(T, hc)](h, kv, gate_weight.contiguous(), h if token_mask is None else token_mask, out,
                                     eps, D ** -0.5, floor, HC=hc, D=D, BLOCK_D=block_d,
                                     HAS_MASK=token_mask is not None, num_warps=num_warps, enable_fp_fusion=False)
    return out
