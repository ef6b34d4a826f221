"""A scaling model of the EP prefill step (issue 18 item 4): from the EP2 and one-GPU measurements, what EP4 and
EP8 should take, per MoE layer and per 40-layer step, for today's exchange and for an all-to-all one.

Not a measurement: every input is a number measured elsewhere (defaults below, each with its source) and every
output is arithmetic on them, so that the first 4- and 8-GPU runs have a number to meet and a way to say which
input was wrong. Run `python3 tools/ep_model.py` (options: `--help`; `--json FILE` writes the table); its inputs'
sources are in docs/parallel.md ("Scaling model") and report 010 (docs/perf/) used it.

Per MoE layer and rank, T tokens per rank, model width D, top-k of E experts, N ranks:
* today's exchange (mini/parallel/exchange.py): an all-gather of one wire row per token (`WireRow`: 5,328 bytes at
  V4.1-Flash) and a reduce-scatter of fp32 partial sums [N T, D]. NCCL runs both as rings (NVLink multicast, NVLS,
  is off on these machines): each rank receives (N - 1) T rows and sends (N - 1) T fp32 rows of partial sums,
  whatever the routing: the bytes per rank grow with N - 1.
* all-to-all (not built): a token's row goes only to the ranks holding one of its k experts (expected
  (N - 1) (1 - C(E - E/N, k) / C(E, k)) remote ranks), and each of those sends back either its fp32 partial sum
  (4 D bytes) or each expert's bf16 output (2 D bytes per pair; the owner then sums every expert output in slot
  order, exactly as one device does). The bytes per rank are bounded by min(N - 1, k) rows.
Collective time = bytes / the NCCL bus bandwidth measured on 2 H200s (docs/perf README; the same per-GPU bandwidth
is assumed at 4 and 8 GPUs, which NVSwitch systems usually meet or beat), times a calibration factor that makes the
model reproduce the EP2 communication measured inside ep-prefill (it holds the waits for the slower rank and the
smaller messages' lower efficiency).
Step: the one-GPU EP4 emulation (rank4: the same per-rank attention, gate, shared expert and routed pairs), minus
its emulation glue, plus the exchange glue, plus the exposed communication, plus (skewed routing) the wait for the
busiest rank's routed experts. The routed experts' GEMMs scale with their 128-row tile count (report 004: EP2's
w1/w3 GEMM ratio to rank4, 1.20, matched the tile ratio 1.19), which depends on the rows per local expert
(N T k / E on average).
Skew: RoutingSkew's law (rank4 --routing skewed): 48 of the 384 experts carry 2.5x the mean load; with the hot set
drawn at random over the experts, the busiest rank's load factor is estimated by drawing (seeded).
Overlap (MINI_EP_OVERLAP=m, mini/parallel/exchange.py): each layer's exchange in m micro-batches on one NCCL
stream; `exposed_ms` plays the layer's timeline (the m gathers back to back from the start; the shared expert, then
each part's experts once its gather is in; each part's scatter once its experts are done and the stream is free)
and returns the communication the compute waits for; the step also pays `overlap_slowdown` x the hidden part:
NCCL's kernels take SMs from the compute they run under (report 004: the shared expert ran ~20% slower under the
all-gather). Splitting costs the experts: each part fills its own 128-row tiles, so a local expert's ~N T k / E
rows (128 at EP2, 4,096 tokens per rank) take m E[ceil(Poisson(rows / m) / 128)] tiles instead of
E[ceil(Poisson(rows) / 128)]. Measured on an H200 (`mini bench ep-exchange --parts`, EP2 shape, 15:30 call): the
routed experts 4.130 ms in one piece, 6.555 with 2 parts (+59%; tile ratio 1.355) and 13.23 with 4 (+220%; tile
ratio 2.709): the time grows faster than the tile count (per-part launches, route plan, act quant and combine
besides). The model charges the routed experts' time x `parts_cost` x (tile ratio - 1), `parts_cost` = 1.65
fitted to the 2-part point (it overstates the 4-part one: +12.6 ms/layer against +9.1 measured), and the longer
experts hide more of the communication.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass, field
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.parallel.exchange import WireRow  # noqa: E402


@dataclass(frozen=True)
class Inputs:
    """The model's measured inputs (defaults: V4.1-Flash at 4,096 tokens per rank, H200s)."""
    tokens: int = 4096  # per rank
    dim: int = 5120
    topk: int = 6
    experts: int = 384
    block: int = 32
    layers: int = 40
    # NCCL bus bandwidths on 2x H200 (NV18), 512 MiB per rank: docs/perf/README.md (/work/shared/perf/README.md)
    all_gather_gbps: float = 267.0
    reduce_scatter_gbps: float = 240.0
    all_to_all_gbps: float = 240.0  # not measured: taken as the slower of the two
    # EP2 communication inside ep-prefill, 16 layers, 4,096 tokens/rank (issue 18): 9.4 ms per 16 layers
    ep2_comm_ms_per_layer: float = 9.4 / 16
    # one-GPU EP4 emulation (rank4, uniform routing) at 1a59fd5: 329.9 ms/step (lead notes 12:27); its EP
    # emulation 10.2 ms/step and routed experts' Humming GEMMs 128.7 ms/step (docs/perf/007)
    rank4_step_ms: float = 329.9
    rank4_emulation_ms: float = 10.2
    rank4_gemm_ms: float = 128.7
    rank4_routed_ms: float = 154.2  # the routed experts' stage, GEMMs included (docs/perf/007)
    # exchange glue per layer: eager 21.9 ms per 16 layers at EP2 inside ep-prefill (issue 18); fused: `mini bench
    # ep-exchange --glue` on an H200 at 6deedfb, alone (host launch included): 0.199 at EP2, 0.259 at EP4 (taken)
    glue_eager_ms_per_layer: float = 21.9 / 16
    glue_fused_ms_per_layer: float = 0.259
    # RoutingSkew (mini/testing/emulated_ep.py): hot experts and their load relative to the mean
    hot_experts: int = 48
    hot_load: float = 2.5
    tile_rows: int = 128
    skew_draws: int = 2000
    seed: int = 0
    # overlap: micro-batches per layer; the shared expert per layer on 4,096 tokens (rank4 profile at 56388c4:
    # 19.9 ms / 40 layers, lead notes 15:00 / docs/perf 009); compute slowdown under concurrent NCCL (report 004)
    micro_batches: int = 2
    shared_ms_per_layer: float = 19.9 / 40
    overlap_slowdown: float = 0.2
    # routed experts' extra time per extra 128-row tile when split into parts, relative to the tile ratio: fitted
    # to ep-exchange --parts at EP2 on an H200 (15:30 call: 4.130 -> 6.555 ms with 2 parts, tile ratio 1.355)
    parts_cost: float = (6.555 / 4.130 - 1) / 0.355


def p_no_expert_on_rank(experts: int, held: int, k: int) -> float:
    """P(a token's k distinct experts, drawn uniformly, avoid a rank holding `held` of `experts`): C(E-h, k)/C(E, k)."""
    return math.comb(experts - held, k) / math.comb(experts, k)


def pairs_on_rank_pmf(experts: int, held: int, k: int) -> list[float]:
    """Distribution of how many of a token's k experts a rank holding `held` of them has (hypergeometric)."""
    total = math.comb(experts, k)
    return [math.comb(held, j) * math.comb(experts - held, k - j) / total for j in range(k + 1)]


def expected_tiles(rows_mean: float, tile: int) -> float:
    """E[ceil(X / tile)] for X ~ Poisson(rows_mean): an expert's row tiles under uniform routing."""
    # Poisson pmf summed far enough out (mean + 12 sd)
    top = int(rows_mean + 12 * math.sqrt(rows_mean) + 10)
    p, out = math.exp(-rows_mean), 0.0
    for x in range(top + 1):
        if x:
            p *= rows_mean / x
        out += p * math.ceil(x / tile)
    return out


def busiest_rank_load(inp: Inputs, ranks: int) -> float:
    """Mean over seeded draws of the busiest rank's routed load / the mean load, RoutingSkew's law, hot experts drawn
    uniformly over the expert ids (contiguous ranges per rank, as expert_range)."""
    held = inp.experts // ranks
    cold = (inp.experts - inp.hot_experts * inp.hot_load) / (inp.experts - inp.hot_experts)
    rng = random.Random(inp.seed)
    total = 0.0
    for _ in range(inp.skew_draws):
        hot = rng.sample(range(inp.experts), inp.hot_experts)
        per_rank = [0] * ranks
        for e in hot:
            per_rank[e // held] += 1
        h = max(per_rank)
        total += (h * inp.hot_load + (held - h) * cold) / held
    return total / inp.skew_draws


@dataclass
class Prediction:
    ranks: int
    # bytes per rank per layer (MB = 1e6 bytes)
    ring_all_gather_mb: float
    ring_reduce_scatter_mb: float
    a2a_remote_ranks_per_token: float
    a2a_dispatch_mb: float
    a2a_combine_fp32_mb: float
    a2a_combine_bf16_pairs_mb: float
    # ms per layer
    ring_comm_ms: float
    a2a_comm_ms: float
    routed_ms_delta: float  # the routed experts against rank4's (tile fill; per layer)
    busiest_load: float  # skewed routing: busiest rank's load / mean
    skew_wait_ms: float
    # ms per step (inp.layers layers)
    step_ring_ms: float
    step_ring_eager_glue_ms: float
    step_a2a_ms: float
    step_ring_skewed_ms: float
    comm_share_ring: float
    tok_per_s_per_gpu_ring: float
    # the same exchanges in inp.micro_batches parts: ms per layer the compute waits (ep-prefill's communication
    # stage), ms per layer the step pays (that + the slowdown of the compute under the hidden part), step ms,
    # (paid + glue + split cost) share of the step
    parts_tile_ratio: float  # the routed experts' 128-row tiles in inp.micro_batches parts / in one piece
    parts_cost_ms: float  # what the split adds to the routed experts, ms/layer
    ring_stall_overlap_ms: float
    a2a_stall_overlap_ms: float
    ring_exposed_overlap_ms: float
    a2a_exposed_overlap_ms: float
    step_ring_overlap_ms: float
    step_a2a_overlap_ms: float
    exposed_share_ring_overlap: float
    exposed_share_a2a_overlap: float
    extra: dict = field(default_factory=dict)


def exposed_ms(gather: float, scatter: float, shared: float, experts: float, parts: int) -> float:
    """Communication (ms) a layer's compute waits for (what ep-prefill's `stage.communication` shows) when its
    exchange runs in `parts` micro-batches on one collective stream (see the module doc). `gather` / `scatter`:
    the whole layer's collective times; `shared`, `experts`: its compute. parts = 1 is the order without overlap
    (the gather under the shared expert, the scatter after the experts)."""
    stream, gathered = 0.0, []
    for _ in range(parts):  # all gathers issued at the start, back to back
        stream += gather / parts
        gathered.append(stream)
    t = shared
    for i in range(parts):
        t = max(t, gathered[i]) + experts / parts  # part i's experts once its rows are in
        stream = max(stream, t) + scatter / parts  # its scatter once the experts are done and the stream is free
    return max(t, stream) - (shared + experts)


def calibration(inp: Inputs) -> float:
    """measured EP2 communication / the bandwidth floor of its bytes."""
    floor = _ring_ms(inp, 2, 1.0)
    return inp.ep2_comm_ms_per_layer / floor


def _ring_bytes(inp: Inputs, ranks: int) -> tuple[float, float]:
    row = WireRow(inp.topk, inp.dim, inp.block).width
    return (ranks - 1) * inp.tokens * row, (ranks - 1) * inp.tokens * inp.dim * 4


def _ring_ms(inp: Inputs, ranks: int, calib: float) -> float:
    ag, rs = _ring_bytes(inp, ranks)
    return calib * (ag / inp.all_gather_gbps + rs / inp.reduce_scatter_gbps) / 1e6


def _overlapped(inp: Inputs, gather: float, scatter: float, experts: float) -> tuple[float, float]:
    """(the compute's wait, what the step pays: the wait + the slowdown charged for the hidden part), ms/layer."""
    stall = exposed_ms(gather, scatter, inp.shared_ms_per_layer, experts, inp.micro_batches)
    return stall, stall + inp.overlap_slowdown * (gather + scatter - stall)


def predict(inp: Inputs, ranks: int) -> Prediction:
    calib = calibration(inp)
    held = inp.experts // ranks
    row = WireRow(inp.topk, inp.dim, inp.block).width
    ag, rs = _ring_bytes(inp, ranks)
    hit = 1.0 - p_no_expert_on_rank(inp.experts, held, inp.topk)
    remote = (ranks - 1) * hit
    pmf = pairs_on_rank_pmf(inp.experts, held, inp.topk)
    dispatch = inp.tokens * remote * row
    combine_fp32 = inp.tokens * remote * inp.dim * 4
    combine_bf16 = inp.tokens * (ranks - 1) * sum(j * p for j, p in enumerate(pmf)) * inp.dim * 2
    combine = min(combine_fp32, combine_bf16)
    ring_ms = _ring_ms(inp, ranks, calib)
    a2a_ms = calib * (dispatch + combine) / inp.all_to_all_gbps / 1e6
    # routed experts: GEMM time by expected tile count against rank4's (EP4)
    rows_per_expert = lambda n: n * inp.tokens * inp.topk / inp.experts  # noqa: E731
    tiles = lambda n: (inp.experts // n) * expected_tiles(rows_per_expert(n), inp.tile_rows)  # noqa: E731
    gemm_layer = inp.rank4_gemm_ms / inp.layers
    routed_delta = gemm_layer * (tiles(ranks) / tiles(4) - 1.0)
    load = busiest_rank_load(inp, ranks)
    routed_layer = inp.rank4_routed_ms / inp.layers + routed_delta
    skew_wait = routed_layer * (load - 1.0)
    base = inp.rank4_step_ms - inp.rank4_emulation_ms + inp.layers * routed_delta
    L = inp.layers
    step_ring = base + L * (inp.glue_fused_ms_per_layer + ring_ms)
    step_ring_eager = base + L * (inp.glue_eager_ms_per_layer + ring_ms)
    step_a2a = base + L * (inp.glue_fused_ms_per_layer + a2a_ms)
    ring_parts = (ag / inp.all_gather_gbps, rs / inp.reduce_scatter_gbps)
    a2a_parts = (dispatch / inp.all_to_all_gbps, combine / inp.all_to_all_gbps)
    m = inp.micro_batches
    tile_ratio = m * expected_tiles(rows_per_expert(ranks) / m, inp.tile_rows) / expected_tiles(
        rows_per_expert(ranks), inp.tile_rows)
    split_cost = routed_layer * inp.parts_cost * (tile_ratio - 1.0)  # ms/layer the split adds to the experts
    (ring_stall, ring_exp), (a2a_stall, a2a_exp) = (
        _overlapped(inp, calib * g / 1e6, calib * c / 1e6, routed_layer + split_cost)
        for g, c in (ring_parts, a2a_parts))
    step_ring_ov = base + L * (inp.glue_fused_ms_per_layer + ring_exp + split_cost)
    step_a2a_ov = base + L * (inp.glue_fused_ms_per_layer + a2a_exp + split_cost)
    return Prediction(
        ranks=ranks, ring_all_gather_mb=ag / 1e6, ring_reduce_scatter_mb=rs / 1e6,
        a2a_remote_ranks_per_token=remote, a2a_dispatch_mb=dispatch / 1e6, a2a_combine_fp32_mb=combine_fp32 / 1e6,
        a2a_combine_bf16_pairs_mb=combine_bf16 / 1e6, ring_comm_ms=ring_ms, a2a_comm_ms=a2a_ms,
        routed_ms_delta=routed_delta, busiest_load=load, skew_wait_ms=skew_wait,
        step_ring_ms=step_ring, step_ring_eager_glue_ms=step_ring_eager, step_a2a_ms=step_a2a,
        step_ring_skewed_ms=step_ring + L * skew_wait, comm_share_ring=L * ring_ms / step_ring,
        tok_per_s_per_gpu_ring=inp.tokens / (step_ring / 1e3),
        parts_tile_ratio=tile_ratio, parts_cost_ms=split_cost,
        ring_stall_overlap_ms=ring_stall, a2a_stall_overlap_ms=a2a_stall,
        ring_exposed_overlap_ms=ring_exp, a2a_exposed_overlap_ms=a2a_exp, step_ring_overlap_ms=step_ring_ov,
        step_a2a_overlap_ms=step_a2a_ov,
        exposed_share_ring_overlap=L * (ring_exp + inp.glue_fused_ms_per_layer + split_cost) / step_ring_ov,
        exposed_share_a2a_overlap=L * (a2a_exp + inp.glue_fused_ms_per_layer + split_cost) / step_a2a_ov,
        extra={"rows_per_local_expert": rows_per_expert(ranks), "tiles_per_layer": tiles(ranks),
               "calibration": calib})


def table(inp: Inputs, ranks=(2, 4, 8)) -> list[Prediction]:
    return [predict(inp, n) for n in ranks]


def render(inp: Inputs, preds: list[Prediction]) -> str:
    rows = [
        ("ring all-gather in, MB/layer", "ring_all_gather_mb", "{:.1f}"),
        ("ring reduce-scatter out, MB/layer", "ring_reduce_scatter_mb", "{:.1f}"),
        ("a2a remote ranks per token", "a2a_remote_ranks_per_token", "{:.2f}"),
        ("a2a dispatch out, MB/layer", "a2a_dispatch_mb", "{:.1f}"),
        ("a2a combine fp32 partials, MB/layer", "a2a_combine_fp32_mb", "{:.1f}"),
        ("a2a combine bf16 per pair, MB/layer", "a2a_combine_bf16_pairs_mb", "{:.1f}"),
        ("ring communication, ms/layer", "ring_comm_ms", "{:.2f}"),
        ("a2a communication, ms/layer", "a2a_comm_ms", "{:.2f}"),
        ("routed experts vs rank4, ms/layer", "routed_ms_delta", "{:+.2f}"),
        ("skewed: busiest rank load / mean", "busiest_load", "{:.2f}"),
        ("skewed: wait for it, ms/layer", "skew_wait_ms", "{:.2f}"),
        ("step, ring + fused glue, no overlap", "step_ring_ms", "{:.0f}"),
        ("step, ring + eager glue", "step_ring_eager_glue_ms", "{:.0f}"),
        ("step, all-to-all + fused glue", "step_a2a_ms", "{:.0f}"),
        ("step, ring, skewed routing", "step_ring_skewed_ms", "{:.0f}"),
        ("communication share (ring)", "comm_share_ring", "{:.1%}"),
        ("tok/s/GPU (ring, fused glue)", "tok_per_s_per_gpu_ring", "{:,.0f}"),
        (f"{inp.micro_batches} parts: expert tiles / one piece", "parts_tile_ratio", "{:.2f}"),
        (f"{inp.micro_batches} parts: routed experts +ms/layer", "parts_cost_ms", "{:+.2f}"),
        (f"ring, {inp.micro_batches} parts: wait ms/layer", "ring_stall_overlap_ms", "{:.2f}"),
        (f"ring, {inp.micro_batches} parts: paid ms/layer", "ring_exposed_overlap_ms", "{:.2f}"),
        (f"a2a, {inp.micro_batches} parts: wait ms/layer", "a2a_stall_overlap_ms", "{:.2f}"),
        (f"a2a, {inp.micro_batches} parts: paid ms/layer", "a2a_exposed_overlap_ms", "{:.2f}"),
        (f"step, ring, {inp.micro_batches} parts", "step_ring_overlap_ms", "{:.0f}"),
        (f"step, all-to-all, {inp.micro_batches} parts", "step_a2a_overlap_ms", "{:.0f}"),
        ("paid comm + glue + split share, ring", "exposed_share_ring_overlap", "{:.1%}"),
        ("paid comm + glue + split share, a2a", "exposed_share_a2a_overlap", "{:.1%}"),
    ]
    head = f"{'per rank, ' + str(inp.tokens) + ' tokens/rank, ' + str(inp.layers) + ' layers':40s}" + "".join(
        f"{'EP' + str(p.ranks):>10s}" for p in preds)
    lines = [head] + [f"{name:40s}" + "".join(f"{fmt.format(getattr(p, key)):>10s}" for p in preds)
                      for name, key, fmt in rows]
    lines.append(f"(calibration: measured EP2 communication = {preds[0].extra['calibration']:.2f} x the bandwidth "
                 f"floor of its bytes; steps are rank4's {inp.rank4_step_ms} ms - {inp.rank4_emulation_ms} ms "
                 f"emulation + glue + communication; the last rows with the exchange in {inp.micro_batches} "
                 f"micro-batches, {inp.overlap_slowdown:.0%} of the hidden communication charged to compute)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 tools/ep_model.py", description=__doc__.split("\n\n")[0])
    for f in Inputs.__dataclass_fields__.values():
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--json", type=Path, default=None)
    args = vars(p.parse_args(argv))
    ranks, out = args.pop("ranks"), args.pop("json")
    inp = Inputs(**args)
    preds = table(inp, ranks)
    print(render(inp, preds))
    if out is not None:
        out.write_text(json.dumps({"inputs": asdict(inp), "predictions": [asdict(x) for x in preds]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
