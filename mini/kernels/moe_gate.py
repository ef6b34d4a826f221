"""The MoE gate in one kernel (mini/ops/moe.py `gate`, sqrtsoftplus scoring): logits, scores, biased top-k,
normalisation and scaling, writing only the [T, k] routing weights and expert ids.

A program owns BM rows and every expert. The experts are split into two column blocks whose widths are powers of
two (NA = the largest power of two <= E, NB = the rest rounded up: 384 = 256 + 128), so that neither the MMA nor
the registers pay for padding 384 to 512; each block has its own fp32 accumulator. bf16 x bf16 products are exact
in fp32, but Hopper's tensor cores do not add them as IEEE fp32 does: each MMA aligns its products to the largest
exponent and truncates, so the logits drift towards zero by up to 2^-23 of the running sum per 16-wide K group
(~4e-5 on V4.1's logits over K = 5120, measured on the H200). So each K chunk of `steps` MMA steps runs
into a fresh accumulator, which is then added in fp32 on the CUDA cores (DeepGEMM's "promotion"): the drift is
bounded by a few groups of a partial sum, and the logits stay at fp32 GEMM accuracy.

Epilogue, per row, element by element as the reference computes it (so the scores are those torch computes from
the same logits: libdevice exp / log1p as CUDA's, IEEE sqrt and divisions):
    logit = acc / temp;  score = sqrt(softplus(logit));  sel = score + bias  (bias_img on image rows)
then k rounds of "take the largest sel": ties go to the lowest expert id, so the ids come out ordered by (sel
descending, id ascending), which is torch.topk's result wherever no two of the compared values are equal; NaN
counts as the largest value, as in torch.topk. weight = score / (sum of the k scores + eps) * route_scale, the sum
taken in pick order.

Decode steps (`few_rows`, up to mini.ops.moe.FEW_ROWS_GATE_MAX_TOKENS tokens) take two launches instead, so
that the weight is read by the whole GPU rather than one SM per row block: `_gate_logits_kernel` splits the experts
and K over its programs (a `FewRowsTiles`) and writes each K piece's partial logits, `_gate_pick_kernel` adds the
pieces as a tree and runs the same epilogue.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@dataclass(frozen=True)
class GateConfig:
    BM: int  # rows per program
    BK: int  # K step (one MMA per column block)
    num_warps: int
    num_stages: int
    # K steps per tensor-core partial sum (module docstring). 1 = no promotion (the sums stay in the MMA
    # accumulator; only for comparison). With unrolled chunks two or more steps are needed, as Triton folds a
    # single dot with a zero accumulator back into the running one; the software pipeline then holds whole chunks,
    # (BM + NA + NB) * steps * BK * 2 bytes per stage. inner_loop: a pipelined loop over the chunk's steps instead.
    steps: int = 2
    inner_loop: bool = False


# Tried in order until one builds on the device (out of shared memory or registers moves to the next). From the
# H200 sweep (`mini bench moe-layer --gate-configs`, docs/perf/raw/007/gate): at 16,384 / 4,096 tokens x 384 x
# 5120, 512-K chunks as a loop 0.39 / 0.21 ms (the unpromoted kernel's time); unrolled 128-K chunks 0.46 / 0.24.
CONFIGS = (GateConfig(64, 64, 8, 3, steps=8, inner_loop=True), GateConfig(32, 64, 4, 2),
           GateConfig(32, 32, 4, 3), GateConfig(32, 32, 4, 2))
_CHOSEN: dict[tuple, GateConfig] = {}


@dataclass(frozen=True)
class FewRowsTiles:
    """The decode path's tiling (`_gate_logits_kernel`): a program reads one [BE experts x K_PIECE] slab of the gate
    weight in BK-wide steps (each expert's row contiguous: wide loads) for BT rows, BT = the next power of two >= T
    up to BT_MAX (more rows: row blocks, each re-reading the slab from L2). CUDA cores: fp32 FMAs into a
    [BT, BE, BK] accumulator, reduced over BK once at the end (the first tiling reduced at every step: ~6
    shuffles per FMA in its PTX). tensor_cores: [BE, BT] = W x^T as one chain of MMAs per piece, added in fp32 by the
    epilogue (the fused kernel's promotion, every K_PIECE); BT at least 16 there. BM, pick_warps: rows and warps
    per epilogue program (one warp keeps its reductions over the experts in shuffles, without barriers)."""
    BE: int
    BK: int
    K_PIECE: int
    BT_MAX: int
    tensor_cores: bool = False
    num_warps: int = 4
    BM: int = 1
    pick_warps: int = 4

    def rows_per_program(self, T: int) -> int:
        bt = min(triton.next_power_of_2(max(T, 1)), self.BT_MAX)
        return max(bt, 16) if self.tensor_cores else bt


# The tilings `mini bench kernels --only decode_gate` times (rows gate/B=..., config "few rows <name>"). At V4.1
# (384 experts x D 5120, T <= BT_MAX) "fma 8x512" runs 48 x 10 programs of 8 KB each, "mma 64x256" 6 x 20 of 32 KB.
FEW_ROWS_CANDIDATES = {
    "fma 8x512": FewRowsTiles(BE=8, BK=128, K_PIECE=512, BT_MAX=4),
    "fma 8x512 pick 1w": FewRowsTiles(BE=8, BK=128, K_PIECE=512, BT_MAX=4, pick_warps=1),
    "fma 8x512 pick 2w": FewRowsTiles(BE=8, BK=128, K_PIECE=512, BT_MAX=4, pick_warps=2),
    "fma 4x1024": FewRowsTiles(BE=4, BK=256, K_PIECE=1024, BT_MAX=4),
    "fma 8x1024 w8": FewRowsTiles(BE=8, BK=256, K_PIECE=1024, BT_MAX=4, num_warps=8),
    "fma 4x2560": FewRowsTiles(BE=4, BK=512, K_PIECE=2560, BT_MAX=2),
    "mma 64x256": FewRowsTiles(BE=64, BK=64, K_PIECE=256, BT_MAX=64, tensor_cores=True),
    "mma 32x512": FewRowsTiles(BE=32, BK=128, K_PIECE=512, BT_MAX=32, tensor_cores=True),
    # beyond 64 rows: half the pieces (partial logits) of 64x256, promoted every 512 of K as the fused kernel
    "mma 64x512": FewRowsTiles(BE=64, BK=64, K_PIECE=512, BT_MAX=64, tensor_cores=True),
}
# The tiling of a decode step of T rows: the first entry whose bound is >= T (the last beyond), the fastest whose
# ids match the unfused gate's in `mini bench kernels --only decode_gate`: on the H200 (docs/perf/014) fma 8x512 at
# B = 1, 8.0 us (mma 64x256 8.3: a tie), mma 64x256 at 2-64, 8.2-9.5 us (at 2 and 4 rows fma 8x512 took 9.0 and
# 10.3, yet ran there until docs/perf/035; on an H100 8.9 and 10.2 against 8.2); on an H100 (docs/perf/033) mma
# 64x256 and 64x512 tie at 96-128 rows and 64x512 wins beyond, up to mini.ops.moe.FEW_ROWS_GATE_MAX_TOKENS (256 rows
# 13.2 against 14.2 us, 384 16.4 against 19.4, 1,023 34.7 against 42.3).
FEW_ROWS_BY_TOKENS = ((1, FEW_ROWS_CANDIDATES["fma 8x512"]), (128, FEW_ROWS_CANDIDATES["mma 64x256"]),
                      (1 << 30, FEW_ROWS_CANDIDATES["mma 64x512"]))


def few_rows_tiles(T: int) -> FewRowsTiles:
    """The decode path's tiling for a step of T rows (FEW_ROWS_BY_TOKENS)."""
    return next((tiles for bound, tiles in FEW_ROWS_BY_TOKENS if T <= bound), FEW_ROWS_BY_TOKENS[-1][1])


@triton.jit
def _sqrt_softplus(logit, LIBDEVICE: tl.constexpr):
    """sqrt(softplus(logit)) as torch computes it: softplus = logit above 20, else log1p(exp(logit))."""
    if LIBDEVICE:
        soft = libdevice.log1p(libdevice.exp(logit))
    else:  # Triton's interpreter has no libdevice
        soft = tl.log(1.0 + tl.exp(logit))
    return tl.sqrt_rn(tl.where(logit > 20.0, logit, soft))


@triton.jit
def _block_scores(acc, cols, rows, row_ok, temp, bias_ptr, bias_img_ptr, is_img, logits_ptr, scores_ptr,
                  E: tl.constexpr, HAS_IMG: tl.constexpr, DEBUG: tl.constexpr, LIBDEVICE: tl.constexpr):
    """One column block's scores and selection values (-inf on padding columns; NaN -> +inf)."""
    col_ok = cols < E
    logit = tl.div_rn(acc, temp)
    score = _sqrt_softplus(logit, LIBDEVICE)
    if DEBUG:
        at = rows[:, None].to(tl.int64) * E + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        tl.store(logits_ptr + at, logit, mask=ok)
        tl.store(scores_ptr + at, score, mask=ok)
    sel = score + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_IMG:
        sel_img = score + tl.load(bias_img_ptr + cols, mask=col_ok, other=0.0)[None, :]
        sel = tl.where(is_img[:, None], sel_img, sel)
    sel = tl.where(sel != sel, float("inf"), sel)
    return score, tl.where(col_ok[None, :], sel, float("-inf"))


@triton.jit
def _load_step(x_ptrs, wa_ptrs, wb_ptrs, k0, kk, row_ok, cols_a, cols_b, D: tl.constexpr, E: tl.constexpr,
               NB: tl.constexpr, DOT_DTYPE: tl.constexpr, BK: tl.constexpr, CHUNK: tl.constexpr):
    """The x tile and the two weight tiles of the K step at k0 (K masked only when D is not a multiple of the
    chunk: a mask that varies along K would stop vectorized loads)."""
    k_ok = (kk < BK) if D % CHUNK == 0 else (k0 + kk < D)
    a = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
    wa = tl.load(wa_ptrs + k0, mask=(cols_a < E)[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
    wb = wa
    if NB > 0:
        wb = tl.load(wb_ptrs + k0, mask=(cols_b < E)[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
    return a, wa, wb


@triton.jit
def _gate_kernel(x_ptr, w_ptr, bias_ptr, bias_img_ptr, img_ptr, weights_ptr, ids_ptr, logits_ptr, scores_ptr,
                 T, stride_x, temp, route_scale, eps,
                 D: tl.constexpr, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NA: tl.constexpr,
                 NB: tl.constexpr, NORMALIZE: tl.constexpr, HAS_IMG: tl.constexpr, DEBUG: tl.constexpr,
                 LIBDEVICE: tl.constexpr, DOT_DTYPE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                 STEPS: tl.constexpr, INNER_LOOP: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < T
    kk = tl.arange(0, BK)
    # a K mask only when D is not a multiple of BK (a mask that varies along K would stop vectorized loads)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :]
    cols_a = tl.arange(0, NA)
    wa_ptrs = w_ptr + cols_a[:, None] * D + kk[None, :]
    acc_a = tl.zeros([BM, NA], dtype=tl.float32)
    cols_b, wb_ptrs = cols_a, wa_ptrs  # read only when NB > 0
    if NB > 0:
        cols_b = NA + tl.arange(0, NB)
        wb_ptrs = w_ptr + cols_b[:, None] * D + kk[None, :]
        acc_b = tl.zeros([BM, NB], dtype=tl.float32)
    for k0 in range(0, D, STEPS * BK):
        # each chunk's MMAs chain on a fresh accumulator (none for the first), then it is added on the CUDA cores
        if INNER_LOOP:  # the chunk's K steps as a (software-pipelined) loop
            part_a = tl.zeros([BM, NA], dtype=tl.float32)
            if NB > 0:
                part_b = tl.zeros([BM, NB], dtype=tl.float32)
            for j in range(STEPS):
                a, wa, wb = _load_step(x_ptrs, wa_ptrs, wb_ptrs, k0 + j * BK, kk, row_ok, cols_a, cols_b, D, E,
                                       NB, DOT_DTYPE, BK, STEPS * BK)
                part_a = tl.dot(a, tl.trans(wa), part_a)
                if NB > 0:
                    part_b = tl.dot(a, tl.trans(wb), part_b)
        else:  # unrolled: the software pipeline then holds whole chunks
            for j in tl.static_range(STEPS):
                a, wa, wb = _load_step(x_ptrs, wa_ptrs, wb_ptrs, k0 + j * BK, kk, row_ok, cols_a, cols_b, D, E,
                                       NB, DOT_DTYPE, BK, STEPS * BK)
                if j == 0:
                    part_a = tl.dot(a, tl.trans(wa))
                else:
                    part_a = tl.dot(a, tl.trans(wa), part_a)
                if NB > 0:
                    if j == 0:
                        part_b = tl.dot(a, tl.trans(wb))
                    else:
                        part_b = tl.dot(a, tl.trans(wb), part_b)
        acc_a += part_a
        if NB > 0:
            acc_b += part_b

    is_img = row_ok  # read only when HAS_IMG
    if HAS_IMG:
        is_img = tl.load(img_ptr + rows, mask=row_ok, other=0) != 0
    score_a, sel_a = _block_scores(acc_a, cols_a, rows, row_ok, temp, bias_ptr, bias_img_ptr, is_img, logits_ptr,
                                   scores_ptr, E, HAS_IMG, DEBUG, LIBDEVICE)
    score_b, sel_b = score_a, sel_a  # read only when NB > 0
    if NB > 0:
        score_b, sel_b = _block_scores(acc_b, cols_b, rows, row_ok, temp, bias_ptr, bias_img_ptr, is_img,
                                       logits_ptr, scores_ptr, E, HAS_IMG, DEBUG, LIBDEVICE)
    _pick_top_k(score_a, sel_a, score_b, sel_b, cols_a, cols_b, rows, row_ok, weights_ptr, ids_ptr, route_scale, eps,
                K, KP, NA, NB, NORMALIZE, BM)


@triton.jit
def _pick_top_k(score_a, sel_a, score_b, sel_b, cols_a, cols_b, rows, row_ok, weights_ptr, ids_ptr, route_scale,
                eps, K: tl.constexpr, KP: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr,
                NORMALIZE: tl.constexpr, BM: tl.constexpr):
    """k rounds of "take the largest sel" over both column blocks (ties: the lowest id), then the weights."""
    slots = tl.arange(0, KP)
    picked_score = tl.zeros([BM, KP], dtype=tl.float32)
    picked_id = tl.zeros([BM, KP], dtype=tl.int32)
    total = tl.zeros([BM], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(sel_a, axis=1)
        if NB > 0:
            best = tl.maximum(best, tl.max(sel_b, axis=1))
        idx = tl.min(tl.where(sel_a == best[:, None], cols_a[None, :], NA + NB), axis=1)
        if NB > 0:
            idx = tl.minimum(idx, tl.min(tl.where(sel_b == best[:, None], cols_b[None, :], NA + NB), axis=1))
        hit_a = cols_a[None, :] == idx[:, None]
        s = tl.sum(tl.where(hit_a, score_a, 0.0), axis=1)  # + exact zeros: the picked score itself
        sel_a = tl.where(hit_a, float("-inf"), sel_a)
        if NB > 0:
            hit_b = cols_b[None, :] == idx[:, None]
            s += tl.sum(tl.where(hit_b, score_b, 0.0), axis=1)
            sel_b = tl.where(hit_b, float("-inf"), sel_b)
        picked_score = tl.where(slots[None, :] == j, s[:, None], picked_score)
        picked_id = tl.where(slots[None, :] == j, idx[:, None], picked_id)
        total += s

    w = picked_score
    if NORMALIZE:
        w = tl.div_rn(w, (total + eps)[:, None])
    w = w * route_scale
    out = rows[:, None].to(tl.int64) * K + slots[None, :]
    ok = row_ok[:, None] & (slots < K)[None, :]
    tl.store(weights_ptr + out, w, mask=ok)
    tl.store(ids_ptr + out, picked_id.to(tl.int64), mask=ok)


@triton.jit(do_not_specialize=["T"])
def _gate_logits_kernel(x_ptr, w_ptr, part_ptr, T, stride_x, D: tl.constexpr, E: tl.constexpr,
                        BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, K_PIECE: tl.constexpr,
                        TENSOR_CORES: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Few rows: the partial logits part[s, t, e] = sum of x[t, k] w[e, k] over K piece s (K_PIECE wide), for BT
    rows x BE experts per program (`FewRowsTiles`). Experts and K split over the programs: the gate weight is
    read once across the GPU per row block, each program's slab in K_PIECE / BK wide steps, all unrolled."""
    experts = tl.program_id(0) * BE + tl.arange(0, BE)
    e_ok = experts < E
    piece = tl.program_id(1)
    rows = tl.program_id(2) * BT + tl.arange(0, BT)
    row_ok = rows < T
    kk = tl.arange(0, BK)
    w_ptrs = w_ptr + experts[:, None] * D + kk[None, :]
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :]
    if not TENSOR_CORES:
        acc3 = tl.zeros([BT, BE, BK], dtype=tl.float32)  # elementwise sums, reduced over BK once at the end
    for j in tl.static_range(K_PIECE // BK):
        k0 = piece * K_PIECE + j * BK
        # K masked only when D is not a multiple of K_PIECE (a mask that varies along K stops wide loads)
        k_ok = (kk < BK) if D % K_PIECE == 0 else (k0 + kk < D)
        w = tl.load(w_ptrs + k0, mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if TENSOR_CORES:  # [BE, BT]: the weight as the MMA's wide operand, one chain over the piece
            if j == 0:
                acc_t = tl.dot(w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)))
            else:
                acc_t = tl.dot(w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), acc_t)
        else:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if TENSOR_CORES:
        acc = tl.trans(acc_t)
    else:
        acc = tl.sum(acc3, axis=2)
    at = (piece * T + rows[:, None].to(tl.int64)) * E + experts[None, :]
    tl.store(part_ptr + at, acc, mask=row_ok[:, None] & e_ok[None, :])


@triton.jit
def _sum_pieces(part_ptr, rows, row_ok, cols, T, E: tl.constexpr, PIECES: tl.constexpr, PP: tl.constexpr):
    """[BM, width] logits: the K pieces' partial sums added as one tree over the piece axis (fixed for a shape)."""
    p = tl.arange(0, PP)
    at = (p[:, None, None] * T + rows[None, :, None].to(tl.int64)) * E + cols[None, None, :]
    ok = (p < PIECES)[:, None, None] & row_ok[None, :, None] & (cols < E)[None, None, :]
    return tl.sum(tl.load(part_ptr + at, mask=ok, other=0.0), axis=0)


@triton.jit(do_not_specialize=["T"])
def _gate_pick_kernel(part_ptr, debug_ptr, bias_ptr, bias_img_ptr, img_ptr, weights_ptr, ids_ptr, T, temp,
                      route_scale, eps, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NA: tl.constexpr,
                      NB: tl.constexpr, NORMALIZE: tl.constexpr, HAS_IMG: tl.constexpr, DEBUG: tl.constexpr,
                      LIBDEVICE: tl.constexpr, BM: tl.constexpr, PIECES: tl.constexpr, PP: tl.constexpr):
    """Few rows, after `_gate_logits_kernel`: the pieces summed, then `_gate_kernel`'s epilogue on BM rows (DEBUG:
    the logits and scores to debug_ptr, [2, T, E])."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < T
    cols_a = tl.arange(0, NA)
    is_img = row_ok  # read only when HAS_IMG
    if HAS_IMG:
        is_img = tl.load(img_ptr + rows, mask=row_ok, other=0) != 0
    acc_a = _sum_pieces(part_ptr, rows, row_ok, cols_a, T, E, PIECES, PP)
    score_a, sel_a = _block_scores(acc_a, cols_a, rows, row_ok, temp, bias_ptr, bias_img_ptr, is_img, debug_ptr,
                                   debug_ptr + T * E, E, HAS_IMG, DEBUG, LIBDEVICE)
    cols_b = cols_a
    score_b, sel_b = score_a, sel_a  # read only when NB > 0
    if NB > 0:
        cols_b = NA + tl.arange(0, NB)
        acc_b = _sum_pieces(part_ptr, rows, row_ok, cols_b, T, E, PIECES, PP)
        score_b, sel_b = _block_scores(acc_b, cols_b, rows, row_ok, temp, bias_ptr, bias_img_ptr, is_img,
                                       debug_ptr, debug_ptr + T * E, E, HAS_IMG, DEBUG, LIBDEVICE)
    _pick_top_k(score_a, sel_a, score_b, sel_b, cols_a, cols_b, rows, row_ok, weights_ptr, ids_ptr, route_scale, eps,
                K, KP, NA, NB, NORMALIZE, BM)


def column_blocks(n_experts: int) -> tuple[int, int]:
    """(NA, NB): the largest power of two <= E, and the rest rounded up to a power of two (0 when none)."""
    na = 1 << (n_experts.bit_length() - 1)
    return na, (triton.next_power_of_2(n_experts - na) if n_experts > na else 0)


def gate_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, route_scale: float,
              temp: float = 1.0, eps: float = 0.0, normalize: bool = True, bias_img: torch.Tensor | None = None,
              image_mask: torch.Tensor | None = None, config: GateConfig | None = None, debug: bool = False,
              few_rows: bool | FewRowsTiles = False):
    """x [T, D] bf16, weight [E, D] bf16, bias fp32 [E] -> (weights fp32 [T, k], ids int64 [T, k]).
    bias_img [E] with image_mask bool [T]: that bias on image rows. debug=True also returns the fp32 logits and
    scores [T, E] (only for tests). `config` None: the first of CONFIGS that builds here. few_rows=True (or a
    FewRowsTiles: that tiling, else `few_rows_tiles(T)`): the decode path, two launches (`_gate_logits_kernel` with
    the experts and K split over the programs, then `_gate_pick_kernel`), the same epilogue; its logits sum in
    another order."""
    T, D = x.shape
    E = weight.shape[0]
    assert weight.shape[1] == D and bias.shape == (E,) and 0 < k <= E
    assert x.dtype == weight.dtype == torch.bfloat16, "the kernel multiplies bf16 (exact products in fp32)"
    dev = x.device
    weights = torch.empty(T, k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, k, dtype=torch.int64, device=dev)
    logits = torch.empty(T if debug else 0, E, dtype=torch.float32, device=dev)
    scores = torch.empty_like(logits)
    if T == 0:
        return (weights, ids, logits, scores) if debug else (weights, ids)
    if x.stride(1) != 1:
        x = x.contiguous()
    has_img = image_mask is not None and bias_img is not None
    interpreted = dev.type == "cpu"
    na, nb = column_blocks(E)
    bias = bias.float().contiguous()
    bias_img = bias_img.float().contiguous() if has_img else bias
    img = image_mask.contiguous().view(torch.uint8) if has_img else x
    args = (x, weight.contiguous(), bias, bias_img, img, weights, ids, logits, scores, T, x.stride(0), float(temp),
            float(route_scale), float(eps))
    consts = dict(D=D, E=E, K=k, KP=triton.next_power_of_2(k), NA=na, NB=nb, NORMALIZE=normalize, HAS_IMG=has_img,
                  DEBUG=debug, LIBDEVICE=not interpreted,
                  # the interpreter's bf16 dot is broken: the same (exact) values multiplied in fp32 there
                  DOT_DTYPE=tl.float32 if interpreted else tl.bfloat16)
    if few_rows:
        tiles = few_rows_tiles(T) if few_rows is True else few_rows
        BT, pieces = tiles.rows_per_program(T), triton.cdiv(D, tiles.K_PIECE)
        part = torch.empty(pieces, T, E, dtype=torch.float32, device=dev)  # the K pieces' partial logits
        debug_out = torch.empty(2 if debug else 0, T, E, dtype=torch.float32, device=dev)  # logits, scores
        _gate_logits_kernel[(triton.cdiv(E, tiles.BE), pieces, triton.cdiv(T, BT))](
            x, weight.contiguous(), part, T, x.stride(0), D=D, E=E, BT=BT, BE=tiles.BE, BK=tiles.BK,
            K_PIECE=tiles.K_PIECE, TENSOR_CORES=tiles.tensor_cores, DOT_DTYPE=consts["DOT_DTYPE"],
            num_warps=tiles.num_warps)
        _gate_pick_kernel[(triton.cdiv(T, tiles.BM),)](
            part, debug_out if debug else part, bias, bias_img, img, weights, ids, T, float(temp), float(route_scale),
            float(eps), E=E, K=k, KP=consts["KP"], NA=na, NB=nb, NORMALIZE=normalize, HAS_IMG=has_img, DEBUG=debug,
            LIBDEVICE=not interpreted, BM=tiles.BM, PIECES=pieces, PP=triton.next_power_of_2(pieces),
            num_warps=tiles.pick_warps)
        return (weights, ids, debug_out[0], debug_out[1]) if debug else (weights, ids)
    key = (dev.type, dev.index, D, E, k)
    candidates = (config,) if config is not None else (_CHOSEN[key],) if key in _CHOSEN else CONFIGS
    for i, cfg in enumerate(candidates):
        try:
            _gate_kernel[(triton.cdiv(T, cfg.BM),)](*args, **consts, BM=cfg.BM, BK=cfg.BK, STEPS=cfg.steps,
                                                    INNER_LOOP=cfg.inner_loop,
                                                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        except triton.runtime.errors.OutOfResources:
            if i == len(candidates) - 1:
                raise
            continue
        if config is None:
            _CHOSEN.setdefault(key, cfg)
        break
    return (weights, ids, logits, scores) if debug else (weights, ids)
