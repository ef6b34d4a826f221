"""bf16 in Triton's CPU interpreter, for tests: `patch_bf16()` makes Triton 3.6's interpreter (TRITON_INTERPRET=1)
compute bf16 tiles the way a GPU does, so that the fast path's kernels can be checked on a CPU in the activation
dtype they run in on the GPU.

The interpreter stores bf16 as raw uint16 bits and, as shipped, (a) multiplies, adds, compares and reduces those
bits as integers (a bf16 `tl.dot` returns ~1e10 for unit inputs; `tl.maximum(x, 0.0)` keeps negative values),
and (b) casts fp32 to bf16 by truncation. The patch decodes bf16 operands to fp32 for every floating-point
operation (arithmetic, comparisons, min/max, clamps, math functions, dot, reductions) and rounds fp32 results to
bf16 to nearest even, as the GPU's cvt.rn.bf16.f32 does. Every floating-point dot (bf16 and fp32 operands) sums
in float64 and rounds once to its accumulator's dtype: numpy's fp32 matmul flushes denormal results to zero,
which an MMA does not (the MXFP4 decode tests reach 2^-128). Bit-level
operations (loads, stores, bitcasts, selects, reshapes) are untouched. It also lets a computed scalar bound a loop
under Triton 3.6 with numpy 2 (`_patch_scalar_index`). Applied once per process by
`mini.ops.set_backend(..., interpret_on_cpu=True)` and by the kernel tests; compiled kernels never see it.
"""
from __future__ import annotations

import numpy as np
import torch

_PATCHED = False


def to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> fp32 values, exact."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 (or any float/int) values -> bf16 bits (uint16), rounded to nearest even (NaN stays NaN)."""
    x = np.asarray(x)
    t = torch.from_numpy(np.ascontiguousarray(x.astype(np.float32)).reshape(-1)).bfloat16()
    return t.view(torch.int16).numpy().view(np.uint16).reshape(x.shape)


def patch_bf16() -> None:
    """Install the bf16 semantics into Triton's interpreter (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    B = ti.InterpreterBuilder
    bf16 = tl.bfloat16

    def scalar(h):
        return h.dtype.scalar if hasattr(h.dtype, "scalar") else h.dtype

    def value(h):  # a handle's data as numbers: bf16 decoded, others as stored
        return to_f32(h.data) if scalar(h) == bf16 else h.data

    binary_op = B.binary_op

    def patched_binary(self, lhs, rhs, op):
        if scalar(lhs) != bf16 and scalar(rhs) != bf16:
            out = binary_op(self, lhs, rhs, op)
            # A comparison's result is int1. The shipped builder tags it with the operands' dtype; Triton 3.9's
            # splat then widens a scalar comparison (`e >= lo` with e loaded) to that dtype, and a mask made
            # with it reaches the C++ load as int32 ('mask has unsupported dtype').
            return ti.TensorHandle(out.data, tl.int1) if out.data.dtype == np.bool_ else out
        out = op(value(lhs), value(rhs))
        if out.dtype == np.bool_:
            return ti.TensorHandle(out, tl.int1)
        return ti.TensorHandle(to_bf16(out), bf16)
    B.binary_op = patched_binary

    unary_op = B.unary_op

    def patched_unary(self, arg, op):
        if scalar(arg) != bf16:
            return unary_op(self, arg, op)
        return ti.TensorHandle(to_bf16(op(value(arg))), bf16)
    B.unary_op = patched_unary

    rsqrt = B.create_rsqrt
    B.create_rsqrt = lambda self, arg: (rsqrt(self, arg) if scalar(arg) != bf16 else
                                        ti.TensorHandle(to_bf16(1 / np.sqrt(value(arg))), bf16))

    clampf = B.create_clampf

    def patched_clamp(self, arg, lo, hi, propagate_nans):
        if scalar(arg) != bf16:
            return clampf(self, arg, lo, hi, propagate_nans)
        return ti.TensorHandle(to_bf16(np.clip(value(arg), value(lo), value(hi))), bf16)
    B.create_clampf = patched_clamp

    fma = B.create_fma

    def patched_fma(self, x, y, z):
        if bf16 not in (scalar(x), scalar(y), scalar(z)):
            return fma(self, x, y, z)
        return ti.TensorHandle(to_bf16(value(x) * value(y) + value(z)), bf16)
    B.create_fma = patched_fma

    cast_impl = B.cast_impl

    def patched_cast(self, src, dst_type):
        dst = dst_type.scalar
        if scalar(src) != bf16 and dst != bf16:
            return cast_impl(self, src, dst_type)
        v = value(src)
        if dst == bf16:
            return ti.TensorHandle(to_bf16(v), bf16)
        return ti.TensorHandle(v.astype(ti._get_np_dtype(dst_type)), dst)
    B.cast_impl = patched_cast
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui", "create_fp_ext",
                 "create_fp_trunc"):
        setattr(B, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    fp_to_fp = B.create_fp_to_fp

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        if scalar(src) == bf16 or dst_type.scalar == bf16:
            return self.cast_impl(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)
    B.create_fp_to_fp = patched_fp_to_fp

    # bf16 constants (tl.full(..., bf16), a bf16 `other=`): the shipped builder has no get_bf16
    B.get_bf16 = lambda self, v: ti.TensorHandle(to_bf16(np.array([v], dtype=np.float32)), bf16)

    dot = B.create_dot

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.dtype.scalar.is_floating() and b.dtype.scalar.is_floating()) or 8 in (
                a.dtype.scalar.primitive_bitwidth, b.dtype.scalar.primitive_bitwidth):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        # float64 products and sums, rounded once: numpy's fp32 matmul (BLAS) flushes denormal results to zero
        out = np.matmul(value(a).astype(np.float64), value(b).astype(np.float64)) + value(d).astype(np.float64)
        return ti.TensorHandle(out.astype(np.float32) if scalar(d) != bf16 else to_bf16(out), scalar(d))
    B.create_dot = patched_dot

    R = ti.ReduceOps
    min_max, total = R.min_max, R.sum

    def as_f32(t):  # a bf16 tl.tensor as an fp32 one (same shape)
        return tl.core.tensor(ti.TensorHandle(value(t.handle), tl.float32),
                              t.type.with_element_ty(tl.float32) if t.type.is_block() else tl.float32)

    def back(t, like):  # an fp32 result tensor rounded to `like`'s bf16
        return tl.core.tensor(ti.TensorHandle(to_bf16(t.handle.data), bf16),
                              t.type.with_element_ty(bf16) if t.type.is_block() else bf16)

    def patched_min_max(self, input, val_reduce_op, idx_reduce_op=None):
        x = input[0] if isinstance(input, tuple) else input
        if x.dtype != bf16:
            return min_max(self, input, val_reduce_op, idx_reduce_op)
        out = min_max(self, as_f32(x), val_reduce_op, idx_reduce_op)
        if isinstance(out, tuple):
            return back(out[0], x), out[1]
        return out if idx_reduce_op is not None and val_reduce_op is None else back(out, x)
    R.min_max = patched_min_max

    def patched_sum(self, input):
        if input.dtype != bf16:
            return total(self, input)
        return back(total(self, as_f32(input)), input)
    R.sum = patched_sum
    _patch_scalar_index(ti)
    _PATCHED = True


def _patch_scalar_index(ti) -> None:
    """Triton 3.6's interpreter holds a scalar as a [1] array and turns it into a loop bound with int(array), which
    numpy 2 refuses for a 1-d array: a loop bounded by a computed scalar (indexer_scores' tile loop) stops there.
    Triton 3.9 squeezes the array first; so does this."""
    lang_tensor = getattr(ti, "_patch_lang_tensor", None)
    if lang_tensor is None:
        return

    def patched_lang_tensor(tensor, scope):
        lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    ti._patch_lang_tensor = patched_lang_tensor
