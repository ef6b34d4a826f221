"""FP8 e4m3 activation fake quantization, 1 x block groups with power-of-two (ue8m0) scales, in one pass.

Same function as `mini.formats.fake_quant_fp8` (the tile math: mini.kernels.quant.fp8_group_quant), out in x's
dtype; optionally gathering rows by index first (the routed experts' rows in expert order).

The EP exchange's wire form (mini/parallel/exchange.py) is the same quantization kept as bytes: per row the e4m3
codes (uint8 [D]) and E8M0 scale bytes (uint8 [D / block]), the bytes of `exchange.encode_fp8`.
* `fp8_act_quant_wire` quantizes straight into views of the send buffer and, in the same pass, writes the routing
  ids and weights into their own views of the same rows (no separate pack);
* `fp8_act_quant` of `FP8Rows` (received rows) decodes them, gathered by index like any input: fake quantization
  is idempotent, so the act quant of decoded rows is their decode, and the gather + quant pass in front of the
  routed experts' GEMMs becomes a gather + decode pass of the same shape (reading 1 byte per element, not 2).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mini.kernels.device_info import looped_row_programs
from mini.kernels.quant import e4m3_round, e4m3_value, fp8_group_codes, fp8_group_quant


@dataclass(frozen=True)
class FP8Rows:
    """Rows in the FP8 wire form, standing for `fake_quant_fp8(x, block)` in `dtype`: e4m3 codes uint8 [N, D] and
    E8M0 scale bytes uint8 [N, D / block], each with unit column stride (typically views into the rows of one
    received byte buffer)."""
    codes: torch.Tensor
    scales: torch.Tensor
    block: int
    dtype: torch.dtype

    def __post_init__(self):
        n, d = self.codes.shape
        if (self.codes.dtype != torch.uint8 or self.scales.dtype != torch.uint8 or self.block <= 0 or d % self.block
                or self.scales.shape != (n, d // self.block) or self.codes.stride(1) != 1
                or self.scales.stride(1) != 1):
            raise ValueError(f"FP8Rows: codes uint8 [N, D] and scales uint8 [N, D/{self.block}] with unit column "
                             f"stride, got {self.codes.dtype} {tuple(self.codes.shape)} and {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device


TILE_ROWS = 4  # rows a program's tile takes in the passes below (their columns: up to 512, whole groups)


def _tiles(R: int, D: int, block: int, device: torch.device, gathered: bool) -> tuple[int, tuple[int, int]]:
    """(groups a tile, grid) of a pass over R rows x D columns in `block`-wide groups: a row tile a program, or
    where the rows are gathered up to a count on the device one wave that loops (`looped_row_programs`)."""
    groups = max(1, min(512 // block, triton.next_power_of_2(D // block)))
    row_tiles, col_tiles = triton.cdiv(R, TILE_ROWS), triton.cdiv(D, groups * block)
    return groups, (looped_row_programs(row_tiles, col_tiles, device) if gathered else row_tiles, col_tiles)


@triton.jit
def _act_quant_kernel(x_ptr, out_ptr, src_row_ptr, n_valid_ptr, n_rows, n_cols, stride_x, stride_out,
                      BLOCK: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr, GATHER: tl.constexpr,
                      QUANT: tl.constexpr):
    n_tiles = tl.num_programs(0)  # a row tile a program
    if GATHER:  # the row count lives on the device (no host sync): the programs loop up to it (looped_row_programs)
        n_rows = tl.load(n_valid_ptr)
        n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.program_id(1) * (GROUPS * BLOCK) + tl.arange(0, GROUPS * BLOCK)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        src = rows
        if GATHER:
            src = tl.load(src_row_ptr + rows, mask=rows < n_rows, other=0)
        v = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        q = v.to(tl.float32)
        if QUANT:
            q = fp8_group_quant(q, GROUPS, BLOCK, ROWS)
        r64 = rows.to(tl.int64)[:, None]
        tl.store(out_ptr + r64 * stride_out + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_act_quant(x: torch.Tensor, block: int, out: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                  n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] (D a multiple of `block`) -> fake-quantized [T, D] in x.dtype.

    With `rows` (int [R]) and `n_valid` (a one-element int tensor on the device): out [R, D] with
    out[r] = fake_quant(x[rows[r]]) for r < n_valid; rows past it are left unwritten. block = 0 copies the rows
    without quantizing (activation fake quant switched off).

    x may also be `FP8Rows` (rows received in the FP8 wire form, quantized at `block`): they are decoded, which is
    what quantizing their values again gives."""
    if isinstance(x, FP8Rows):
        if block != x.block:
            raise ValueError(f"fp8_act_quant: rows quantized at block {x.block} cannot be re-quantized at block "
                             f"{block} exactly (with the activation fake quant off, raw rows travel instead)")
        if (rows is None) != (n_valid is None):
            raise ValueError("fp8_act_quant: pass rows and n_valid together")
        return _decode(x, out, rows, n_valid)
    if x.dim() != 2 or (block and x.shape[1] % block):
        raise ValueError(f"fp8_act_quant takes [T, D] with D a multiple of {block}, got {tuple(x.shape)}")
    if (rows is None) != (n_valid is None) or (rows is None and not block):
        raise ValueError("fp8_act_quant: pass rows and n_valid together; block 0 only with rows")
    x = x if x.stride(1) == 1 else x.contiguous()
    T, D = x.shape
    R = T if rows is None else rows.numel()
    out = torch.empty(R, D, dtype=x.dtype, device=x.device) if out is None else out
    if R == 0:
        return out
    group = block or 32
    groups, grid = _tiles(R, D, group, x.device, gathered=rows is not None)
    _act_quant_kernel[grid](x, out, rows if rows is not None else x, n_valid if n_valid is not None else x,
                            R, D, x.stride(0), out.stride(0), BLOCK=group, GROUPS=groups, ROWS=TILE_ROWS,
                            GATHER=rows is not None, QUANT=block > 0)
    return out


# ---------------------------------------------------------------------------------------------------- wire form
@triton.jit
def _e4m3_byte(a):
    """The e4m3fn byte of fp32 `a` (|a| <= 448), rounded to nearest even as `e4m3_round`; the sign is a's own, also
    when it rounds to zero (torch's float8 cast gives -0 there, and the wire must equal `encode_fp8`'s bytes)."""
    m = tl.abs(e4m3_round(a))
    bits = m.to(tl.int32, bitcast=True)
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)  # exponent rebiased 127 -> 7, 3 mantissa bits
    code = tl.where(m < 0.015625, (m * 512.0).to(tl.int32), normal)  # subnormal: m = code * 2^-9
    return code | ((a.to(tl.int32, bitcast=True) >> 24) & 0x80)


@triton.jit
def _wire_encode_kernel(x_ptr, codes_ptr, scales_ptr, ids_ptr, wts_ptr, ids_out_ptr, wts_out_ptr,
                        n_rows, n_out, n_cols, k, stride_x, stride_codes, stride_scales, stride_ids, stride_wts,
                        stride_ids_out, stride_wts_out, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
                        ROWS: tl.constexpr, KP: tl.constexpr, ROUTING: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * (GROUPS * BLOCK) + tl.arange(0, GROUPS * BLOCK)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    r64 = rows.to(tl.int64)[:, None]
    out_ok = rows[:, None] < n_out  # rows n_rows..n_out: padding, the bytes of zero rows
    v = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols),
                other=0.0).to(tl.float32)
    a, e = fp8_group_codes(v, GROUPS, BLOCK, ROWS)
    codes = tl.reshape(_e4m3_byte(a), [ROWS, GROUPS * BLOCK])
    tl.store(codes_ptr + r64 * stride_codes + cols[None, :], codes.to(tl.uint8),
             mask=out_ok & (cols[None, :] < n_cols))
    tl.store(scales_ptr + r64 * stride_scales + groups[None, :], (e & 0xFF).to(tl.uint8),
             mask=out_ok & (groups[None, :] < n_cols // BLOCK))
    if ROUTING:
        if tl.program_id(1) == 0:  # one program per row block writes the rows' routing; padding rows route nowhere
            j = tl.arange(0, KP)[None, :]
            mine = (rows[:, None] < n_rows) & (j < k)
            ids = tl.load(ids_ptr + r64 * stride_ids + j, mask=mine, other=-1).to(tl.int32)
            wts = tl.load(wts_ptr + r64 * stride_wts + j, mask=mine, other=0.0).to(tl.float32)
            tl.store(ids_out_ptr + r64 * stride_ids_out + j, ids, mask=out_ok & (j < k))
            tl.store(wts_out_ptr + r64 * stride_wts_out + j, wts, mask=out_ok & (j < k))


def _unit_cols(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or (t.numel() and t.stride(1) != 1):
        raise ValueError(f"fp8_act_quant_wire: {name} must be {dtype} {list(shape)} with unit column stride, "
                         f"got {t.dtype} {list(t.shape)}")


def fp8_act_quant_wire(x: torch.Tensor, block: int, codes: torch.Tensor, scales: torch.Tensor,
                       ids: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                       ids_out: torch.Tensor | None = None, weights_out: torch.Tensor | None = None) -> None:
    """x [T, D] -> its FP8 wire form (= exchange.encode_fp8's bytes), written into `codes` (uint8 [N, D]) and
    `scales` (uint8 [N, D / block]), N >= T: rows T..N are padding (the bytes of zero rows). With ids (int [T, k])
    and weights (float [T, k]), the same pass copies them into ids_out (int32 [N, k]) and weights_out
    (fp32 [N, k]), padding rows getting id -1 (no expert) and weight 0. The outputs are typically strided views
    into the rows of one send buffer."""
    if x.dim() != 2 or block <= 0 or x.shape[1] % block:
        raise ValueError(f"fp8_act_quant_wire takes [T, D] with D a multiple of {block}, got {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    T, D = x.shape
    N = codes.shape[0]
    if N < T:
        raise ValueError(f"fp8_act_quant_wire: {N} output rows for {T} input rows")
    _unit_cols("codes", codes, torch.uint8, (N, D))
    _unit_cols("scales", scales, torch.uint8, (N, D // block))
    routing = ids is not None
    if not (routing == (weights is not None) == (ids_out is not None) == (weights_out is not None)):
        raise ValueError("fp8_act_quant_wire: pass ids, weights, ids_out and weights_out together")
    k = ids.shape[1] if routing else 0
    if routing:
        if ids.shape != (T, k) or weights.shape != (T, k) or (T and (ids.stride(1) != 1 or weights.stride(1) != 1)):
            raise ValueError(f"fp8_act_quant_wire: ids and weights must be [{T}, k] with unit column stride")
        _unit_cols("ids_out", ids_out, torch.int32, (N, k))
        _unit_cols("weights_out", weights_out, torch.float32, (N, k))
    if N == 0:
        return
    groups, grid = _tiles(N, D, block, codes.device, gathered=False)
    # placeholders where nothing is read (no routing; a rank without tokens, whose empty tensors have no storage)
    # (of the same dtypes: a masked load's `other` is cast to the pointer's type)
    r = (ids if T else ids_out, weights if T else weights_out, ids_out, weights_out) if routing else (codes,) * 4
    _wire_encode_kernel[grid](
        x if T else codes, codes, scales, *r, T, N, D, k, x.stride(0), codes.stride(0), scales.stride(0),
        *((t.stride(0) for t in r) if routing else (0,) * 4),
        BLOCK=block, GROUPS=groups, ROWS=TILE_ROWS, KP=triton.next_power_of_2(max(k, 1)), ROUTING=routing)


@triton.jit
def _wire_decode_kernel(codes_ptr, scales_ptr, out_ptr, src_row_ptr, n_valid_ptr, n_rows, n_cols, stride_codes,
                        stride_scales, stride_out, BLOCK: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr,
                        GATHER: tl.constexpr):
    n_tiles = tl.num_programs(0)
    if GATHER:  # as _act_quant_kernel: the row count lives on the device, the programs loop up to it
        n_rows = tl.load(n_valid_ptr)
        n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.program_id(1) * (GROUPS * BLOCK) + tl.arange(0, GROUPS * BLOCK)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows[:, None] < n_rows
        src = rows
        if GATHER:
            src = tl.load(src_row_ptr + rows, mask=rows < n_rows, other=0)
        s64 = src.to(tl.int64)[:, None]
        ok = row_ok & (cols[None, :] < n_cols)
        c = tl.load(codes_ptr + s64 * stride_codes + cols[None, :], mask=ok, other=0)
        # one scale byte per group, broadcast over its BLOCK values (sm_90a PTX: leaner than a load per element)
        e = tl.load(scales_ptr + s64 * stride_scales + groups[None, :],
                    mask=row_ok & (groups[None, :] < n_cols // BLOCK), other=127).to(tl.int32)
        scale = tl.where(e == 255, float("nan"), (e << 23).to(tl.float32, bitcast=True))  # bytes 1..254: exact
        v = tl.reshape(tl.reshape(e4m3_value(c), [ROWS, GROUPS, BLOCK]) * scale[:, :, None], [ROWS, GROUPS * BLOCK])
        r64 = rows.to(tl.int64)[:, None]
        tl.store(out_ptr + r64 * stride_out + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=ok)


def _decode(src: FP8Rows, out: torch.Tensor | None, rows: torch.Tensor | None,
            n_valid: torch.Tensor | None) -> torch.Tensor:
    """fp8_act_quant of rows already in the wire form: their decode (= exchange.decode_fp8), optionally gathered.
    Scale byte 0 (2^-127) is outside what the encoder writes (its scales are >= 2^-22) and is not decoded."""
    T, D = src.shape
    R = T if rows is None else rows.numel()
    out = torch.empty(R, D, dtype=src.dtype, device=src.device) if out is None else out
    if R == 0:
        return out
    block = src.block
    groups, grid = _tiles(R, D, block, src.device, gathered=rows is not None)
    _wire_decode_kernel[grid](src.codes, src.scales, out, rows if rows is not None else src.codes,
                              n_valid if n_valid is not None else src.codes, R, D, src.codes.stride(0),
                              src.scales.stride(0), out.stride(0), BLOCK=block, GROUPS=groups, ROWS=TILE_ROWS,
                              GATHER=rows is not None)
    return out
