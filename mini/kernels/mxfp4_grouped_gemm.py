"""Grouped GEMMs over MXFP4 expert weights, decoding the weights in the main loop (no dequantized copy).

Weights are the checkpoint's bytes stacked per local expert: packed E2M1 `[E, N, K/2]` (low nibble = even k) and
one E8M0 scale per 32 k, `[E, N, K/32]`. Each K step loads a [BN, BK/2] byte tile and its [BN, BK/32] scales and
decodes them with integer ops: for a magnitude code c = 2*E + m (value 2^(E-1) * (1 + m/2), or m/2 when E = 0),
the fp32 with bits (c << 22) is value * 2^-126 (code 1 becomes a denormal); times 2^126 it is the value, exact,
and times the scale's fp32 value 2^(s-127) (s = 0: the denormal 2^-127; s = 255: NaN, as E8M0 defines it) the
weight, exact wherever fp32 holds it and +-inf where it overflows, as the CPU decoder (mini.formats.dequant_mxfp4)
gives it, for every scale byte. (The former single multiply by 2^(s-1) overflowed above byte 128.) On Hopper the
product is a bf16 `tl.dot` with fp32 accumulation (`tl.dot_scaled` bf16 x e2m1 gave wrong results on sm90). Under
Triton's interpreter (CPU tensors) the dot runs in fp32 on the same bf16-exact values (its bf16 dot is broken).

`grouped_swiglu`: h = fp8q(round(route_w * silu(min(g, L)) * clamp(u, -L, L))) with g = round(x W1^T),
u = round(x W3^T), where round() is the activation dtype's rounding (the reference's Linear returns x.dtype) and
fp8q the FP8 1 x block fake quant of w2's input, all in the epilogue. `grouped_down`: y = h W2^T in h's dtype.
Rows are gathered through `RoutePlan.token` (first GEMM) or read in sorted order (second).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mini.kernels.device_info import looped_row_programs
from mini.kernels.quant import e2m1_value, e8m0_value, fp8_group_quant
from mini.kernels.moe_route import RoutePlan

# tile configs for the H200 (see docs/kernels.md); the row tile is the routing plan's block_m
BLOCK_M = 128
CONFIG = {"swiglu": dict(BN=64, BK=64, num_warps=4, num_stages=4),
          "down": dict(BN=128, BK=64, num_warps=8, num_stages=4)}


@triton.jit
def _decode_tile(w_ptrs, s_ptrs, w_mask, s_mask, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):
    """Load a [BN, BK/2] tile of packed MXFP4 and its [BN, BK/32] scales; return it as [BN, BK] in DOT_DTYPE."""
    if EVEN_K:
        packed = tl.load(w_ptrs).to(tl.int32)
        scale = tl.load(s_ptrs).to(tl.int32)
    else:
        packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32)
        scale = tl.load(s_ptrs, mask=s_mask, other=127).to(tl.int32)
    mult = tl.reshape(tl.broadcast_to(e8m0_value(scale)[:, :, None], [BN, BK // 32, 16]), [BN, BK // 2])
    lo = e2m1_value(packed & 15) * mult  # two exact multiplies: the code's value, then the scale
    hi = e2m1_value(packed >> 4) * mult
    return tl.reshape(tl.join(lo, hi), [BN, BK]).to(DOT_DTYPE)


@triton.jit
def _mma(a, w, acc, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += a @ w^T for a [BM, BK], w [BN, BK]. SWAP_AB accumulates the transpose, acc^T += w @ a^T, so that the
    decoded weights (in registers) are wgmma's A operand and only the activations go through shared memory."""
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def round_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), still fp32. Bit arithmetic instead of a cast: Triton's
    interpreter casts fp32 to bf16 by truncation."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # mask 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def swiglu_epilogue(g, u, route_w, limit, ROUND_BF16: tl.constexpr, QUANT_BLOCK: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr):
    """fp32 [BM, BN] g = x W1^T, u = x W3^T, route_w [BM] -> h = fp8q(round(route_w * silu(min(g, L)) *
    clamp(u, -L, L))) with g, u rounded first (the reference's w1(x) / w3(x) come back in the activation dtype)."""
    if ROUND_BF16:
        g = round_bf16(g)
        u = round_bf16(u)
    u = tl.clamp(u, -limit, limit)
    g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u
    h = h * route_w[:, None]
    if ROUND_BF16:
        h = round_bf16(h)
    if QUANT_BLOCK > 0:
        h = fp8_group_quant(h, BN // QUANT_BLOCK, QUANT_BLOCK, BM)
    return h


@triton.jit
def _swiglu_rows_kernel(g_ptr, u_ptr, route_w_ptr, out_ptr, n_valid_ptr, R, N, stride_g, stride_u, stride_out,
                        limit, HAS_ROUTE_W: tl.constexpr, HAS_N_VALID: tl.constexpr, ROUND_BF16: tl.constexpr,
                        QUANT_BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    n_rows = R
    n_tiles = tl.num_programs(0)  # a row tile a program
    if HAS_N_VALID:  # the local row count lives on the device (no host sync): the programs loop up to it
        n_rows = tl.load(n_valid_ptr)
        n_tiles = tl.cdiv(n_rows, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows = tile * BM + tl.arange(0, BM)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & (cols[None, :] < N)
        r64 = rows.to(tl.int64)[:, None]
        g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_ROUTE_W:
            route_w = tl.load(route_w_ptr + rows, mask=row_ok, other=0.0)
        else:
            route_w = tl.full([BM], 1.0, tl.float32)  # x 1.0 is exact: the bits of a weight tensor of ones
        h = swiglu_epilogue(g, u, route_w, limit, ROUND_BF16, QUANT_BLOCK, BM, BN)
        tl.store(out_ptr + r64 * stride_out + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_rows(g: torch.Tensor, u: torch.Tensor, route_w: torch.Tensor | None, n_valid: torch.Tensor | None,
                limit: float, quant_block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The SwiGLU epilogue as its own pass, for GEMMs that cannot fuse it: g, u [R, N] (w1 and w3 outputs by
    sorted row, already in the activation dtype), route_w fp32 [R] -> h [R, N] for the rows below n_valid (a
    one-element int tensor on the device); later rows are left unwritten. quant_block 0 skips the FP8 quant.
    route_w None: every weight 1.0; n_valid None: all R rows (the shared expert: no tensors of constants to fill in
    every layer, issue 28)."""
    if g.shape != u.shape or g.stride(1) != 1 or u.stride(1) != 1:  # may be two halves of one [R, 2N] tensor
        raise ValueError("swiglu_rows: g and u must be row-major tensors of one shape")
    R, N = g.shape
    if quant_block and N % quant_block:
        raise ValueError(f"swiglu_rows: width {N} is not a multiple of the quant block {quant_block}")
    out = torch.empty(R, N, dtype=g.dtype, device=g.device) if out is None else out
    if R == 0:
        return out
    BM, BN = 16, max(128, quant_block)
    row_tiles, col_tiles = triton.cdiv(R, BM), triton.cdiv(N, BN)
    if n_valid is not None:
        row_tiles = looped_row_programs(row_tiles, col_tiles, g.device)
    _swiglu_rows_kernel[(row_tiles, col_tiles)](
        g, u, g if route_w is None else route_w, out, g if n_valid is None else n_valid, R, N, g.stride(0),
        u.stride(0), out.stride(0), float(limit) if limit > 0 else float("inf"), HAS_ROUTE_W=route_w is not None,
        HAS_N_VALID=n_valid is not None, ROUND_BF16=out.dtype == torch.bfloat16, QUANT_BLOCK=quant_block, BM=BM,
        BN=BN, num_warps=4)
    return out


@triton.jit
def _grouped_mxfp4_kernel(
    a_ptr, token_ptr, route_w_ptr, out_ptr,
    w_ptr, ws_ptr, v_ptr, vs_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, stride_a, stride_out, stride_we, stride_wn, stride_se, stride_sn, limit,
    K: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr, ROUND_BF16: tl.constexpr, QUANT_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    # the N tiles of one row tile are neighbours in launch order: the row tile stays in L2 while they run
    n_tiles_n = tl.cdiv(N, BN)
    pid_m = tl.program_id(0) // n_tiles_n
    pid_n = tl.program_id(0) % n_tiles_n
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    row0 = tl.load(tile_start_ptr + pid_m)
    row_end = tl.load(tile_end_ptr + pid_m)
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    if GATHER:
        a_rows = tl.load(token_ptr + rows, mask=row_ok, other=0)
    else:
        a_rows = rows
    offs_k = tl.arange(0, BK)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_n = tl.where(n_ok, offs_n, 0)  # clamped: scale loads need no mask
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
    w_off = e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BK // 2)[None, :]
    s_off = e.to(tl.int64) * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn + tl.arange(0, BK // 32)[None, :]

    if SWAP_AB:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        acc_v = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc_v = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w_mask = None
            s_mask = None
        else:  # K is a multiple of 32 but not of BK: the last step reads past K, as zeros
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (k0 + offs_k[None, :] < K), other=0.0)
            w_mask = (k0 // 2 + tl.arange(0, BK // 2)[None, :]) < K // 2
            s_mask = (k0 // 32 + tl.arange(0, BK // 32)[None, :]) < K // 32
        a = a.to(DOT_DTYPE)  # fake-quantized activations are exact in bf16
        wt = _decode_tile(w_ptr + w_off + k0 // 2, ws_ptr + s_off + k0 // 32, w_mask, s_mask, BN, BK, EVEN_K, DOT_DTYPE)
        acc = _mma(a, wt, acc, SWAP_AB, DOT_PRECISION)
        if SWIGLU:
            vt = _decode_tile(v_ptr + w_off + k0 // 2, vs_ptr + s_off + k0 // 32, w_mask, s_mask, BN, BK, EVEN_K,
                              DOT_DTYPE)
            acc_v = _mma(a, vt, acc_v, SWAP_AB, DOT_PRECISION)
        a_ptrs += BK
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_v = tl.trans(acc_v)

    if SWIGLU:
        route_w = tl.load(route_w_ptr + rows, mask=row_ok, other=0.0)
        result = swiglu_epilogue(acc, acc_v, route_w, limit, ROUND_BF16, QUANT_BLOCK, BM, BN)
    else:
        result = round_bf16(acc) if ROUND_BF16 else acc
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _check_weight(w, name: str):
    if w.kind != "mxfp4" or w.data.dim() != 3 or w.scale.dim() != 3:
        raise ValueError(f"{name}: expected stacked MXFP4 weights [E, N, K/2] + [E, N, K/32]")


def _launch(a, plan: RoutePlan, w, v, out, gather: bool, swiglu: bool, limit: float, quant_block: int,
            config: dict):
    E, N, K2 = w.data.shape
    K = 2 * K2
    if a.shape[1] != K or K % 32:
        raise ValueError(f"activation width {a.shape[1]} does not match the weights' K = {K} (a multiple of 32)")
    cfg = config
    BM = plan.block_m
    if quant_block and cfg["BN"] % quant_block:  # the epilogue's FP8 groups lie inside one N tile (V4: 1x128)
        if quant_block & (quant_block - 1):
            raise ValueError(f"quant block {quant_block} is not a power of two")
        cfg = dict(cfg, BN=max(cfg["BN"], quant_block))
    if a.stride(1) != 1:
        a = a.contiguous()
    data = w.data.view(torch.uint8)
    scale = w.scale.view(torch.uint8)
    vd = v.data.view(torch.uint8) if v is not None else data
    vs = v.scale.view(torch.uint8) if v is not None else scale
    interpreted = a.device.type == "cpu"
    grid = (plan.tile_expert.numel() * triton.cdiv(N, cfg["BN"]),)
    _grouped_mxfp4_kernel[grid](
        a, plan.token, plan.weight, out, data, scale, vd, vs,
        plan.tile_expert, plan.tile_start, plan.tile_end,
        N, a.stride(0), out.stride(0), data.stride(0), data.stride(1), scale.stride(0), scale.stride(1),
        float(limit) if limit > 0 else float("inf"),
        K=K, GATHER=gather, SWIGLU=swiglu, ROUND_BF16=out.dtype == torch.bfloat16, QUANT_BLOCK=quant_block,
        EVEN_K=K % cfg["BK"] == 0, BM=BM, SWAP_AB=cfg.get("SWAP_AB", False),
        # CPU tensors mean Triton's interpreter, whose bf16 dot is broken: multiply the same values in fp32 there
        DOT_DTYPE=tl.float32 if interpreted else tl.bfloat16, DOT_PRECISION="ieee" if interpreted else None,
        BN=cfg["BN"], BK=cfg["BK"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def grouped_swiglu(x: torch.Tensor, plan: RoutePlan, w1, w3, limit: float, quant_block: int,
                   out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [T, D] (already FP8 fake-quantized) -> h [plan.n_rows, I] in x.dtype, row r for sorted row r (rows past
    the local ones are left unwritten). quant_block = 0 skips the FP8 quant of h."""
    _check_weight(w1, "w1")
    _check_weight(w3, "w3")
    if w1.data.shape != w3.data.shape:
        raise ValueError("w1 and w3 must have the same shape")
    out = torch.empty(plan.n_rows, w1.data.shape[1], dtype=x.dtype, device=x.device) if out is None else out
    return _launch(x, plan, w1, w3, out, True, True, limit, quant_block, config or CONFIG["swiglu"])


def grouped_down(h: torch.Tensor, plan: RoutePlan, w2, out: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """h [plan.n_rows, I] in sorted-row order -> y [plan.n_rows, D] in h.dtype (the expert outputs)."""
    _check_weight(w2, "w2")
    out = torch.empty(plan.n_rows, w2.data.shape[1], dtype=h.dtype, device=h.device) if out is None else out
    return _launch(h, plan, w2, None, out, False, False, 0.0, 0, config or CONFIG["down"])
