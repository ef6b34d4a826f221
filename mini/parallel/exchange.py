"""The MoE exchange of EP with DP attention: each rank routes its own tokens, all ranks see all tokens, each rank
runs only the routed experts it holds, and the partial sums are reduce-scattered back to the tokens' owners.

Per MoE layer, for the T_r tokens of rank r:
1. gate locally (fp32 logits from the unquantized input, as on one device) -> routing weights [T_r, k], ids;
2. all-gather one byte row per token: the input in the FP8 1 x block form every expert GEMM quantizes it to
   anyway (e4m3 codes + E8M0 scales: 1 + 1/block bytes per element instead of 2), the k expert ids (int32) and
   the k routing weights (fp32). Rows are padded to the largest T_r of the step;
3. `mini.ops.moe.routed` over the gathered tokens with this rank's experts -> fp32 partial sums [sum T, D];
4. reduce-scatter (sum) the fp32 partial sums: rank r gets the routed output of its own tokens;
5. add the shared expert, computed locally, and round to the activation dtype: (routed + shared).to(dtype), the
   order of the single-device `mini.ops.moe.moe` (and of the reference's all-reduce, then shared expert).

Decoding the gathered FP8 rows gives exactly `fake_quant_fp8(x)`, and fake quantization is idempotent, so the
experts compute what they would on the original input; only the cross-rank fp32 summation order differs from one
device. When fake quantization is switched off (`no_fake_quant`), the raw activations travel instead.

The glue around the collectives comes in two forms, chosen by MINI_EP_GLUE (or `MoEExchange(glue=)`):
* "fused" (the default, where `mini.ops.moe.routed_wire_ok`: the fast path on bf16 activations with the fake quant
  on): the act-quant kernel writes the wire rows (codes, scales, ids, weights) straight into the send buffer
  (`mini.ops.moe.pack_wire`); the received rows are decoded in the pass that gathers them for the expert GEMMs
  (`routed_wire`: where one device quantizes them); padding rows carry expert id -1 and are never computed; the
  shared expert is added in the combine, to this rank's rows before the reduce-scatter (step 5 moves into step
  3), so after the reduce-scatter only the rounding to bf16 is left. Every expert output and the shared one are
  bf16 values summed in fp32, as in the other order (docs/parallel.md has the exactness argument);
* "eager": the torch-op pack / unpack / add around the same collectives; also every other case (CPU reference,
  fp32, fake quant off). Kept for A/B (`mini bench ep-exchange --glue`).

Communication overlapped with compute (issue 18 item 3), MINI_EP_OVERLAP=N (or `MoEExchange(micro_batches=)`;
default 1, off, until measured on 2 GPUs): each rank's tokens are split into N micro-batches (rank r's i-th holds
its tokens [T_r i / N, T_r (i + 1) / N)), each with its own padded send buffer, all-gather and reduce-scatter, all
issued asynchronously (fewer parts where the largest rank's part would hold under MINI_EP_OVERLAP_MIN_TOKENS rows,
default 256: decode steps stay whole). Every all-gather is in flight before the shared expert runs, the i-th
reduce-scatter runs under the experts of micro-batch i + 1, and only the last one's reduce-scatter (1/N of the
bytes) and whatever part of the first all-gather outlasts the shared expert stay exposed. The gate and the shared
expert still see the whole layer. A token's row goes through the same kernels with the same per-row math in
whichever micro-batch it sits: the grouped GEMMs' tiles do not depend on a row's neighbours once the tile config is
fixed, and every micro-batch takes the whole layer's config (`routed(layer_pairs=)`); the combine sums a token's
slots in slot order within its own micro-batch. So the overlapped output equals the plain one bit for bit on the
fast path (the tests check it on the interpreted kernels); the cross-rank sum is two values at EP2 (order-free)
and, beyond, exact in any order under the condition docs/parallel.md states. The CPU reference's per-expert torch
GEMMs (oneDNN / MKL) may block rows by M, so there the guarantee is the reference's own (within fp32 rounding),
not bits.

Call `begin_step(n_tokens)` once per forward step (it exchanges the token counts); a rank without tokens in a step
where others have some still runs every MoE layer, with an empty input (`join_idle`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mini import switches
from mini.config import LayerPlan, ModelConfig
from mini.parallel.groups import DistContext
from mini.formats.e8m0 import e8m0_to_float, pow2_ceil_scale
from mini.formats.fp8 import FP8_MAX, to_e4m3
from mini.formats.quant import fake_quant_enabled
from mini.ops.moe import MoEWeights, gate, pack_wire, routed, routed_wire, routed_wire_ok, shared, wire_rows

# torch >= 2.13 names them *_single; 2.11 only has the *_tensor spellings
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def encode_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (e4m3 codes uint8 [T, D], E8M0 scales uint8 [T, D/block]); same scales as fake_quant_fp8."""
    g = x.float().unflatten(-1, (-1, block))
    s = pow2_ceil_scale(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1.0 / FP8_MAX))
    codes = to_e4m3(g / s).flatten(-2).view(torch.uint8)
    return codes, ((s.squeeze(-1).view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def decode_fp8(codes: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of encode_fp8: equals fake_quant_fp8(x, block) bit for bit."""
    g = codes.view(torch.float8_e4m3fn).float().unflatten(-1, (-1, block))
    return (g * e8m0_to_float(scales).unsqueeze(-1)).flatten(-2).to(dtype)


GLUES = ("fused", "eager")


def glue_choice(glue: str | None = None) -> str:
    """`glue`, else MINI_EP_GLUE (mini.switches), else "fused"; an unknown name is refused."""
    choice = glue or switches.current().ep_glue
    if choice not in GLUES:
        raise ValueError(f"EP exchange glue {choice!r} (MINI_EP_GLUE): choose one of {', '.join(GLUES)}")
    return choice


def overlap_min_tokens() -> int:
    """MINI_EP_OVERLAP_MIN_TOKENS (mini.switches; default 256): the fewest rows of the largest rank per
    micro-batch."""
    return switches.current().ep_overlap_min_tokens


def overlap_choice(micro_batches: int | None = None) -> int:
    """`micro_batches`, else MINI_EP_OVERLAP (mini.switches: "off" = 1, "on" = 2), else 1: how many micro-batches
    each MoE layer's exchange is split into (1: not overlapped); anything but a positive integer is refused."""
    if micro_batches is None:
        micro_batches = switches.current().ep_overlap
    elif micro_batches < 1:
        raise ValueError(f"EP exchange micro_batches must be >= 1, got {micro_batches}")
    return micro_batches


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step's exchange: every rank's rows of it (`counts`) and where they start among that
    rank's tokens (`starts`). Rows travel padded to the largest count, `t_max`."""
    counts: tuple[int, ...]
    starts: tuple[int, ...]

    @property
    def t_max(self) -> int:
        return max(self.counts)

    def rows(self, rank: int) -> slice:
        """This micro-batch's rows of `rank`'s tokens."""
        return slice(self.starts[rank], self.starts[rank] + self.counts[rank])

    def valid_rows(self, device) -> torch.Tensor | None:
        """Indices of the real rows in the padded gathered layout, rank by rank (None: no padding)."""
        t_max = self.t_max
        if min(self.counts) == t_max:
            return None
        return torch.cat([torch.arange(r * t_max, r * t_max + n, device=device) for r, n in enumerate(self.counts)])


def micro_batches(counts: list[int], n: int, min_rows: int = 1) -> list[MicroBatch]:
    """Each rank's tokens split into `n` contiguous parts of near-equal size (every rank computes the same split
    from the exchanged counts), fewer where the largest rank would get under `min_rows` rows a part (a small step,
    e.g. decode, whose collectives are latency-bound, stays in one piece); parts in which no rank has a row are
    dropped, so a step of one token per rank runs one exchange, not n."""
    n = max(1, min(n, max(counts, default=0) // max(min_rows, 1)))
    parts = []
    for i in range(n):
        starts = tuple(t * i // n for t in counts)
        sizes = tuple(t * (i + 1) // n - a for t, a in zip(counts, starts))
        if any(sizes):
            parts.append(MicroBatch(sizes, starts))
    return parts or [MicroBatch(tuple(counts), (0,) * len(counts))]


@dataclass(frozen=True)
class WireRow:
    """One token's bytes on the wire in the FP8 form: expert ids int32 [k], routing weights fp32 [k], e4m3 codes
    [D], E8M0 scales [D / block], padding to 16 bytes. The 4-byte fields come first and rows are 16-byte multiples,
    so int32 / fp32 views of any row stay aligned (the eager `pack` writes the same layout)."""
    k: int
    dim: int
    block: int

    @property
    def width(self) -> int:
        used = 8 * self.k + self.dim + self.dim // self.block
        return used + (-used % 16)

    def fields(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of byte rows `buf` [N, width]: (ids int32 [N, k], weights fp32 [N, k], codes [N, D],
        scales [N, D / block])."""
        k, d = self.k, self.dim
        return (buf.view(torch.int32)[:, :k], buf.view(torch.float32)[:, k: 2 * k], buf[:, 8 * k: 8 * k + d],
                buf[:, 8 * k + d: 8 * k + d + d // self.block])


class MoEExchange:
    """A drop-in for `mini.ops.moe.moe` (same call signature) that spreads the routed experts over the ranks of
    `ctx`; pass it as `Model(..., moe_exchange=...)` on a rank that holds the routed experts
    `mini.checkpoint.expert_range(config, ctx.rank, ctx.world)` (`mini.parallel.dp.DPModel` does both)."""

    def __init__(self, ctx: DistContext, glue: str | None = None, micro_batches: int | None = None):
        self.ctx = ctx
        self.glue = glue_choice(glue)
        self.micro_batches = overlap_choice(micro_batches)  # per MoE layer; 1: communication not overlapped
        self.min_part_tokens = overlap_min_tokens()  # a smaller step is split into fewer parts
        self.counts: list[int] | None = None
        self._rows: torch.Tensor | None = None  # valid rows of the padded gather (None: no padding)
        # diagnostics (`mini bench ep-exact --trace`): called as trace(layer, site, tensor) with this rank's
        # MoE input, gate ids and weights, routed sum (after the reduce-scatter) and shared expert output
        self.trace = None
        self._layer = -1

    # ------------------------------------------------------------------ per step
    def begin_step(self, n_tokens: int) -> int:
        """Exchange this step's token counts; returns the total over all ranks (0: every rank may skip the step)."""
        if not self.ctx.multi:
            self.counts, self._rows = [n_tokens], None
            return n_tokens
        mine = torch.tensor([n_tokens], dtype=torch.int64, device=self.ctx.device)
        every = torch.empty(self.ctx.world, dtype=torch.int64, device=self.ctx.device)
        all_gather(every, mine)
        self.set_counts(every.tolist())
        return sum(self.counts)

    def set_counts(self, counts: list[int]) -> None:
        """Every rank's token count of this step (what `begin_step` exchanges; `mini bench ep-exchange --glue`
        sets them itself to run the glue without collectives)."""
        self.counts = list(counts)
        self._rows = MicroBatch(tuple(self.counts), (0,) * len(self.counts)).valid_rows(self.ctx.device)

    def join_idle(self, layers: Iterable[tuple[MoEWeights, LayerPlan]], cfg: ModelConfig,
                  dtype: torch.dtype) -> None:
        """Take part in every MoE layer of a step in which this rank has no tokens (after begin_step(0))."""
        empty = torch.empty(0, cfg.dim, dtype=dtype, device=self.ctx.device)
        ids = torch.empty(0, dtype=torch.int64, device=self.ctx.device)
        for w, plan in layers:
            self(empty, w, cfg, plan, input_ids=ids)

    # ------------------------------------------------------------------ per layer
    def __call__(self, x: torch.Tensor, w: MoEWeights, cfg: ModelConfig, plan: LayerPlan,
                 input_ids: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.counts is None or x.shape[0] != self.counts[self.ctx.rank]:
            raise RuntimeError(f"MoEExchange: call begin_step({x.shape[0]}) before the step's forward "
                               f"(counts of this step: {self.counts})")
        weights, ids = gate(x, w, cfg, plan, input_ids, image_mask)
        self._layer = plan.layer
        self._record("moe_in", x)
        self._record("gate_ids", ids)
        self._record("gate_weights", weights)
        if not self.ctx.multi:
            mine, own = routed(x, w, cfg, weights, ids), shared(x, w)
            self._record("routed", mine)
            self._record("shared", own)
            return (mine + own).to(x.dtype)
        if self.glue == "fused" and routed_wire_ok(x, ids, w):
            pairs = self.ctx.world * max(self.counts) * ids.shape[1]  # the gathered ids, padding included
            return self.exchange_wire(
                x, weights, ids, cfg.fp8_block, local=lambda: shared(x, w, x.dtype),
                experts=lambda rows, wa, ia, add, at: routed_wire(rows, w, wa, ia, add, at, layer_pairs=pairs))
        pairs = sum(self.counts) * ids.shape[1]
        out = self.exchange(x, weights, ids, cfg.fp8_block, local=lambda: shared(x, w),
                            experts=lambda xa, wa, ia: routed(xa, w, cfg, wa, ia, layer_pairs=pairs))
        return out.to(x.dtype)

    def _record(self, site: str, t: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace(self._layer, site, t)

    def exchange(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, block: int, experts, local
                 ) -> torch.Tensor:
        """The communication around the experts: all-gather the rows, `experts(x_all, weights_all, ids_all)` ->
        fp32 partial sums, reduce-scatter them, add `local()` (fp32, computed while the all-gathers are in flight);
        returns fp32 [T, D] for this rank's tokens. In `micro_batches` parts (the module doc's overlap): each part's
        reduce-scatter runs under the next part's experts. `mini.bench.ep_exchange` times it with stand-in
        experts."""
        rank = self.ctx.rank
        gathers = []
        for part in micro_batches(self.counts, self.micro_batches, self.min_part_tokens):
            r = part.rows(rank)
            send, widths = self.pack(x[r], weights[r], ids[r], block, part)
            recv = send.new_empty(self.ctx.world * send.shape[0], send.shape[1])
            gathers.append((part, send, recv, widths, all_gather(recv, send, async_op=True)))
        own = local()
        scatters = []
        for part, _send, recv, widths, pending in gathers:
            pending.wait()
            partial = experts(*self._unpack(recv, widths, x.dtype, block, part))  # fp32 [sum of counts, D]
            scatters.append((part, *self._scatter(partial, part)))
        routed_sum = []
        for part, out, _partial, pending in scatters:
            pending.wait()
            routed_sum.append(out[: x[part.rows(rank)].shape[0]])
        mine = routed_sum[0] if len(routed_sum) == 1 else torch.cat(routed_sum)
        self._record("routed", mine)
        self._record("shared", own)
        return mine + own

    def exchange_wire(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, block: int, experts, local
                      ) -> torch.Tensor:
        """`exchange` with the glue in the kernels (the module doc's "fused"), in x.dtype [T, D]. `experts(rows,
        weights_all, ids_all, add, add_at)` -> fp32 [world * t_max, D] partial sums over one part's padded gathered
        rows (`mini.ops.moe.wire_rows`, ids -1 on padding rows), with `add` = this part's rows of `local()` ([A, D],
        bf16 values in bf16 or fp32) summed into rows add_at.."""
        rank, world = self.ctx.rank, self.ctx.world
        row = WireRow(ids.shape[1], x.shape[1], block)
        gathers = []
        for part in micro_batches(self.counts, self.micro_batches, self.min_part_tokens):
            r = part.rows(rank)
            send = torch.empty(part.t_max, row.width, dtype=torch.uint8, device=x.device)
            ids_out, weights_out, codes, scales = row.fields(send)
            pack_wire(x[r], block, codes, scales, ids[r], weights[r], ids_out, weights_out)
            recv = send.new_empty(world * part.t_max, row.width)
            gathers.append((part, send, recv, all_gather(recv, send, async_op=True)))
        own = local()
        scatters = []
        for part, _send, recv, pending in gathers:
            pending.wait()
            ids_all, weights_all, codes, scales = row.fields(recv)
            partial = experts(wire_rows(codes, scales, block, x.dtype), weights_all, ids_all, own[part.rows(rank)],
                              rank * part.t_max)
            out = torch.empty(part.t_max, x.shape[1], dtype=torch.float32, device=x.device)
            scatters.append((part, out, partial, reduce_scatter(out, partial, async_op=True)))
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        routed_sum = []
        for part, out, _partial, pending in scatters:
            pending.wait()
            r = part.rows(rank)
            mine = out[: y[r].shape[0]]
            y[r] = mine  # the one rounding left (copy_ rounds as .to does)
            routed_sum.append(mine)
        if self.trace is not None:  # the routed sum alone: exact when routed + shared is (see docs/parallel.md)
            self._record("routed", torch.cat(routed_sum) - own.float())
            self._record("shared", own.float())
        return y

    def pack(self, x, weights, ids, block, part: MicroBatch | None = None) -> tuple[torch.Tensor, list[int]]:
        """One byte row per token, padded to the largest count of `part` (default: the whole step): (rows
        [t_max, width], field widths). The 4-byte fields come first and rows are padded to 16 bytes: a one-row
        piece of the split in `_unpack` stays a view, and reading it as int32 / fp32 needs aligned offsets and
        strides."""
        payload = [ids.to(torch.int32).view(torch.uint8), weights.float().contiguous().view(torch.uint8)]
        if fake_quant_enabled():
            payload += list(encode_fp8(x, block))
        else:
            payload.append(x.contiguous().view(torch.uint8).view(x.shape[0], x.shape[1] * x.element_size()))
        widths = [p.shape[1] for p in payload]
        used = sum(widths)
        widths.append(-used % 16)
        send = x.new_zeros(part.t_max if part else max(self.counts), used + widths[-1], dtype=torch.uint8)
        send[: x.shape[0], :used] = torch.cat(payload, dim=1)
        return send, widths

    def _unpack(self, recv, widths, dtype, block, part: MicroBatch | None = None):
        """The valid rows of all ranks of `part` (default: the whole step), in rank order: (x [sum T, D] in
        `dtype`, weights fp32, ids int64)."""
        rows = part.valid_rows(recv.device) if part else self._rows
        if rows is not None:
            recv = recv[rows]
        n, k = recv.shape[0], widths[0] // 4
        fields = [p.contiguous() for p in torch.split(recv, widths, dim=1)]
        ids = fields[0].view(torch.int32).view(n, k).long()
        weights = fields[1].view(torch.float32).view(n, k)
        if len(fields) == 5:  # ids, weights, e4m3 codes, E8M0 scales, padding
            x = decode_fp8(fields[2], fields[3], block, dtype)
        else:  # ids, weights, raw activations, padding
            x = fields[2].view(dtype).view(n, fields[2].shape[1] // dtype.itemsize)
        return x, weights, ids

    def _scatter(self, partial: torch.Tensor, part: MicroBatch):
        """Start summing the ranks' fp32 partial outputs of `part`; rank r gets the rows of its own tokens (padded
        to the part's largest count): (out [t_max, D], the padded input (kept until the sum is done), the
        pending work)."""
        t_max, rows = part.t_max, part.valid_rows(partial.device)
        if rows is not None:
            padded = torch.zeros(self.ctx.world * t_max, partial.shape[1], dtype=partial.dtype, device=partial.device)
            partial = padded.index_copy_(0, rows, partial)
        partial = partial.contiguous()
        out = torch.empty(t_max, partial.shape[1], dtype=partial.dtype, device=partial.device)
        return out, partial, reduce_scatter(out, partial, async_op=True)
