"""Independent float64 numpy re-derivations of the number formats, written from the spec's definitions (not
from mini.formats): used as the oracle of the format tests."""
import numpy as np

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e8m0_value(e):
    """Byte e -> 2^(e-127) as float64; 255 -> NaN."""
    e = np.asarray(e, dtype=np.int64)
    return np.where(e == 255, np.nan, np.ldexp(1.0, np.minimum(e, 254) - 127))


def e2m1_value(code):
    """4-bit code -> value from its fields: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0."""
    code = np.asarray(code, dtype=np.int64)
    sign = np.where(code & 8, -1.0, 1.0)
    exp, man = (code >> 1) & 3, code & 1
    mag = np.where(exp == 0, man * 0.5, np.ldexp(1.0 + man / 2.0, exp - 1))
    return sign * mag


def e4m3_value(byte):
    """float8_e4m3fn byte -> value: bias 7, subnormals at exponent 0, 0x7F/0xFF NaN."""
    b = np.asarray(byte, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 15, b & 7
    mag = np.where(exp == 0, np.ldexp(man / 8.0, -6), np.ldexp(1.0 + man / 8.0, exp - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * mag)


def round_to_grid(v, mantissa_bits, min_normal_exp):
    """Round-to-nearest-even onto a binary float grid with `mantissa_bits` and subnormals below 2^min_normal_exp
    (no overflow handling: callers clamp first). Exact in float64 for the small formats used here."""
    v = np.asarray(v, dtype=np.float64)
    mag = np.abs(v)
    exp = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    exp = np.maximum(exp, min_normal_exp)
    quantum = np.ldexp(1.0, (exp - mantissa_bits).astype(np.int64))
    return np.copysign(np.round(mag / quantum) * quantum, v)  # np.round: half to even


def e4m3_round(v):
    return round_to_grid(np.clip(v, -448.0, 448.0), 3, -6)


def e2m1_round(v):
    return round_to_grid(np.clip(v, -6.0, 6.0), 1, 0)


def pow2_ceil(x):
    """2^ceil(log2(x)) for positive x, exact (frexp gives x = m * 2^e with m in [0.5, 1))."""
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.where(m == 0.5, np.ldexp(1.0, e - 1), np.ldexp(1.0, e))


def f32(x):
    return np.asarray(x, dtype=np.float32)
