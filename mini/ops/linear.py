"""Linear layers over the checkpoint's weight formats (spec §4.3, §5).

A weight is a `QWeight`: bf16 (used as is), FP8 e4m3 with E8M0 `block x block` scales, or MXFP4 (packed E2M1 with
one E8M0 scale per 32 inputs). FP8 and MXFP4 GEMMs first fake-quantize the activation to FP8 in 1 x `block` groups
(the reference's `act_quant`), then multiply with the dequantized weight, accumulating in fp32. Both factors are
exactly representable in bf16, so an fp32-accumulating GEMM over them differs by summation order and, on Hopper's
tensor cores, by their truncated fp32 sums (~1e-5 relative over K = 5120; mini/kernels/moe_gate.py), far below the
bf16 rounding of the output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mini import switches
from mini.formats import E2M1_VALUES, dequant_fp8, dequant_mxfp4, e8m0_to_float, unpack_fp4_codes
from mini.formats.quant import fake_quant_enabled, quant_fp8
from mini.ops import deterministic, use_fast

_FP4_STORAGE = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)  # packed E2M1 pairs
# fast-path GEMMs of at most this many rows (decode) run mini/kernels/gemv.py's split-K GEMV instead of cuBLAS
# (issue 28; at most gemv.MAX_ROWS = 16; 0 turns it off). On since an interleaved A/B of rank4 decode on the H200
# (docs/perf/015, with the few-rows gate): B = 1 16.49 -> 15.41 ms/step, B = 16 24.06 -> 22.38.
GEMV_MAX_TOKENS = 16


@dataclass(eq=False)
class QWeight:
    """One projection weight as the checkpoint stores it. `block` is the FP8 weight block (32 V4.1, 128 V4) and,
    for both fp8 and mxfp4, the activation fake-quant group; MXFP4 weight scales are always per 32 inputs."""
    kind: str  # "bf16" | "fp8" | "mxfp4"
    data: torch.Tensor  # bf16/fp32 [out, in] | float8_e4m3fn [out, in] | packed uint8/int8 [out, in/2]
    scale: torch.Tensor | None  # None | E8M0 [ceil(out/B), ceil(in/B)] | E8M0 [out, in/32]
    block: int
    _dequant: dict = field(default_factory=dict, repr=False)  # dtype -> cached dequantized weight

    def __post_init__(self):
        if self.kind not in ("bf16", "fp8", "mxfp4"):
            raise ValueError(f"unknown weight kind {self.kind!r}")
        if (self.scale is None) != (self.kind == "bf16"):
            raise ValueError(f"{self.kind} weight {'needs' if self.kind != 'bf16' else 'takes no'} scale")

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], name: str, block: int) -> "QWeight":
        """`name.weight` (+ `name.scale` for float8_e4m3fn and int8-packed FP4 weights) from checkpoint tensors."""
        w = state[f"{name}.weight"]
        if w.dtype == torch.float8_e4m3fn:
            return cls("fp8", w, state[f"{name}.scale"], block)
        if w.dtype in _FP4_STORAGE:
            return cls("mxfp4", w, state[f"{name}.scale"], block)
        return cls("bf16", w, None, block)

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1] * (2 if self.kind == "mxfp4" else 1)

    def to(self, device) -> "QWeight":
        """The same weight on `device` (stored format kept; the dequantized cache is not carried over)."""
        scale = None if self.scale is None else self.scale.to(device)
        return QWeight(self.kind, self.data.to(device), scale, self.block)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The weight's values as a dense [out, in] tensor (exact for fp8/mxfp4 in fp32 and bf16)."""
        if self.kind == "fp8":
            return dequant_fp8(self.data, self.scale, self.block, dtype)
        if self.kind == "mxfp4":
            return dequant_mxfp4(self.data, self.scale, dtype)
        return self.data.to(dtype)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(values fp32 [out, in], scales fp32 [out, in / k_block], k_block) of an fp8 or mxfp4 weight, cached: the
        stored values and each output row's scale per K block (fp8: block x block tiles, mxfp4: 1 x 32)."""
        if "blocks" not in self._dequant:
            if self.kind == "fp8":
                values = self.data.view(torch.float8_e4m3fn).float()
                scales = e8m0_to_float(self.scale).repeat_interleave(self.block, 0)[:values.shape[0]]
                self._dequant["blocks"] = values, scales, self.block
            elif self.kind == "mxfp4":
                values = E2M1_VALUES.to(self.data.device)[unpack_fp4_codes(self.data).long()]
                self._dequant["blocks"] = values, e8m0_to_float(self.scale), 32
            else:
                raise ValueError("a bf16 weight has no scale blocks")
        return self._dequant["blocks"]

    def prepare(self, dtype=torch.float32) -> torch.Tensor:
        """The dequantized weight in `dtype`, computed once and cached (the reference path's copy)."""
        if dtype not in self._dequant:
            self._dequant[dtype] = self.dequantize(dtype)
        return self._dequant[dtype]


def linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """y = x @ W^T in x's dtype. FP8/MXFP4 weights: FP8 1 x block activation fake quant, fp32-accumulated GEMM."""
    if w.kind == "bf16":
        if use_fast(x) and x.dtype == torch.bfloat16:
            return dense_bf16(x, w.prepare(x.dtype))
        return F.linear(x, w.prepare(x.dtype))
    if x.shape[-1] % w.block:
        raise ValueError(f"activation width {x.shape[-1]} is not a multiple of the quant block {w.block}")
    if use_fast(x) and x.dtype == torch.bfloat16:
        # fake-quantized activations and dequantized weights are exact in bf16; the GEMM accumulates in fp32
        return dense_bf16(x, w.prepare(torch.bfloat16), act_block=w.block if fake_quant_enabled() else 0,
                          fp8=w if w.kind == "fp8" else None)
    return blockwise_gemm(x, w).to(x.dtype)


def linears(x: torch.Tensor, ws: tuple[QWeight, ...]) -> tuple[torch.Tensor, ...]:
    """(linear(x, w) for w in ws): projections of one input. The fast path runs them as one GEMM over their
    dequantized copies side by side (one launch, and at decode one read of x and one act quant instead of one per
    projection), built at first use; the outputs are column slices of its [..., sum of out] result (strided rows:
    the norm and RoPE kernels read them in place); FP8 weights' bytes and scales are stacked too (`stack_fp8`) for
    the decode GEMV's FP8 read. Weights of different kinds or blocks run one by one. Each output element is the
    same exact products summed in fp32; only the GEMM's order of the sum may differ."""
    same = all(w.block == ws[0].block and (w.kind == "bf16") == (ws[0].kind == "bf16") for w in ws)
    if not (same and len(ws) > 1 and use_fast(x) and x.dtype == torch.bfloat16):
        return tuple(linear(x, w) for w in ws)
    if ws[0].kind != "bf16" and x.shape[-1] % ws[0].block:
        raise ValueError(f"activation width {x.shape[-1]} is not a multiple of the quant block {ws[0].block}")
    key = ("stack", *(id(w) for w in ws))
    if key not in ws[0]._dequant:
        ws[0]._dequant[key] = stack_dequantized(list(ws), torch.bfloat16)
    quant = ws[0].kind != "bf16" and fake_quant_enabled()
    fp8_key = ("stack_fp8", *key[1:])
    if fp8_key not in ws[0]._dequant:
        ws[0]._dequant[fp8_key] = stack_fp8(list(ws))  # None unless all FP8
    y = dense_bf16(x, ws[0]._dequant[key], act_block=ws[0].block if quant else 0,
                   fp8=ws[0]._dequant[fp8_key])
    return tuple(y.split([w.out_features for w in ws], dim=-1))


def reads_fp8_weights(rows: int = 1, act_block: int = 0, w: QWeight | None = None) -> bool:
    """Whether the decode GEMV reads an FP8 weight's bytes and scales as stored (half the bytes of its dequantized
    bf16 copy) for `rows` rows of x: at one row on the CUDA cores (MINI_GEMV_WEIGHTS=fp8 or fp8_row; the same exact
    products in another fp32 order), at 2-16 rows on the tensor cores when x is fake-quantized in w's blocks
    (act_block = w.block; MINI_GEMV_WEIGHTS=fp8, the default, or fp8_triton: the official FP8 GEMM's products; at
    2-8 rows on CUDA =fp8 takes the Gluon build, `_gluon_rows`), else (=bf16, or no quant) the copy."""
    choice = switches.current().gemv_weights
    if rows == 1:
        return choice != "bf16"
    return choice in ("fp8", "fp8_triton") and w is not None and 1 < rows <= GEMV_MAX_TOKENS and act_block == w.block


def dense_bf16(x: torch.Tensor, w: torch.Tensor, act_block: int = 0, fp8: QWeight | None = None) -> torch.Tensor:
    """The fast path's F.linear(x, w) on bf16 operands, x first fake-quantized to FP8 in 1 x act_block groups when
    act_block > 0: up to GEMV_MAX_TOKENS rows the decode GEMV (the quant in its loads; fp32 sums in its own fixed
    order, one rounding to bf16, as cuBLAS's output), else the act quant pass and cuBLAS. `fp8`: w's FP8 weight
    (w = its dequantized copy), which the GEMV reads instead where `reads_fp8_weights` (one row on the CUDA cores,
    2-16 on the tensor cores), so a row's bits depend on whether it is alone in its step (the two reads' sums), as
    cuBLAS's do on the step's size. The deterministic mode, the batch-invariant one, keeps F.linear, which it has
    routed to its batch-invariant kernel (mini/kernels/batch_invariant.py)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if 0 < rows <= GEMV_MAX_TOKENS and not deterministic():
        from mini.kernels.gemv import gemv, runs_on
        if runs_on(x):  # else (Triton 3.6's interpreter) the act quant pass and the GEMM below
            x2 = x.reshape(rows, x.shape[-1])
            if fp8 is not None and reads_fp8_weights(rows, act_block, fp8) and _gemv_reads(fp8):
                from mini.kernels.gemv import MMA_REGISTERS
                regs = _gluon_rows(rows, x)
                y = gemv(x2, fp8.data, act_block=act_block, scale=fp8.scale, w_block=fp8.block,
                         **({"config": MMA_REGISTERS} if regs else {}))
            else:
                y = gemv(x2, w, act_block=act_block)
            return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(_fast_act_quant(x, act_block) if act_block else x, w)


def _gluon_rows(rows: int, x: torch.Tensor) -> bool:
    """Whether a read of `rows` rows of x goes to the GEMV's Gluon build (MINI_GEMV_WEIGHTS=fp8, the default; CUDA,
    2 to gemv.MMA_REGISTERS_ROWS rows); the cheap checks come first, so that a CPU step costs no import."""
    if switches.current().gemv_weights != "fp8" or not x.is_cuda:
        return False
    from mini.kernels.gemv import MMA_REGISTERS_ROWS
    return 1 < rows <= MMA_REGISTERS_ROWS


def gluon_read(x: torch.Tensor, fp8: QWeight | None, groups: int = 1) -> torch.Tensor | None:
    """Under MINI_GEMV_WEIGHTS=fp8 (the default): x [T, groups K] bf16 at 2-8 rows on CUDA, taken as it is (already
    quantized, or a projection without act quant), against fp8's checkpoint bytes in the decode GEMV's Gluon build
    (gemv.MMA_REGISTERS: the exact products summed in fp32); None where that does not apply (other switch values,
    CPU, other row counts, the deterministic mode, a tiling the build cannot take)."""
    if (fp8 is None or fp8.kind != "fp8" or not _gluon_rows(x.shape[0], x) or x.dtype != torch.bfloat16
            or not use_fast(x) or deterministic() or not _gemv_reads(fp8)):
        return None
    from mini.kernels.gemv import MMA_REGISTERS, gemv
    if (fp8.data.shape[0] // groups) % MMA_REGISTERS.block_n or 4 * MMA_REGISTERS.gluon_k_width > fp8.block:
        return None
    return gemv(x, fp8.data, scale=fp8.scale, w_block=fp8.block, groups=groups, config=MMA_REGISTERS)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, fp8: QWeight | None = None) -> torch.Tensor:
    """x [T, G, k] times each group's w [G, r, k] -> [T, G·r] in x's dtype: a block-diagonal projection (V4.1's
    wo_a, bf16 values, no activation quant: the official einsum 'tgd,grd->tgr'). `fp8`: w's checkpoint bytes
    [G·r, k] with their scales. At one row the fast path reads those bytes (half the copy's) in the decode GEMV,
    one program per group's rows (where `reads_fp8_weights`, as `dense_bf16`): V4.1's wo_a 24.5 -> 16.2 us on an
    H100, the B = 1 step -3.3% (docs/perf/040); at 2-8 rows on CUDA (MINI_GEMV_WEIGHTS=fp8, the default) in the
    GEMV's Gluon build (`gluon_read`), x as it is, the exact products summed in fp32. Otherwise, and in the
    deterministic mode (its batch-invariant bmm), one batched GEMM on the copy that writes straight into the
    [T, G, r] layout the next projection reads (einsum's [G, T, r] result would need a transposing copy); the
    grouped GEMV on the copy was slower than it at 1-16 rows (tools/wo_a_study.py)."""
    T, G, k = x.shape
    r = w.shape[1]
    if (fp8 is not None and T == 1 and use_fast(x) and x.dtype == torch.bfloat16 and not deterministic()
            and reads_fp8_weights() and _gemv_reads(fp8)):
        from mini.kernels.gemv import gemv, runs_on, takes_groups
        if runs_on(x) and takes_groups(G * r, G):
            return gemv(x.reshape(1, G * k), fp8.data, scale=fp8.scale, w_block=fp8.block, groups=G)
    y = gluon_read(x.reshape(T, G * k), fp8, groups=G) if T > 1 else None
    if y is not None:
        return y
    if not x.is_cuda:
        return torch.einsum("tgd,grd->tgr", x, w).flatten(1)
    out = torch.empty(T, G, r, dtype=x.dtype, device=x.device)
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out.flatten(1)


def head_logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """fp32 logits = x @ head^T, the official head: `F.linear(x.float(), weight)` with an fp32 weight that holds the
    checkpoint's bf16 values. When x is bf16 (the final norm's output in a bf16 model) and `head` is kept in bf16
    (the model does so on CUDA), both factors are exactly what the fp32 GEMM multiplies, so the fast path runs a
    bf16 tensor-core GEMM with fp32 accumulation and fp32 output: the same exact products, summed in another
    order (as any two fp32 GEMMs differ). On the H200 the fp32 GEMM at decode batch 256 took 6.8 ms of a 90 ms
    rank4-decode step, compute-bound on the fp32 units; the bf16 one reads half the bytes on the tensor cores."""
    if use_fast(x) and x.is_cuda and x.dtype == torch.bfloat16 and head.dtype == torch.bfloat16:
        logits = torch.mm(x.reshape(-1, x.shape[-1]), head.t(), out_dtype=torch.float32)
        return logits.view(*x.shape[:-1], head.shape[0])  # explicit width: a step may have no logit rows
    return F.linear(x.float(), head.float())


def blockwise_gemm(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """fp32 [..., out]: the official FP8 / FP4 GEMM kernels' arithmetic (their CPU port): the activation quantized
    to FP8 values a and scales a_s (1 x block), the weight's values b and scales b_s; for each K block of the weight
    scale (block for fp8, 32 for mxfp4), in K order, acc += (a_k @ b_k^T) * a_s[:, k] * b_s[:, k]. Each block's
    products are exact in fp32, so only this order of the sums is left to match."""
    values, scales, k_block = w.blocks()
    a, a_s = quant_fp8(x.reshape(-1, x.shape[-1]), w.block)
    a_s = a_s.repeat_interleave(w.block // k_block, dim=1) if w.block > k_block else a_s
    acc = torch.zeros(a.shape[0], values.shape[0], dtype=torch.float32, device=x.device)
    for k in range(values.shape[1] // k_block):
        cols = slice(k * k_block, (k + 1) * k_block)
        acc += (a[:, cols] @ values[:, cols].T) * a_s[:, k:k + 1] * scales[:, k].unsqueeze(0)
    return acc.view(*x.shape[:-1], values.shape[0])  # explicit width: an idle EP rank has 0 rows


def stack_dequantized(ws: list[QWeight], dtype: torch.dtype) -> torch.Tensor:
    """The weights' dequantized copies in `dtype`, stacked along the output dimension: one GEMM for several
    projections of one input. Each weight's cached copy becomes its view into the stack, so it is held once."""
    stack = torch.cat([w.prepare(dtype) for w in ws])
    row = 0
    for w in ws:
        w._dequant[dtype] = stack[row:row + w.out_features]
        row += w.out_features
    return stack


def _gemv_reads(w: QWeight) -> bool:
    """Whether the GEMV's FP8 read takes this weight: its scale bytes up to gemv.MAX_SCALE_BYTE (s <= 2^39; a
    checkpoint's are far below), checked once per weight outside CUDA-graph capture (a capture before it takes
    the bf16 copy: the same bits)."""
    if "gemv_reads" not in w._dequant:
        if w.scale.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        from mini.kernels.gemv import MAX_SCALE_BYTE
        w._dequant["gemv_reads"] = int(w.scale.view(torch.uint8).max()) <= MAX_SCALE_BYTE
    return w._dequant["gemv_reads"]


def stack_fp8(ws: list[QWeight]) -> QWeight | None:
    """FP8 weights of one input stacked along the output dimension as one FP8 QWeight (bytes and scales), each
    weight's bytes and scales becoming views into the stack (held once); None where they are not all FP8 of one
    block, or a weight but the last ends inside a scale block (its rows would share the next one's scales)."""
    block = ws[0].block
    if any(w.kind != "fp8" or w.block != block for w in ws) or any(w.out_features % block for w in ws[:-1]):
        return None
    stacked = QWeight("fp8", torch.cat([w.data for w in ws]), torch.cat([w.scale for w in ws]), block)
    row = 0
    for w in ws:
        w.data, w.scale = stacked.data[row:row + w.out_features], stacked.scale[row // block:][:w.scale.shape[0]]
        row += w.out_features
    return stacked


def _fast_act_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """fake_quant_fp8 as one Triton pass (mini.kernels.fp8_act_quant), honouring the no_fake_quant() switch."""
    if not fake_quant_enabled():
        return x
    from mini.kernels.fp8_act_quant import fp8_act_quant
    return fp8_act_quant(x.reshape(-1, x.shape[-1]), block).view(x.shape)
