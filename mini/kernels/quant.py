"""Fake quantization inside Triton kernels, the same formulas as mini/formats/quant.py, applied to a register tile
so that a producer (norm, RoPE) writes already-quantized values. Tiles are [ROWS, BLOCK*n]; each row's consecutive
BLOCK channels share one scale.

Scale rounding reproduces `pow2_ceil_scale` from the fp32 bits (exponent + (mantissa != 0)).
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
def _e4m3_round(v):
    """Nearest float8 e4m3fn value of v (|v| <= 448), ties to even, subnormals below 2^-6 (spacing 2^-9). Done in fp32
    arithmetic: Triton's interpreter converts to fp8 without rounding carries, so a hardware cast would leave the
    CPU tests unable to check this path."""
    bits = tl.abs(v).to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # spacing of e4m3 values in v's binade
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |x| < 2^22 to an integer, ties to even
    return ((v / step + magic) - magic) * step


@triton.jit
def _e2m1_round(v):
    """Nearest E2M1 value of v (|v| <= 6), ties to the even code: 0.25, 1.25, 2.5, 5 round down; 0.75, 1.75, 3.5 up."""
    a = tl.abs(v)
    q = tl.where(a <= 0.25, 0.0, tl.where(a < 0.75, 0.5, tl.where(a <= 1.25, 1.0, tl.where(
        a < 1.75, 1.5, tl.where(a <= 2.5, 2.0, tl.where(a < 3.5, 3.0, tl.where(a <= 5.0, 4.0, 6.0)))))))
    return tl.where(v < 0, -q, q)


@triton.jit
def fake_quant_tile(x, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr):
    """x [ROWS, COLS] fp32 -> fake-quantized fp32 (KIND: 1 fp8/ue8m0, 2 fp4/ue8m0, 3 fp4/e4m3; 0 = identity).
    Written as one if/else on the constexpr KIND: the compiler then never builds the block reshape for KIND 0,
    which a tile narrower than BLOCK could not do (an early `return` does not stop it)."""
    if KIND == 0:
        out = x
    else:
        g = tl.reshape(x, [ROWS, COLS // BLOCK, BLOCK])
        amax = tl.max(tl.abs(g), axis=2)
        if KIND == 1:
            s = _pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
            v = _e4m3_round(tl.clamp(g / s[:, :, None], -448.0, 448.0))
        elif KIND == 2:
            s = _pow2_ceil(tl.maximum(amax, 6.0 * 2.0 ** -126) * (1.0 / 6.0))
            v = _e2m1_round(tl.clamp(g / s[:, :, None], -6.0, 6.0))
        else:
            s = _e4m3_round(tl.minimum(tl.maximum(amax, 6.0 * 2.0 ** -9) / 6.0, 448.0))
            v = _e2m1_round(tl.clamp(g / s[:, :, None], -6.0, 6.0))
        out = tl.reshape(v * s[:, :, None], [ROWS, COLS])
    return out
