"""Library adapter, called only from mini/ops/moe.py: the routed experts' grouped GEMMs through Humming
(`humming-kernels`, the vLLM project's MXFP4 kernels) on SM90, as W4A16.

Exact like the reference: the activations are bf16 (FP8 fake-quantized values are exact in bf16), E2M1 x E8M0
weights decode to bf16 exactly, every product is exact in fp32 and summed in fp32, and each GEMM rounds its output
to bf16 once, as the reference's Linear returns x.dtype. Only the summation order differs.

Layout. Humming reads an expert's weights in its own order (4-bit codes regrouped into the fragments its wgmma
consumes, [K/16, 2N] int32; scales transposed to [K/32, N] with a shuffle inside every 64 columns). That
transform only moves codes and scale bytes: the moves are learned once per shape by pushing index-valued probes
through it. `convert` applies them to a layer's stacked buffers in place, a few experts at a time, so no second
copy of the experts ever exists; `unpack` moves one expert back (the reference path reads experts so).

GEMM. "Grouped contiguous": input rows sorted by expert (RoutePlan's order), `expert_offset` [E+1] on the device
says where each expert's rows are; rows past the last offset are neither read nor written, so nothing is read
back to the host. The tile config is Humming's SM90 heuristic for the expected row count rounded up to a power of
two, with stream-K off: stream-K splits K between CTAs and adds their partial tiles into the bf16 output (TMA
reduce-add), a second rounding the reference does not have (measured: 94 % of the outputs bit-equal to the
reference with it, see docs/kernels.md). Each (shape, bucket) compiles once per process (~6 s for two
kernels side by side on a fresh H200), cached on disk under $HUMMING_CACHE_DIR (default ~/.humming/cache).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

GROUP = 32  # MXFP4: one E8M0 scale per 32 codes along K
COMPUTE_CONFIG = json.dumps({"gemm_type": "grouped_contiguous"})
# the deterministic mode's: the library's batch-invariant kernels (it asserts one K partition, no stream-K)
INVARIANT_COMPUTE_CONFIG = json.dumps({"gemm_type": "grouped_contiguous", "use_batch_invariant": True})
CHUNK = 4  # experts moved at once at load (scratch: ~60 MB per V4.1-Flash w1+w3 expert)


@functools.cache
def available() -> bool:
    """Whether the library imports and the current GPU is SM90 (the heuristics and kernels used here)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import humming  # noqa: F401
    except Exception:  # not installed, or installed without its CUDA bindings: the Triton kernels serve instead
        return False
    return True


def supports(n: int, k: int) -> bool:
    """Whether an [N, K] expert projection fits Humming's SM90 tiles. Its heuristics halve the N tile (from 256)
    until it divides N and assert that it keeps a four-warp wgmma group of 32 columns (bf16 activations): N must
    be a multiple of 128, and K is held to multiples of 128 (V4.1-Flash: N 4608 / 5120, K 5120 / 2304; tiny-v4, D
    128, ran on the H200). tiny-v4.1 (D 64) fails that assertion, so it stays on the Triton kernels."""
    return n % 128 == 0 and k % 128 == 0


# E8M0 scale bytes whose decode through Humming's GEMM tests/kernels/test_humming_experts.py checks bit for bit
# (`test_grouped_gemm_decodes_all_codes_and_scales`, gpu; it also reports what the library makes of the others).
# Byte 255 is NaN in E8M0 and the checkpoint loader refuses it; byte 0 (2^-127, a bf16 denormal: weights below
# 1e-38, never in a real checkpoint) is kept off the library until that test shows it decodes exactly.
SCALE_BYTES = range(1, 255)


def scales_supported(*scales: torch.Tensor) -> bool:
    """Whether every E8M0 byte of these scale tensors is in SCALE_BYTES (experts with others stay on the Triton
    kernels, which decode all 256). One min/max pass per tensor, at load."""
    for s in scales:
        b = s.view(torch.uint8)
        if b.numel() and (int(b.min()) < SCALE_BYTES.start or int(b.max()) >= SCALE_BYTES.stop):
            return False
    return True


@dataclass(eq=False)
class HummingStack:
    """One projection of one layer's local experts in Humming's layout: views of the original buffers."""
    n: int
    k: int
    weight: torch.Tensor  # int32 [E, K/16, 2N]
    scale: torch.Tensor  # float8_e8m0fnu [E, K/32, N]
    config: object  # humming.config.LayerConfig for E experts
    locks: torch.Tensor  # the launcher's stream-K semaphores (stream-K is off here, the argument stays)

    @property
    def experts(self) -> int:
        return self.weight.shape[0]


def _schema():
    from humming import dtypes
    from humming.schema import HummingWeightSchema
    return HummingWeightSchema(b_dtype=dtypes.float4e2m1, bs_dtype=dtypes.float8e8m0, weight_scale_group_size=GROUP)


@functools.cache
def _layer_config(n: int, k: int, experts: int):
    from humming.transform import prepare_layer_config
    return prepare_layer_config(shape_n=n, shape_k=k, weight_schema=_schema(), num_experts=experts or None,
                                torch_dtype=torch.bfloat16, device=torch.cuda.current_device())


def _transform(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' codes uint8 [..., N, K/2] and scales uint8 [..., N, K/32] -> the same bytes in Humming's order
    (new tensors, flat uint8)."""
    from humming.transform import transform_humming_tensors
    n, k = data.shape[-2], 2 * data.shape[-1]
    # N and K need no padding; the scale bytes stay uint8 so that only byte moves touch them (the GEMM reads
    # them as E8M0 through a view)
    out = transform_humming_tensors(_layer_config(n, k, 0), {
        "weight": data.contiguous().view(torch.int32), "weight_scale": scale.contiguous()}, already_padded=True)
    if set(out) != {"weight", "weight_scale"}:
        raise RuntimeError(f"humming's MXFP4 W4A16 transform made {sorted(out)}; expected weight and weight_scale")
    w, s = out["weight"].view(torch.uint8).reshape(-1), out["weight_scale"].view(torch.uint8).reshape(-1)
    if w.numel() != data.numel() or s.numel() != scale.numel():
        raise RuntimeError("humming's MXFP4 W4A16 layout changed size; this adapter expects a permutation")
    return w, s


def convert(data: torch.Tensor, scale: torch.Tensor) -> HummingStack:
    """Stacked MXFP4 codes uint8 [E, N, K/2] and scales uint8 [E, N, K/32] on the GPU -> the same buffers
    rewritten in Humming's layout (in place: afterwards only `unpack` reads them correctly).

    The library's transform called on every expert took 7-10 s per V4.1-Flash layer on the H200 (~5 min for a
    40-layer rank), so its moves are learned once per shape (`_moves`) and applied as gathers, a few experts at a
    time. Expert 0 is checked against the library's own result first; if they differ, the library's transform
    does every expert."""
    E, n, k2 = data.shape
    k = 2 * k2
    if not (data.is_contiguous() and scale.is_contiguous() and scale.shape == (E, n, k // GROUP)):
        raise ValueError(f"convert: expected contiguous [E, N, K/2] codes and [E, N, K/32] scales, got "
                         f"{tuple(data.shape)} / {tuple(scale.shape)}")
    if n % 64 or k % 64:
        raise ValueError(f"humming needs N and K multiples of 64 (got N={n}, K={k})")
    src_c, src_s = _moves(n, k, data.device)

    def moved(e: int) -> tuple[torch.Tensor, torch.Tensor]:  # experts e..e+CHUNK in Humming's order, flat bytes
        d, sc = data[e:e + CHUNK], scale[e:e + CHUNK]
        codes = _nibbles(d.reshape(d.shape[0], -1)).index_select(1, src_c)
        return _pack(codes).reshape(-1), sc.reshape(sc.shape[0], -1).index_select(1, src_s).reshape(-1)
    lib_w, lib_s = _transform(data[0], scale[0])
    w0, s0 = moved(0)
    learned = torch.equal(w0[:lib_w.numel()], lib_w) and torch.equal(s0[:lib_s.numel()], lib_s)
    for e in range(0, E, CHUNK):
        w, s = moved(e) if learned else _transform(data[e:e + CHUNK], scale[e:e + CHUNK])
        data[e:e + CHUNK].view(-1).copy_(w)
        scale[e:e + CHUNK].view(-1).copy_(s)
    return HummingStack(n=n, k=k, weight=data.view(torch.int32).view(E, k // 16, 2 * n),
                        scale=scale.view(torch.float8_e8m0fnu).view(E, k // GROUP, n),
                        config=_layer_config(n, k, E),
                        locks=torch.zeros(2048, dtype=torch.int32, device=data.device))


def takes(w1: tuple, w3: tuple, w2: tuple) -> bool:
    """Whether the library takes a layer's stacked experts, each projection given as (kind, codes, scales) with
    codes [E, N, K/2]: MXFP4 on a CUDA device, in shapes its tiles fit (`supports`, w1 and w3 as one GEMM of
    N = 2I), with scale bytes it is known to decode exactly (`scales_supported`)."""
    (_, inter, half_d), (_, dim, half_i) = w1[1].shape, w2[1].shape
    return (all(kind == "mxfp4" and data.is_cuda for kind, data, _ in (w1, w3, w2))
            and supports(2 * inter, 2 * half_d) and supports(dim, 2 * half_i)
            and scales_supported(w1[2], w3[2], w2[2]))


@dataclass(eq=False)
class HummingExperts:
    """A layer's routed experts in Humming's layout, rewritten once at load (the library's quirk, kept here):
    w1 and w3 side by side in one stack for one GEMM of N = 2I (`side_by_side`), w2 alone, both converted in place
    (`convert`). Iterates as (w13, w2); `expert(i)` reads one expert back in the checkpoint layout."""
    w13: HummingStack
    w2: HummingStack

    @classmethod
    def convert(cls, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor]
                ) -> "HummingExperts":
        """From `side_by_side`'s (codes, scales) stack and w2's (codes, scales uint8), rewritten in place."""
        return cls(convert(*w13), convert(*w2))

    def __iter__(self):
        return iter((self.w13, self.w2))

    def expert(self, i: int) -> tuple[tuple, tuple, tuple]:
        """Expert i's (codes, scales) of w1, w3 and w2 in the checkpoint layout (new tensors)."""
        return unpack_expert(self.w13, self.w2, i)


def side_by_side(w1, w3) -> tuple[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """w1 and w3 of a layer's experts, each (codes uint8 [E, I, D/2], scales uint8 [E, I, D/32]), side by side in
    one [E, 2I, ...] stack for one GEMM with N = 2I (Humming's layout keeps every 64 rows of N in their own
    columns, so the two halves stay w1's and w3's after `convert`). Returns ((w1, w3) as views of the new stack,
    (codes, scales) of the stack); the caller drops the old buffers before converting the stack."""
    (d1, s1), (d3, s3) = w1, w3
    (E, I, half_d), groups = d1.shape, s1.shape[2]
    d13 = torch.empty(E, 2 * I, half_d, dtype=torch.uint8, device=d1.device)
    s13 = torch.empty(E, 2 * I, groups, dtype=torch.uint8, device=d1.device)
    for half, (d, sc) in ((slice(0, I), (d1, s1)), (slice(I, 2 * I), (d3, s3))):
        d13[:, half].copy_(d)
        s13[:, half].copy_(sc)
    return ((d13[:, :I], s13[:, :I]), (d13[:, I:], s13[:, I:])), (d13, s13)


def unpack_expert(w13: HummingStack, w2: HummingStack, i: int) -> tuple[tuple, tuple, tuple]:
    """Expert i of a layer's converted stacks (w13 from `side_by_side`) in the checkpoint layout again (new
    tensors): (codes, scales) of its w1, w3 and w2."""
    I = w13.n // 2
    (d13, s13), d2s2 = unpack(w13, i), unpack(w2, i)
    return (d13[:I], s13[:I]), (d13[I:], s13[I:]), d2s2


@functools.cache
def _moves(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where Humming's transform takes each code and scale byte of an [N, K] expert: for every position of the
    output, the index (int32) of the input element it holds. Learned from probes whose values are digits of the
    index (4 bits per probe for codes, 8 for scale bytes), and checked to be a permutation."""
    codes, scales = n * k, n * (k // GROUP)
    ic = torch.arange(codes, device=device, dtype=torch.int64)
    is_ = torch.arange(scales, device=device, dtype=torch.int64)
    src_c = torch.zeros(codes, dtype=torch.int64, device=device)
    src_s = torch.zeros(scales, dtype=torch.int64, device=device)
    for d in range(max(-(-(codes - 1).bit_length() // 4), -(-(scales - 1).bit_length() // 8), 1)):
        nib = ((ic >> (4 * d)) & 15).to(torch.uint8)
        probe_w = _pack(nib).view(n, k // 2)
        probe_s = ((is_ >> (8 * d)) & 255).to(torch.uint8).view(n, k // GROUP)
        w, s = _transform(probe_w, probe_s)
        src_c |= _nibbles(w).long() << (4 * d)
        src_s |= s.long() << (8 * d)
    for name, src in (("codes", src_c), ("scales", src_s)):
        if not torch.equal(torch.bincount(src, minlength=src.numel()), torch.ones_like(src)):
            raise RuntimeError(f"humming's transform does not permute the {name}; this adapter cannot convert "
                               "or read back experts (use MINI_MOE_GEMM=triton)")
    return src_c.int(), src_s.int()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., M] -> uint8 [..., 2M]: low nibble first (code 2i is the low half of byte i, as in the
    checkpoint)."""
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(*b.shape[:-1], -1)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of `_nibbles`: uint8 codes [..., 2M] -> bytes [..., M]."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(stack: HummingStack, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert i in the checkpoint layout again (new tensors): codes uint8 [N, K/2], scales uint8 [N, K/32]."""
    src_c, src_s = _moves(stack.n, stack.k, stack.weight.device)
    codes = torch.empty(src_c.numel(), dtype=torch.uint8, device=src_c.device)
    codes[src_c.long()] = _nibbles(stack.weight[i].view(torch.uint8).reshape(-1))
    scales = torch.empty(src_s.numel(), dtype=torch.uint8, device=src_s.device)
    scales[src_s.long()] = stack.scale[i].view(torch.uint8).reshape(-1)
    data = _pack(codes).view(stack.n, stack.k // 2)
    return data, scales.view(stack.n, stack.k // GROUP)


# Tile changes measured faster than the heuristic's config at decode and verify (tools/humming_decode_study.py,
# phase humming_decode, H200, docs/perf/020-021): (N, K, rows bucket) -> (the heuristic's keys it was measured
# against, the keys it replaces, or {"bucket": R}: the heuristic's config for R rows). Cases "P x R": P local rows,
# R rows on each touched expert (1 x 4: one emulated EP4 rank at B = 1; 6 x 1: a real EP4 rank's pairs at B = 1;
# 36 x 4: the emulated rank's verify step at B = 1).
# - w1|w3 [4608, 5120]: 64-column tiles instead of 128 (twice the CTAs where few experts are touched: 46.6 -> 33.2 us
#   at 6 x 1) and 6 pipeline stages instead of 4 (23.5 -> 20.9 us at 1 x 4, 33.2 -> 31.8 at 6 x 1, 55.1 -> 50.6 at
#   36 x 4). K is split between the same two warps: the same sums (bit-equal in the study).
# - w2 [5120, 2304]: the heuristic's wgmma tile spans all 256 columns (20 CTAs per touched expert); w1|w3's
#   mma.sync tile of 128 columns instead: 20.6 -> 12.4 us at 1 x 4 (64 columns: 12.1), 27.2 (64 columns) -> 22.9 at
#   6 x 1, 31.6 -> 23.5 at 36 x 4. Another summation order than wgmma's (one fp32 sum, one rounding either way).
# - Bucket 512 (B = 43-85 on the emulated rank), measured on the routing a B = 64 decode step recorded (phase
#   humming_step, docs/perf/026; ~60 touched experts, up to 24 rows on one): w1|w3 with 6 stages instead of 4
#   (296 -> 286 us), w2's wgmma tile with 16 rows instead of 8 (159 -> 150 us). Both the same sums (bit-equal).
# - Bucket 16 (decode at B <= 2 on the emulated rank), on the routing a B = 1 decode step recorded (docs/perf/026):
#   w1|w3 with 2 CTAs per SM instead of 4, 18.8 -> 16.2 us, bit-equal (at the B = 1 verify step's bucket it was
#   slower, 45.3 -> 51.4: not taken there).
DECODE_TILES = {(4608, 5120, bucket): ({"block_shape": [8, 128, 64], "warp_shape": [8, 64, 32], "mma_type": "mma"},
                                       {"block_shape": [8, 64, 64], "num_stages": 6,
                                        **({"num_ctas_per_sm": 2} if bucket == 16 else {})})
                for bucket in (16, 32, 64)}
DECODE_TILES.update({(5120, 2304, bucket): ({"block_shape": [8, 256, 64], "mma_type": "wgmma"},
                                            {"block_shape": [8, 128, 64], "warp_shape": [8, 64, 32], "mma_type": "mma"})
                     for bucket in (16, 32, 64)})
DECODE_TILES[4608, 5120, 512] = ({"block_shape": [8, 128, 64], "warp_shape": [8, 64, 32], "mma_type": "mma",
                                  "num_stages": 4}, {"num_stages": 6})
DECODE_TILES[5120, 2304, 512] = ({"block_shape": [8, 256, 64], "warp_shape": [8, 64, 64], "mma_type": "wgmma"},
                                 {"block_shape": [16, 256, 64], "warp_shape": [16, 64, 64]})
# - Bucket 128 (decode at B = 11-21 on the emulated rank), on the routing a B = 16 spec-decode step recorded
#   (docs/perf/029; ~23 touched experts): w1|w3 with 6 stages (113.4 -> 109.2 us, bit-equal).
# - Bucket 1024 keeps the heuristic's 16-row wgmma tile. Bucket 2048's 32-row tile there was faster only on a
#   verify step whose rows repeated the next sequences' tokens (32 touched experts at B = 16); decode at B = 128
#   (84 touched) ran both GEMMs 6% slower in it (docs/perf/030).
DECODE_TILES[4608, 5120, 128] = (DECODE_TILES[4608, 5120, 512][0], {"num_stages": 6})
# - Bucket 4096 where the heuristic takes a 96-row wgmma tile (a layer of 48 local experts, one emulated EP8 rank: it
#   sizes the tile for 4,096 / 48 rows an expert, twice the ~48 a B = 64 x 6 verify step's 2,304 rows put there):
#   bucket 2048's config instead ({"bucket": 2048}: the heuristic's own config for 2,048 rows), on the routing that
#   verify step recorded (tools/humming_decode_study.py, phase humming_step, H100, docs/perf/039): w1|w3 441.8 ->
#   418.6 us, w2 236.3 -> 214.4, bit-equal (the row tile changes no row's sums). At 96 experts (EP4) the heuristic's
#   bucket 4096 tile is 56 rows, which report 026 kept over bucket 2048's: not this entry's config.
for _shape in ((4608, 5120), (5120, 2304)):
    DECODE_TILES[(*_shape, 4096)] = ({"block_shape": [96, 256, 64], "mma_type": "wgmma"}, {"bucket": 2048})
# - Keys with a fourth entry hold at that count of experts only, before the key without it. Bucket 1024 at 128
#   experts (DSpark's draft MoE at B = 64: 960 rows, ~100 of its 128 experts touched, ~10 rows each): bucket 2048's
#   config, 4-6% faster than the heuristic's 16-row wgmma tile in each of five one-key variants of it (w1|w3 719.7
#   -> 677.6-698.6 us, w2 373.7 -> 351.2-358.0), bit-equal, on the routing a B = 64 spec-decode step recorded
#   (phase humming_step, H100, docs/perf/040). The main layers' bucket 1024 (48 or 96 local experts) keeps its tile.
for _shape in ((4608, 5120), (5120, 2304)):
    DECODE_TILES[(*_shape, 1024, 128)] = ({"block_shape": [16, 256, 64], "mma_type": "wgmma"}, {"bucket": 2048})


@functools.cache
def _tuning(config, rows: int, invariant: bool = False, tuned: bool = True) -> str:
    """Humming's SM90 heuristic tile config for `rows` rows, without stream-K (see the module docstring).

    The heuristic's configs differ by row count in more than the row tile: for few rows (buckets up to 64-128 at
    V4.1-Flash's shapes) it takes mma.sync tiles whose K is split between two warps and summed through shared
    memory, from 128-256 rows wgmma tiles with one K partition. A row of an expert therefore rounds differently
    when the expert has few rows (decode, or a rank's share under EP) than when it has many. `invariant` (the
    deterministic mode) asks the library for its batch-invariant schedule instead: one K partition of a fixed
    width (64 for bf16 activations) and no stream-K at every row count; only the row tile still follows the
    rows, which changes no row's sums. `tuned` (outside the deterministic mode): DECODE_TILES' change where the
    heuristic's config is the one it was measured against."""
    from humming.config import GemmType
    from humming.tune import get_heuristics_config
    tuning = json.loads(json.dumps(get_heuristics_config(config, shape_m=rows, gemm_type=GemmType.GROUPED_CONTIGUOUS,
                                                         use_batch_invariant=invariant)))  # tuples as lists
    tuning["use_stream_k"] = False
    shape = (config.shape_n, config.shape_k, rows)
    measured_on, change = DECODE_TILES.get((*shape, config.num_experts), DECODE_TILES.get(shape, ({}, {})))
    if tuned and not invariant and change and all(tuning.get(k) == v for k, v in measured_on.items()):
        if "bucket" in change:  # the heuristic's config for another row count
            return _tuning(config, change["bucket"], invariant, tuned)
        tuning.update(change)
    return json.dumps(tuning)


def rows_bucket(expected_rows: int) -> int:
    """The row count a tile config is chosen (and compiled) for: the expected count rounded up to a power of 2."""
    return 1 << max(4, (max(expected_rows, 1) - 1).bit_length())


def tuning_for(stack: HummingStack, expected_rows: int, invariant: bool = False, tuned: bool = True) -> str:
    """The tile config (JSON) the GEMM takes for about `expected_rows` rows (`invariant`, `tuned`: see
    `_tuning`)."""
    return _tuning(stack.config, rows_bucket(expected_rows), invariant, tuned)


def grouped_gemm(a: torch.Tensor, stack: HummingStack, expert_offset: torch.Tensor, expected_rows: int,
                 out: torch.Tensor | None = None, tuning: str | None = None, invariant: bool = False
                 ) -> torch.Tensor:
    """a bf16 [R, K] rows sorted by expert, expert_offset int32 [E+1] -> out bf16 [R, N] = a W_e^T for the rows
    of each expert e (rows past expert_offset[E] are left unwritten). `tuning` (JSON) overrides the tile config;
    `invariant` takes the library's batch-invariant schedule (the deterministic mode, see `_tuning`)."""
    from humming import ops
    if a.dtype != torch.bfloat16 or a.shape[1] != stack.k or a.stride(1) != 1:
        raise ValueError(f"grouped_gemm: expected row-major bf16 [R, {stack.k}], got {a.dtype} {tuple(a.shape)}")
    if expert_offset.shape != (stack.experts + 1,):
        raise ValueError(f"grouped_gemm: expert_offset must have {stack.experts + 1} entries")
    out = torch.empty(a.shape[0], stack.n, dtype=torch.bfloat16, device=a.device) if out is None else out
    if a.shape[0] == 0:
        return out
    bucket = rows_bucket(expected_rows)
    return ops.humming_gemm(layer_config=stack.config.to_str(),
                            compute_config=INVARIANT_COMPUTE_CONFIG if invariant else COMPUTE_CONFIG,
                            tuning_config=tuning or _tuning(stack.config, bucket, invariant), inputs=a,
                            weight=stack.weight,
                            weight_scale=stack.scale, outputs=out, expert_layout=expert_offset,
                            locks=stack.locks, valid_shape_m=bucket)


def warm_up(jobs: list[tuple[HummingStack, str]]) -> dict[str, str]:
    """Compile the kernels of (stack, tile config) pairs side by side (one at a time at first use otherwise; each
    takes seconds). Returns the error of each config that did not build, by its JSON."""
    from concurrent.futures import ThreadPoolExecutor

    from humming.kernel.humming import HummingKernel
    keys = {(st.config.to_str(), tuning) for st, tuning in jobs}
    dev = torch.cuda.current_device()

    def prepare(key):
        try:
            with torch.cuda.device(dev):
                HummingKernel.prepare_kernels(key[0], COMPUTE_CONFIG, key[1], dev)  # what humming_gemm looks up
        except Exception as e:  # a hand-made config the kernel does not support: report, keep the others
            return key[1], f"{type(e).__name__}: {str(e)[:200]}"
        return key[1], None
    with ThreadPoolExecutor(max_workers=max(1, len(keys))) as pool:
        return {tuning: err for tuning, err in pool.map(prepare, keys) if err is not None}
