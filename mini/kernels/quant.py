"""The Triton quantization toolbox: fake quantization inside kernels, the same formulas as mini/formats/quant.py,
applied to a register tile so that a producer (norm, RoPE, a GEMM epilogue, the activation quant) writes
already-quantized values. Every Triton kernel that rounds to FP8 / FP4 takes its helpers from here:
* `e4m3_round`, `e2m1_round`: round fp32 to the nearest e4m3 / E2M1 value, ties to even;
* `fp8_group_quant`: FP8 e4m3 with power-of-two (ue8m0) scales, 1 x BLOCK groups of a [ROWS, GROUPS·BLOCK] tile
  (`fp8_group_codes`: its scaled values and scale bytes, for a kernel that writes the FP8 form itself);
* `fake_quant_tile`: a tile [ROWS, BLOCK·n] by `kind` (fp8, fp4 with ue8m0 or e4m3 scales; host codes from
  `kind_code`), each row's consecutive BLOCK channels sharing one scale;
* `e4m3_value`, `e2m1_value`, `e8m0_value`: the stored bytes' fp32 values (FP8 codes, FP4 codes, E8M0 scales), as
  mini/formats decodes them.

Scale rounding reproduces `pow2_ceil_scale` from the fp32 bits (exponent + (mantissa != 0)). Rounding is written
with bit arithmetic rather than a cast, so that it rounds the same everywhere (Triton's interpreter casts to fp8
with ties away from zero and without rounding carries).
"""
import triton
import triton.language as tl

# `kind` codes shared by the host wrappers
NONE, FP8_UE8M0, FP4_UE8M0, FP4_E4M3 = 0, 1, 2, 3
_KIND = {None: NONE, "fp8": FP8_UE8M0, "fp4_ue8m0": FP4_UE8M0, "fp4_e4m3": FP4_E4M3}


def kind_code(kind: str | None) -> int:
    if kind not in _KIND:
        raise ValueError(f"unknown fake-quant kind {kind!r}; choose one of {list(_KIND)}")
    return _KIND[kind]


@triton.jit
def _pow2_ceil(x):
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(c):
    """fp32 value of e4m3fn bytes `c` (uint8): the hardware conversion (2 bytes per instruction on SM90), with 0x7F /
    0xFF made NaN as torch decodes them (Triton's interpreter reads them as +-480)."""
    v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.where((c & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def e2m1_value(code):
    """4-bit E2M1 codes (int32) -> their fp32 values, exact and without branches: the magnitude bits land on the
    fp32 exponent's low bits and the mantissa's top bit (value * 2^-126; code 1 becomes the denormal 2^-127), then
    one exact multiply by 2^126. Times e8m0_value(s) it is the MXFP4 weight, exact wherever fp32 holds it (one
    multiply by 2^(s-1) would overflow above byte 128)."""
    return (((code & 7) << 22) | ((code & 8) << 28)).to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def e8m0_value(s):
    """E8M0 bytes (int32 0..255) -> fp32 2^(s-127): bits s << 23 for 1..254, the denormal 2^-127 for 0, NaN for 255
    (mini/formats/e8m0.py)."""
    bits = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_round(v):
    """fp32 v (|v| <= 448) -> the nearest e4m3 value, ties to even, as fp32 (subnormals below 2^-6, spacing 2^-9)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits (mask 0xFFF00000)
    sub = (v * 512.0 + 12582912.0) - 12582912.0  # below 2^-6 the step is 2^-9: round v * 2^9 to an integer
    return tl.where(tl.abs(v) < 0.015625, sub * (1.0 / 512.0), normal.to(tl.float32, bitcast=True))


@triton.jit
def e2m1_round(v):
    """Nearest E2M1 value of v (|v| <= 6), ties to the even code: 0.25, 1.25, 2.5, 5 round down; 0.75, 1.75, 3.5 up."""
    a = tl.abs(v)
    q = tl.where(a <= 0.25, 0.0, tl.where(a < 0.75, 0.5, tl.where(a <= 1.25, 1.0, tl.where(
        a < 1.75, 1.5, tl.where(a <= 2.5, 2.0, tl.where(a < 3.5, 3.0, tl.where(a <= 5.0, 4.0, 6.0)))))))
    return tl.where(v < 0, -q, q)


@triton.jit
def fp8_group_codes(v, GROUPS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """The two halves of `fp8_group_quant`: (a [ROWS, GROUPS, BLOCK] = clamp(v / s, ±448) before rounding, e
    [ROWS, GROUPS] int32 = the E8M0 byte of s). e4m3_round(a) * 2^(e - 127) is the fake-quantized value; the EP
    exchange sends a's e4m3 byte and e instead (mini/kernels/fp8_act_quant.py)."""
    g = tl.reshape(v, [ROWS, GROUPS, BLOCK])
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), 1e-4) * (1.0 / 448.0)
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return tl.clamp(g * inv[:, :, None], -448.0, 448.0), e


@triton.jit
def fp8_group_quant(v, GROUPS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Fake-quantize fp32 `v` [ROWS, GROUPS * BLOCK] in groups of BLOCK consecutive columns; returns fp32.
    s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(clamp(v / s, ±448)), out = q * s: the division and the product
    by a power of two are exact (v times 2^-e), so the only rounding is the e4m3 one."""
    a, e = fp8_group_codes(v, GROUPS, BLOCK, ROWS)
    scale = (e << 23).to(tl.float32, bitcast=True)
    return tl.reshape(e4m3_round(a) * scale[:, :, None], [ROWS, GROUPS * BLOCK])


@triton.jit
def fake_quant_tile(x, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr):
    """x [ROWS, COLS] fp32 -> fake-quantized fp32 (KIND: 1 fp8/ue8m0, 2 fp4/ue8m0, 3 fp4/e4m3; 0 = identity).
    Written as one if/else on the constexpr KIND: the compiler then never builds the block reshape for KIND 0,
    which a tile narrower than BLOCK could not do (an early `return` does not stop it)."""
    if KIND == 0:
        out = x
    elif KIND == 1:
        out = fp8_group_quant(x, COLS // BLOCK, BLOCK, ROWS)
    else:
        g = tl.reshape(x, [ROWS, COLS // BLOCK, BLOCK])
        amax = tl.max(tl.abs(g), axis=2)
        if KIND == 2:
            s = _pow2_ceil(tl.maximum(amax, 6.0 * 2.0 ** -126) * (1.0 / 6.0))
        else:
            s = e4m3_round(tl.minimum(tl.maximum(amax, 6.0 * 2.0 ** -9) / 6.0, 448.0))
        v = e2m1_round(tl.clamp(g / s[:, :, None], -6.0, 6.0))
        out = tl.reshape(v * s[:, :, None], [ROWS, COLS])
    return out
