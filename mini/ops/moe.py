"""Mixture of experts (spec §2.5): the gate, the routed experts a rank holds, the shared expert.

    weights, ids = gate(x, w, cfg, plan, input_ids)      # fp32 [T, k], int64 [T, k]
    y = routed(x, w, cfg, weights, ids) + shared(x, w)   # fp32 [T, D]
    out = y.to(x.dtype)                                  # = moe(x, w, cfg, plan, input_ids)

`routed` sums only the experts present in `w` (under EP a rank holds experts [a, b)), so an EP exchange can run
gate / routed / shared separately around its all-gather and reduce-scatter.

Every expert is a SwiGLU FFN: g = w1(x), u = w3(x) (each rounded to x.dtype, as the reference's Linear returns),
u clamped to ±limit and g from above, h = silu(g) * u * routing weight in fp32, then w2(h.to(x.dtype)). Each GEMM
fake-quantizes its input to FP8 1 x block (inside `linear`). Expert outputs are summed in fp32.

Fast path (CUDA, `mini.ops.use_fast`): the gate is one kernel from 1,024 tokens (mini/kernels/moe_gate.py: bf16
GEMM whose tensor-core partial sums are added in fp32 every 512 of K, so its logits are as accurate as an fp32
GEMM's; scores, top-k and weights in its epilogue), below it (decode, verify steps, short chunks) the same
kernels' few-rows path (FEW_ROWS_GATE_MAX_TOKENS), elsewhere the reference's fp32 GEMM; the (token, slot) pairs
are sorted by local expert (mini/kernels/moe_route.py), the routed experts run as grouped GEMMs, and a combine
kernel sums each token's local rows in slot order. The grouped GEMMs come from one of two libraries, chosen once
per process by MINI_MOE_GEMM (mini.ops.backends.moe_gemm):
* "triton": ours (mini/kernels/mxfp4_grouped_gemm.py), decoding MXFP4 in the main loop, w1/w3 with SwiGLU, clamps,
  routing weight and the FP8 quant of w2's input fused into the epilogue, then w2;
* "humming": the humming-kernels library (SM90, W4A16; adapter mini/kernels/humming_experts.py): the experts are
  rewritten into its layout once at load (`MoEWeights.to_humming`), the rows are gathered and FP8-quantized in
  one pass, w1 and w3 are one GEMM (N = 2I), the SwiGLU epilogue is its own pass, then w2.
"auto" (the default) takes Humming when it imports on an SM90 GPU. The CPU reference path reads either layout.
Which gate and GEMMs a step runs are `gate_kernel` and `experts_kernel`, asked once per step by its plan
(mini.ops.step_plan); a layer whose weights a kernel does not take runs the reference's code either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from mini.config import LayerPlan, ModelConfig
from mini.formats.quant import fake_quant_enabled
from mini.ops import backends, deterministic, use_fast
from mini.ops.linear import QWeight, linear
from mini.ops.stages import stage, staged

if TYPE_CHECKING:
    from mini.ops.step_plan import StepPlan


@dataclass(eq=False)
class MoEWeights:
    """One layer's MoE weights. The routed experts a rank holds are stacked: `w1`/`w3` data `[E_local, I, D/2]`
    (scale `[E_local, I, D/32]`), `w2` data `[E_local, D, I/2]` (scale `[E_local, D, I/32]`), for the global
    expert ids in `experts`."""
    gate: torch.Tensor  # bf16 [E, D]
    bias: torch.Tensor | None  # fp32 [E]: selection-only correction (None on V4 hash layers)
    bias_vl: torch.Tensor | None  # fp32 [E]: the same for image-span tokens (V4.1 with vision)
    tid2eid: torch.Tensor | None  # int64 [vocab, k]: V4 hash layers route by token id
    experts: range  # global ids of the routed experts held here
    w1: QWeight
    w3: QWeight
    w2: QWeight
    shared_w1: QWeight
    shared_w3: QWeight
    shared_w2: QWeight
    swiglu_limit: float
    # the experts in Humming's layout (humming_experts.HummingExperts, iterating as (w13, w2)) once `to_humming`
    # rewrote them: the QWeights' bytes are then in that layout (w1 / w3 views of the w13 stack), and only `expert`
    # reads them back
    humming: object | None = field(default=None, repr=False)
    # per-expert views for the reference path, kept so that each keeps its dequantized copy (QWeight.prepare)
    _per_expert: dict = field(default_factory=dict, repr=False)
    # the shared w1 and w3 dequantized to bf16 side by side (linear.stack_dequantized), built at first fast use,
    # and (FP8) their bytes and scales side by side (linear.stack_fp8; None where they cannot be stacked)
    _shared_w13: torch.Tensor | None = field(default=None, repr=False)
    _shared_w13_fp8: QWeight | None = field(default=None, repr=False)

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig, layer: int,
                   experts: range | None = None, device: torch.device | str | None = None,
                   consume: bool = False) -> "MoEWeights":
        """`prefix` is the FFN module path, e.g. "layers.3.ffn". Only the experts in `experts` are read (default:
        those the state holds, which must be a contiguous range); they are stacked on `device` (default: where the
        state lives). `consume` pops each routed expert's tensors from `state` once they are stacked, so that a
        caller holding the only other reference never has the experts twice in memory."""
        p = prefix.rstrip(".")
        n_experts = state[f"{p}.gate.weight"].shape[0]
        if experts is None:
            held = [e for e in range(n_experts) if f"{p}.experts.{e}.w1.weight" in state]
            experts = range(held[0], held[-1] + 1) if held else range(0)
            if len(held) != len(experts):
                raise ValueError(f"{p}: the state holds a non-contiguous set of experts; pass `experts`")
        if not (0 <= experts.start <= experts.stop <= n_experts and experts.step == 1):
            raise ValueError(f"expert range {experts} is not a contiguous part of 0..{n_experts}")

        def get(name):
            t = state.get(name)
            return None if t is None else t.to(device) if device is not None else t

        def stacked(proj: str) -> QWeight:
            names = [f"{p}.experts.{e}.{proj}" for e in experts]
            ws = [QWeight.from_state(state, n, cfg.fp8_block) for n in names]
            if not ws:
                raise ValueError("a MoE layer needs at least one local expert")
            kind = ws[0].kind
            data = _stack([_bytes(w.data, kind) for w in ws], device)
            scale = None if kind == "bf16" else _stack([w.scale.view(torch.uint8) for w in ws], device)
            if consume:
                del ws
                for n in names:
                    state.pop(f"{n}.weight")
                    state.pop(f"{n}.scale", None)
            return QWeight(kind, data, scale, cfg.fp8_block)

        def single(proj: str) -> QWeight:
            w = QWeight.from_state(state, f"{p}.shared_experts.{proj}", cfg.fp8_block)
            if device is not None:
                w = QWeight(w.kind, w.data.to(device), None if w.scale is None else w.scale.to(device), w.block)
            return w

        hash_routed = cfg.layers[layer].hash_routed if layer < len(cfg.layers) else False
        tid2eid = get(f"{p}.gate.tid2eid")
        if hash_routed and tid2eid is None:
            raise ValueError(f"layer {layer} routes by token id but {p}.gate.tid2eid is missing")
        w = cls(gate=get(f"{p}.gate.weight"), bias=get(f"{p}.gate.bias"), bias_vl=get(f"{p}.gate.bias_vl"),
                tid2eid=tid2eid if hash_routed else None, experts=experts,
                w1=stacked("w1"), w3=stacked("w3"), w2=stacked("w2"),
                shared_w1=single("w1"), shared_w3=single("w3"), shared_w2=single("w2"),
                swiglu_limit=cfg.swiglu_limit)
        if experts_gemm(w) == "humming":  # its layout is rewritten once, here, at load
            w.to_humming()
        return w

    def humming_ready(self) -> bool:
        """Whether Humming's adapter takes these experts (humming_experts.takes)."""
        from mini.kernels.humming_experts import takes
        return takes(*((q.kind, q.data, q.scale) for q in (self.w1, self.w3, self.w2)))

    def to_humming(self) -> None:
        """Rewrite the routed experts into Humming's layout, once, at load (mini/kernels/humming_experts.py:
        `side_by_side` stacks w1 and w3 for one GEMM, `convert` rewrites a stack in place); afterwards the fast path
        runs Humming's GEMMs on them. The old w1 and w3 buffers are freed when nothing else holds them, before the
        rewrite, so a layer needs ~1.1 GB more only while it converts."""
        from mini.kernels.humming_experts import HummingExperts, side_by_side
        if self.humming is not None:
            return
        if not self.humming_ready():
            raise ValueError("to_humming needs stacked MXFP4 experts on a CUDA device")
        (w1, w3), w13 = side_by_side(*((q.data, q.scale.view(torch.uint8)) for q in (self.w1, self.w3)))
        block = self.w1.block
        self.w1, self.w3 = QWeight("mxfp4", *w1, block), QWeight("mxfp4", *w3, block)  # the old buffers go here
        self.humming = HummingExperts.convert(w13, (self.w2.data, self.w2.scale.view(torch.uint8)))
        self._per_expert.clear()  # views taken before hold the old layout's bytes

    def expert(self, i: int) -> tuple[QWeight, QWeight, QWeight]:
        """The three projections of the i-th local expert (global id experts[i]), in the checkpoint layout."""
        def one(w: QWeight) -> QWeight:
            return QWeight(w.kind, w.data[i], None if w.scale is None else w.scale[i], w.block)
        if i not in self._per_expert:
            if self.humming is not None:  # rewritten: a copy in the checkpoint layout
                self._per_expert[i] = tuple(QWeight("mxfp4", *ds, q.block) for ds, q in
                                            zip(self.humming.expert(i), (self.w1, self.w3, self.w2)))
            else:
                self._per_expert[i] = one(self.w1), one(self.w3), one(self.w2)
        return self._per_expert[i]


def experts_gemm(w: MoEWeights) -> str:
    """Which grouped GEMM library the fast path runs this layer's routed experts through, the one place it is
    chosen: "humming" where MINI_MOE_GEMM resolves to it (mini.ops.backends.moe_gemm) and its adapter takes these
    experts (`MoEWeights.humming_ready`), else "triton". Asked once, at load: Humming needs its own layout, which
    `from_state` rewrites the experts into (`to_humming`; the reference path reads them back per expert)."""
    return "humming" if w.humming is not None or (w.humming_ready() and backends.moe_gemm() == "humming") \
        else "triton"


def _stack(ts: list[torch.Tensor], device) -> torch.Tensor:
    """The experts' tensors as one [E, ...] tensor on `device`. When they already are consecutive slices of one
    buffer (a loader that stacked them), that buffer is used as is: no second copy of the experts."""
    t0 = ts[0]
    want = None if device is None else torch.device(device)
    if want is not None and (t0.device.type != want.type or want.index not in (None, t0.device.index)):
        # e.g. memory-mapped host tensors -> GPU
        buf = torch.empty((len(ts), *t0.shape), dtype=t0.dtype, device=device)
        for j, t in enumerate(ts):
            buf[j].copy_(t)
        return buf
    consecutive = all(t.is_contiguous() and t.shape == t0.shape and t.dtype == t0.dtype
                      and t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr()
                      and t.data_ptr() == t0.data_ptr() + i * t0.nbytes for i, t in enumerate(ts))
    if consecutive:
        return torch.as_strided(t0, (len(ts), *t0.shape), (t0.numel(), *t0.stride()))
    return torch.stack(ts)


def _bytes(data: torch.Tensor, kind: str) -> torch.Tensor:
    """Packed FP4 as uint8 (the checkpoint may say int8 or float4_e2m1fn_x2); other kinds unchanged."""
    return data.view(torch.uint8) if kind == "mxfp4" else data


# ---------------------------------------------------------------------------------------------------------- gate
@staged("moe.gate")
def gate(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, plan: LayerPlan, input_ids: torch.Tensor | None = None,
         image_mask: torch.Tensor | None = None, step: StepPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (the normed FFN input) -> routing weights fp32 [T, k] and global expert ids int64 [T, k].
    Fast path: the gate kernels (mini/kernels/moe_gate.py: "fused", one kernel for logits, scores, top-k and
    weights; "few_rows", the decode steps' two launches) where `_layer_gate_kernel`; ids as torch.topk's except at
    exact ties of the biased scores, which go to the lowest expert id there.
    `step`: the step's plan (mini.ops.step_plan), None: `gate_kernel` for this call."""
    kind = _layer_gate_kernel(x, w, cfg, plan, step)
    if kind != "unfused":
        return fused_gate(x, w, cfg, image_mask, few_rows=kind == "few_rows")
    return gate_unfused(x, w, cfg, plan, input_ids, image_mask)


def fused_gate(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, image_mask: torch.Tensor | None = None,
               config=None, few_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate kernel with this model's normalisation (`config`: a moe_gate.GateConfig, None = its default;
    `few_rows`: the decode path)."""
    from mini.kernels.moe_gate import gate_topk
    k = cfg.n_activated_experts
    normalize = not cfg.is_v41 or (cfg.norm_topk_prob and k > 1)
    return gate_topk(x, w.gate, w.bias, k, cfg.route_scale, cfg.gate_temp, 1e-20 if cfg.is_v41 else 0.0,
                     normalize, w.bias_vl, image_mask, config, few_rows=few_rows)


# Below this many tokens the unfused gate runs: each program of the fused kernel reads the whole gate weight
# (3.9 MB at V4.1) through one SM, ~0.2 ms however few its rows, where the fp32 GEMM spreads over every SM. On the
# H200 (docs/perf/raw/007: final/gate_plan.json, gate/gate_sweep.txt) the unfused gate takes 0.19 ms at 1,024 tokens and
# 0.55 at 4,096; the fused one 0.21 ms at 4,096 (64 programs, one wave; fewer tokens run fewer programs of the
# same length, so about as long) and 0.39 at 16,384: about even at this threshold.
FUSED_GATE_MIN_TOKENS = 1024
# Up to this many tokens (decode steps) the gate is the few-rows kernels' (the logits with the experts and K split
# over the programs, then one epilogue kernel; 0 turns them off). On the H200 (CUDA graphs, 384 x 5120, k = 6) the
# reshaped tilings take 8.0 us per call at B = 1 and 8.2-9.5 at B = 2-64 against the unfused torch ops' 33.7-55.0
# (docs/perf/014), and rank4 decode's step with them and the decode GEMV went 16.49 -> 15.41 ms at B = 1, 24.06 ->
# 22.38 at B = 16, 42.31 -> 40.32 at B = 64 (interleaved A/B, docs/perf/015). Their first tiling had been slower
# than the unfused gate (44.4 / 34.3 us at B = 1). Beyond 64 rows (decode at B = 128-256, verify steps of B x 6
# rows) the largest tiling's row blocks each re-read the weight's slab from L2, where the unfused gate at 256 rows
# took ~60 us a layer (an fp32 FFMA GEMM with split-K, then torch's top-k; 2.4 ms of the B = 256 x 32K step in
# docs/perf/raw/025): so every step below the fused kernel's threshold takes them.
FEW_ROWS_GATE_MAX_TOKENS = FUSED_GATE_MIN_TOKENS - 1


def gate_kernel(tokens: int, dtype: torch.dtype, fast: bool) -> str:
    """The gate of a step of `tokens` rows of `dtype` activations, served by the fast path (`fast`) or not:
    "fused" (mini/kernels/moe_gate.py, where the layer's gate is one it covers: `_layer_gate_kernel`) for bf16 steps
    of FUSED_GATE_MIN_TOKENS tokens or more, or of any size in the deterministic mode (the kernel's tiles are
    fixed: one program per row block, so the token count must not choose); "few_rows" (the same kernels' decode
    path) for bf16 steps of 1 to FEW_ROWS_GATE_MAX_TOKENS tokens (none while it is 0); else "unfused"
    (`gate_unfused`)."""
    if not (fast and dtype == torch.bfloat16):
        return "unfused"
    if tokens >= FUSED_GATE_MIN_TOKENS or deterministic():
        return "fused"
    return "few_rows" if 0 < tokens <= FEW_ROWS_GATE_MAX_TOKENS else "unfused"


def _layer_gate_kernel(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, plan: LayerPlan,
                     step: StepPlan | None) -> str:
    """The step's gate ("fused", "few_rows") where the layer's gate is one the kernels cover: bf16 gate weights,
    sqrtsoftplus scores and a selection bias (V4.1, and V4's non-hash layers); else "unfused" (other layers:
    softmax / sigmoid, hash layers, no bias)."""
    kind = step.gate if step is not None else gate_kernel(x.shape[0], x.dtype, use_fast(x, w.gate))
    covered = (w.gate.dtype == torch.bfloat16 and cfg.score_func == "sqrtsoftplus" and not plan.hash_routed
               and w.bias is not None)
    return kind if covered else "unfused"


def gate_unfused(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, plan: LayerPlan,
                 input_ids: torch.Tensor | None = None, image_mask: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate in torch ops: the reference, and the fast path's fallback (logits from one GEMM, `_gate_logits`)."""
    k = cfg.n_activated_experts
    logits = _gate_logits(x, w.gate) / cfg.gate_temp
    if cfg.score_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif cfg.score_func == "sigmoid":
        scores = logits.sigmoid()
    else:  # sqrtsoftplus
        scores = F.softplus(logits).sqrt()
    if plan.hash_routed:
        if input_ids is None:
            raise ValueError(f"layer {plan.layer} routes by token id: pass input_ids")
        ids = w.tid2eid[input_ids].long()
    else:
        bias = w.bias
        if image_mask is not None and w.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), w.bias_vl, bias)
        sel = scores if bias is None else scores + bias  # the bias picks experts, it does not scale them
        ids = sel.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.is_v41:
        if cfg.norm_topk_prob and k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # a literal 1e-20, not norm_eps
    elif cfg.score_func != "softmax":
        weights = weights / weights.sum(dim=-1, keepdim=True)  # V4: no epsilon
    return weights * cfg.route_scale, ids


def _gate_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits x @ W^T, as the official gate computes them: an IEEE fp32 GEMM (no TF32). A bf16 GEMM with an
    fp32 output would not do: Hopper's tensor cores truncate their sums (see mini/kernels/moe_gate.py)."""
    return x.float() @ weight.float().t()


# ------------------------------------------------------------------------------------------------------- experts
def expert_ffn(x: torch.Tensor, w1: QWeight, w3: QWeight, w2: QWeight, limit: float,
               weight: torch.Tensor | None = None) -> torch.Tensor:
    """One SwiGLU expert in x.dtype; `weight` [n, 1] (the routing weight) scales h before w2."""
    g = linear(x, w1).float()
    u = linear(x, w3).float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if weight is not None:
        h = weight * h
    return linear(h.to(x.dtype), w2)


@staged("moe.routed")
def routed(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, weights: torch.Tensor,
           ids: torch.Tensor, layer_pairs: int | None = None, step: StepPlan | None = None) -> torch.Tensor:
    """Sum over each token's selected experts that are held in `w`, fp32 [T, D]. Other experts contribute 0.
    `layer_pairs`: see `_routed_fast`; `step`: the step's plan (None: `experts_kernel` for this call)."""
    if _fast_ok(x, ids, w, step):
        return _routed_fast(x, w, weights, ids, torch.float32, layer_pairs=layer_pairs)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for i, e in enumerate(w.experts):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        out = expert_ffn(x[tok], *w.expert(i), w.swiglu_limit, weights[tok, slot, None])
        y.index_add_(0, tok, out.float())
    return y


@staged("moe.shared")
def shared(x: torch.Tensor, w: MoEWeights, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The shared expert every token goes through, [T, D] holding x.dtype-rounded values, in `out_dtype` (fp32 by
    default; the EP exchange's fused glue takes x.dtype, which its combine reads as they are, and skips a cast)."""
    return _shared(x, w).to(out_dtype)


def _shared(x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    if use_fast(x) and x.dtype == torch.bfloat16 and x.shape[0] > 0 and w.shared_w1.kind != "bf16":
        return _shared_fast(x, w)
    return expert_ffn(x, w.shared_w1, w.shared_w3, w.shared_w2, w.swiglu_limit)


def _shared_fast(x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """`expert_ffn` for the shared expert in four passes instead of a dozen: x's FP8 act quant once, one GEMM for
    w1 and w3 side by side (at decode one GEMV that quantizes x in its loads), the SwiGLU pass (clamps, fp32 math,
    bf16 rounding and w2's FP8 act quant, as `linear` would do them), the w2 GEMM. The same roundings; only the
    GEMMs' summation order may differ. At one row w2 takes the GEMV's FP8 read too (MINI_GEMV_WEIGHTS=fp8, the
    default: 7.9 us at V4.1's shape, cuBLAS on the bf16 copy 10.1, docs/perf/018 and 023); at 2-8 rows on CUDA (=fp8)
    the GEMV's Gluon build on w2's bytes (h is already quantized: taken as it is); at more rows, cuBLAS (faster there
    than the GEMV on the copy, docs/perf/018)."""
    from mini.kernels.mxfp4_grouped_gemm import swiglu_rows
    from mini.ops.linear import dense_bf16, gluon_read, reads_fp8_weights, stack_dequantized, stack_fp8
    w1, w3, w2 = w.shared_w1, w.shared_w3, w.shared_w2
    if w._shared_w13 is None:
        w._shared_w13 = stack_dequantized([w1, w3], torch.bfloat16)
        w._shared_w13_fp8 = stack_fp8([w1, w3])
    inter = w1.out_features
    gu = dense_bf16(x, w._shared_w13, act_block=w1.block if fake_quant_enabled() else 0, fp8=w._shared_w13_fp8)
    # every row, weight 1.0 (exact): no weight or count tensor
    h = swiglu_rows(gu[:, :inter], gu[:, inter:], None, None, w.swiglu_limit, w2.block if fake_quant_enabled() else 0)
    if w2.kind == "fp8" and h.shape[0] == 1 and reads_fp8_weights():  # (h: already FP8 in w2's groups)
        return dense_bf16(h, w2.prepare(torch.bfloat16), fp8=w2)
    y = gluon_read(h, w2)  # (2-8 rows on CUDA under MINI_GEMV_WEIGHTS=fp8, the default; else None)
    return y if y is not None else F.linear(h, w2.prepare(torch.bfloat16))


def moe(x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, plan: LayerPlan, input_ids: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None, step: StepPlan | None = None) -> torch.Tensor:
    """The whole MoE FFN on one device (all experts local, or EP without exchange), in x.dtype; `step`: the step's
    plan (mini.ops.step_plan: its gate and experts' GEMMs), None: decided for this call."""
    weights, ids = gate(x, w, cfg, plan, input_ids, image_mask, step)
    return experts_and_shared(x, x.shape[0], w, cfg, weights, ids, step)


def experts_and_shared(x: torch.Tensor, own: int, w: MoEWeights, cfg: ModelConfig, weights: torch.Tensor,
                       ids: torch.Tensor, step: StepPlan | None = None) -> torch.Tensor:
    """`moe` after its gate, [own, D] in x.dtype: the routed experts over every row of x, kept for its first `own`
    rows, plus the shared expert over those. own < rows: an EP rank's experts also serve rows routed from other
    ranks (mini.testing.emulated_ep). The fast path sums the shared expert in the combine, last, and rounds once:
    the same bits as the fp32 sum and cast of the other path."""
    mine = x[:own]
    if _fast_ok(x, ids, w, step):
        return _routed_fast(x, w, weights, ids, x.dtype, add=shared(mine, w, x.dtype))[:own]
    return (routed(x, w, cfg, weights, ids, step=step)[:own] + shared(mine, w)).to(x.dtype)


# ------------------------------------------------------------------------------------------- fast path (CUDA)
def experts_kernel(dtype: torch.dtype, fast: bool) -> str:
    """The routed experts' GEMMs of a step of `dtype` activations, served by the fast path (`fast`) or not: the
    kernels (MINI_MOE_GEMM's library, mini.ops.backends.moe_gemm: "humming" or "triton", as the experts were laid
    out at load, `experts_gemm`) where they are exact, else "reference". They multiply in bf16: exact for bf16
    activations and for fake-quantized ones (FP8 values are bf16 values), not for fp32 activations with the fake
    quant switched off."""
    exact = dtype == torch.bfloat16 or fake_quant_enabled()
    return backends.moe_gemm() if fast and exact else "reference"


def _fast_ok(x: torch.Tensor, ids: torch.Tensor, w: MoEWeights, step: StepPlan | None = None) -> bool:
    """The kernels where the step's experts are not "reference" and they take this layer's experts: converted to
    Humming's layout (whose GEMMs round their outputs to bf16, the reference's rounding only for bf16
    activations), or MXFP4 for ours."""
    kind = step.experts if step is not None else experts_kernel(x.dtype, use_fast(x, ids))
    if kind == "reference":
        return False
    if w.humming is not None:
        return x.dtype == torch.bfloat16
    return w.w1.kind == "mxfp4" and w.w2.kind == "mxfp4"


def _routed_fast(x, w: MoEWeights, weights: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype,
                 add: torch.Tensor | None = None, add_at: int = 0, layer_pairs: int | None = None) -> torch.Tensor:
    """The routed experts through the GPU kernels: sort the (token, slot) pairs by local expert, the experts'
    GEMMs (Humming's when the experts were converted, else ours), then per token the sum of its local rows in
    slot order (+ `add` on the rows from `add_at`). x: a tensor, or `FP8Rows` (`routed_wire`).
    `layer_pairs` (default ids.numel()): the (token, slot) pairs of the whole layer when `ids` are one micro-batch
    of it (the EP exchange's overlap): Humming picks its tile config, and with it a row's rounding, from the
    expected row count, so every micro-batch takes the whole layer's config."""
    from mini.kernels.moe_combine import combine
    from mini.kernels.moe_route import plan_routes
    from mini.kernels.mxfp4_grouped_gemm import BLOCK_M

    if x.shape[0] == 0:  # an idle EP rank still joins the exchange
        out = torch.zeros(x.shape, dtype=out_dtype, device=x.device)
        return out if add is None else (out.float() + add.float()).to(out_dtype)
    act_quant = fake_quant_enabled()  # mini.formats.no_fake_quant() turns the activation fake quant off
    with stage("moe.routed.route_plan"):
        plan = plan_routes(ids, weights, w.experts, BLOCK_M, tiles=w.humming is None)
    rows = _rows_humming if w.humming is not None else _rows_triton
    y = rows(x, w, plan, (layer_pairs or ids.numel()) * len(w.experts) // w.gate.shape[0], act_quant)
    with stage("moe.routed.combine"):
        return combine(y, ids, plan.slot_row, w.experts, out_dtype, add=add, add_at=add_at)


@staged("moe.routed")
def routed_wire(rows, w: MoEWeights, weights: torch.Tensor, ids: torch.Tensor, add: torch.Tensor,
                add_at: int, layer_pairs: int | None = None) -> torch.Tensor:
    """`routed` for rows that arrived in the EP exchange's FP8 wire form (`mini.kernels.fp8_act_quant.FP8Rows`,
    N rows, their ids / weights [N, k] as views of the same buffer; id -1: a padding row), plus `add` (this rank's
    shared expert output, fp32 or bf16 [A, D]) on the rows add_at..add_at + A, fp32 [N, D]. The rows are decoded in
    the pass that gathers them for the GEMMs (where the one-device path quantizes), and `add` is summed in the
    combine, last, as `moe` sums the shared expert. Only where `routed_wire_ok`. `layer_pairs`: see
    `_routed_fast`."""
    return _routed_fast(rows, w, weights, ids, torch.float32, add=add, add_at=add_at, layer_pairs=layer_pairs)


def routed_wire_ok(x: torch.Tensor, ids: torch.Tensor, w: MoEWeights) -> bool:
    """Whether `routed_wire` serves this layer: the fast path, bf16 activations, the activation fake quant on."""
    return _fast_ok(x, ids, w) and x.dtype == torch.bfloat16 and fake_quant_enabled()


def pack_wire(x: torch.Tensor, block: int, codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor, ids_out: torch.Tensor, weights_out: torch.Tensor) -> None:
    """The EP exchange's send rows in `routed_wire`'s form (mini.parallel.exchange, the fused glue): x as FP8
    1 x `block` codes and E8M0 scales, each row's expert ids and weights beside them, written into views of one
    buffer (mini.kernels.fp8_act_quant.fp8_act_quant_wire)."""
    from mini.kernels.fp8_act_quant import fp8_act_quant_wire
    fp8_act_quant_wire(x, block, codes, scales, ids, weights, ids_out, weights_out)


def wire_rows(codes: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype):
    """Received wire rows (codes, scales of `pack_wire`) as `routed_wire` takes them."""
    from mini.kernels.fp8_act_quant import FP8Rows
    return FP8Rows(codes, scales, block, dtype)


def _rows_triton(x, w: MoEWeights, plan, expected_rows: int, act_quant: bool) -> torch.Tensor:
    """Expert outputs by sorted row through our kernels: grouped w1/w3 GEMM + SwiGLU epilogue, grouped w2 GEMM."""
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.mxfp4_grouped_gemm import grouped_down, grouped_swiglu
    xq = x
    if act_quant:
        with stage("moe.routed.act_quant"):
            xq = fp8_act_quant(x, w.w1.block)
    with stage("moe.routed.gemm_w13_swiglu"):
        h = grouped_swiglu(xq, plan, w.w1, w.w3, w.swiglu_limit, quant_block=w.w2.block if act_quant else 0)
    with stage("moe.routed.gemm_w2"):
        return grouped_down(h, plan, w.w2)


def _rows_humming(x, w: MoEWeights, plan, expected_rows: int, act_quant: bool) -> torch.Tensor:
    """Expert outputs by sorted row through Humming: the rows gathered in expert order and FP8-quantized in one
    pass, one GEMM for w1 and w3 side by side, the SwiGLU epilogue (clamps, routing weight, roundings, FP8 quant of
    w2's input) as its own pass, the w2 GEMM. `expected_rows` (local pairs on average) picks the tile config."""
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.humming_experts import grouped_gemm
    from mini.kernels.mxfp4_grouped_gemm import swiglu_rows
    w13, w2 = w.humming
    I = w13.n // 2
    n_valid = plan.expert_offset[-1:]  # the local row count, left on the device
    with stage("moe.routed.act_quant"):
        xs = fp8_act_quant(x, w.w1.block if act_quant else 0, rows=plan.token, n_valid=n_valid)
    invariant = deterministic()  # the library's batch-invariant schedules (humming_experts._tuning)
    with stage("moe.routed.gemm_humming"):
        gu = grouped_gemm(xs, w13, plan.expert_offset, expected_rows, invariant=invariant)
    with stage("moe.routed.swiglu"):
        h = swiglu_rows(gu[:, :I], gu[:, I:], plan.weight, n_valid, w.swiglu_limit, w.w2.block if act_quant else 0)
    with stage("moe.routed.gemm_humming"):
        return grouped_gemm(h, w2, plan.expert_offset, expected_rows, invariant=invariant)
