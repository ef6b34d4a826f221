"""`mini check ep-exact` (also `mini bench ep-exact`, its name before): greedy decoding on N EP/DP ranks against one
rank holding every expert, same device, same kernels.

Every rank draws the same random model (its own 1/N of the routed experts), takes its own prompts (odd lengths, a
different number of sequences on each rank, so the exchange pads) and runs a prefill plus `--decode-steps` greedy
decode steps in lock step with the other ranks, recording the argmax tokens and the fp32 logits of every step.
Then, on the same GPU, the same rank rebuilds the model with all experts and runs the same batches (its own prompts,
the EP run's tokens fed back: teacher forcing, so every step's logits are comparable) twice:

* `one`: through a single-rank `MoEExchange` - the same code path as EP (gate, `routed` over the local experts ->
  fp32, + shared expert, one rounding to the activation dtype), every expert local and no collectives. This is the
  apples-to-apples 1-rank run: the kernels are the same; what differs is that under EP each expert's rows come
  from both ranks' tokens (a grouped GEMM computes a row the same whatever the other rows of its group: fixed
  tiles, no autotuning) and that the k expert outputs of a token are summed in two fp32 partial sums (one per
  rank, then the reduce-scatter) instead of one;
* `plain`: through `mini.ops.moe.moe`, the ordinary single-device MoE (on the fast path the shared expert is
  added inside the combine kernel: another fp32 summation order). `one` vs `plain` is the size of fp32
  reduction-order noise on one device, for scale.

Metrics per case (max over ranks, worst row): `tokens_identical` (EP's greedy tokens are the argmax of `one`'s
logits at every step: a free-running `one` would decode the same tokens), `max_abs_logit_diff` and
`max_rel_logit_diff` (||d|| / ||logits|| of a row) of EP vs `one`, `rows_bit_identical` (share of logit rows equal
bit for bit), the same two for `plain` vs `one`, the logits' scale and `one`'s smallest top-2 gap.

Cases: tiny-v4.1 (fast bf16, reference fp32, reference bf16) and a wide one (V4.1-Flash widths, the 8-layer
schedule of ep-prefill, 32 routed experts, prompts of 100s of tokens; fast bf16). On a CPU the fast cases run the
reference (the fast path needs CUDA).

With `--trace`, each rank also records, for the first `--trace-steps` steps (the prefill, then decode steps), per
layer: the attention output, the MoE input, the gate's ids and weights, the routed sum of its tokens (under EP
after the reduce-scatter) and the shared expert's output, plus the logits; the `one` run compares its own at
the same points as it goes. The result's "trace" gives, per rank, every site's largest difference and the
first (step, layer, site) in forward order that is not bit-identical: where EP and one rank part.

    torchrun --nproc-per-node 2 -m mini check ep-exact --json ep-exact.json        # 2 GPUs, NCCL
    mini check ep-exact --nproc 2 --device cpu --cases tiny-reference-fp32        # gloo
    torchrun --nproc-per-node 2 -m mini check ep-exact --cases wide-fast-bf16 --trace --decode-steps 1
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mini.testing.suites import SuiteError, run_on_ranks
from mini.config import ModelConfig, preset
from mini.parallel.groups import DistContext


@dataclass(frozen=True)
class Case:
    preset: str
    layers: int  # 0: the preset's own; else ep_prefill.layer_config's schedule
    experts: int | None  # routed experts (None: the preset's)
    backend: str
    dtype: str
    lens: tuple[tuple[int, ...], ...]  # prompt lengths of rank r: lens[r % len(lens)]
    block_tokens: int
    engram_rows: int | None

    def config(self) -> ModelConfig:
        from mini.testing.rank_model import layer_config
        cfg = layer_config(self.preset, self.layers) if self.layers else preset(self.preset)
        if self.experts is not None:
            cfg = cfg.replace(n_routed_experts=self.experts,
                              n_activated_experts=min(cfg.n_activated_experts, self.experts))
        return cfg


TINY_LENS = ((37, 5, 70), (19, 44))  # rank 0: 3 sequences / 112 tokens, rank 1: 2 / 63
CASES = {
    "tiny-fast-bf16": Case("tiny-v4.1", 0, None, "fast", "bfloat16", TINY_LENS, 16, None),
    "tiny-reference-fp32": Case("tiny-v4.1", 0, None, "reference", "float32", TINY_LENS, 16, None),
    "tiny-reference-bf16": Case("tiny-v4.1", 0, None, "reference", "bfloat16", TINY_LENS, 16, None),
    "wide-fast-bf16": Case("v4.1-flash", 8, 32, "fast", "bfloat16", ((700, 133), (517,)), 256, 1 << 16),
}


def add_args(p) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to start (default 2); under torchrun each process is one rank")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="run in the deterministic mode (batch-invariant kernels: mini.ops.set_deterministic)")
    p.add_argument("--trace", action="store_true",
                   help="record every layer's attention output, MoE input, gate, routed and shared outputs and "
                        "report where EP and one rank first differ")
    p.add_argument("--trace-steps", type=int, default=2, help="steps --trace records (prefill = step 0)")


# ---------------------------------------------------------------------------------------------------- decoding
def prompts_of(cfg: ModelConfig, case: Case, rank: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in case.lens[rank % len(case.lens)]]


def greedy(model, exchange, prompts: list[list[int]], steps: int, case: Case, forced: list[list[int]] | None = None,
           tracer: "Tracer | None" = None) -> tuple[list[list[int]], torch.Tensor]:
    """(argmax tokens [steps + 1][S], fp32 logits [steps + 1, S, vocab]) of a prefill of every prompt and `steps`
    decode steps. With `forced`, the histories take those tokens instead of the argmax. `exchange` (or None)
    gets each step's token count; `tracer` (or None) the step number and each step's logits."""
    from mini.model import Batch, KVCache, SeqChunk
    cfg, dev = model.config, model.device
    per_seq = -(-(max(map(len, prompts)) + steps + 1) // case.block_tokens)
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    cache = KVCache(cfg, len(prompts), len(prompts) * per_seq, case.block_tokens, dev, model.dtype)
    history, starts = [list(p) for p in prompts], [0] * len(prompts)
    tokens, logits = [], []
    for i in range(steps + 1):
        batch = Batch.build([SeqChunk(h, s, j, blocks[j]) for j, (h, s) in enumerate(zip(history, starts))],
                            cfg, dev, model.hasher)
        if batch.engram is not None and case.engram_rows:
            batch.engram.data = batch.engram.data % case.engram_rows  # hash ids -> the capped tables' rows
        if exchange is not None:
            exchange.begin_step(batch.n_tokens)
        if tracer is not None:
            tracer.step = i
        out = model.forward(batch, cache).float()
        if tracer is not None:
            tracer(cfg.n_layers, "logits", out)
        tokens.append(out.argmax(-1).tolist())
        logits.append(out)
        starts = [len(h) for h in history]
        for j, h in enumerate(history):
            h.append(forced[i][j] if forced is not None else tokens[-1][j])
    return tokens, torch.stack(logits)


def build_model(cfg: ModelConfig, case: Case, device, seed: int, experts: range, exchange):
    from mini.testing.rank_model import hasher_of, rank_model
    model = rank_model(cfg, device, getattr(torch, case.dtype), seed, experts, case.engram_rows, exchange)
    model.hasher = hasher_of(cfg)
    return model


# ---------------------------------------------------------------------------------------------------- tracing
class Tracer:
    """Called as tracer(layer, site, tensor) at each traced point of a forward (`step` set by `greedy`). First it
    records (the EP run: a copy of every tensor of the first `steps` steps, on its device); after `compare()` it
    compares each call with the recording of the same (step, layer, site) and keeps the difference."""

    def __init__(self, steps: int):
        self.steps, self.step = steps, 0
        self.saved: dict[tuple[int, int, str], torch.Tensor] = {}
        self.sites: list[dict] | None = None  # the comparison, in forward order

    def compare(self) -> None:
        self.sites = []

    def __call__(self, layer: int, site: str, t: torch.Tensor) -> None:
        if self.step >= self.steps:
            return
        key = (self.step, layer, site)
        if self.sites is None:
            self.saved[key] = t.detach().clone()
            return
        diff = _difference(t, self.saved.pop(key, None))
        self.sites.append({"step": self.step, "layer": layer, "site": site, **diff})

    def summary(self) -> dict:
        """{"first_difference": the first site not bit-identical (None: all were), "sites": every site}."""
        sites = self.sites or []
        first = next((d for d in sites if not d["bit_identical"]), None)
        return {"first_difference": first, "sites": sites,
                "unmatched": [list(k) for k in self.saved]}  # recorded by EP, never reached by one


def _difference(got: torch.Tensor, want: torch.Tensor | None) -> dict:
    """How `got` (the one-rank run's) differs from `want` (EP's): bit identity, the largest absolute and relative
    (to want's largest magnitude) difference, how many elements and which first row differ."""
    if want is None or got.shape != want.shape or got.dtype != want.dtype:
        return {"bit_identical": False, "problem": f"EP recorded {None if want is None else tuple(want.shape)} "
                f"{None if want is None else want.dtype}, one rank {tuple(got.shape)} {got.dtype}"}
    same = got.contiguous().view(torch.uint8).view(got.shape[0], -1) == want.contiguous().view(torch.uint8).view(
        want.shape[0], -1) if got.numel() else torch.ones(got.shape[0], 1, dtype=torch.bool, device=got.device)
    rows = (~same.all(-1)).nonzero().flatten()
    d = (got.double() - want.double()).abs() if got.numel() else got.new_zeros(1).double()
    scale = float(want.double().abs().max()) if want.numel() else 0.0
    return {"bit_identical": rows.numel() == 0, "max_abs": float(d.nan_to_num(float("inf")).max()),
            "max_rel": float(d.max()) / scale if scale else 0.0,
            "elements_differing": int((d != 0).sum()), "rows_differing": int(rows.numel()),
            "first_row": int(rows[0]) if rows.numel() else -1, "rows": int(got.shape[0]) if got.dim() else 1}


@contextmanager
def traced_attention(tracer: Tracer | None):
    """While in it, every attention sub-layer's output goes to `tracer` (site "attn") as the model computes it."""
    if tracer is None:
        yield
        return
    import mini.model.model as model_module
    inner = model_module.attention

    def attention(x, w, plan, *args, **kwargs):
        out = inner(x, w, plan, *args, **kwargs)
        tracer(plan.layer, "attn", out)
        return out

    model_module.attention = attention
    try:
        yield
    finally:
        model_module.attention = inner


# ---------------------------------------------------------------------------------------------------- comparing
def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Row-wise differences of two logit stacks [..., vocab]: the worst row's, and the share of equal rows."""
    d = (got - want).abs()
    rows_equal = (d.amax(-1) == 0).float()
    return {"max_abs_logit_diff": float(d.max()),
            "max_rel_logit_diff": float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max()),
            "rows_bit_identical": float(rows_equal.mean())}


def case_metrics(ep_tokens, ep_logits, one_tokens, one_logits, plain_logits) -> dict[str, float]:
    top2 = one_logits.topk(2, dim=-1).values
    m = {"tokens_identical": float(ep_tokens == one_tokens), **compare(ep_logits, one_logits)}
    m.update({f"plain_vs_one_{k}": v for k, v in compare(plain_logits, one_logits).items()})
    m["logit_abs_max"] = float(one_logits.abs().max())
    m["min_top2_gap"] = float((top2[..., 0] - top2[..., 1]).min())
    return m


# worst over the ranks: the smallest for these, the largest for the rest
SMALLEST = ("tokens_identical", "rows_bit_identical", "plain_vs_one_rows_bit_identical", "min_top2_gap")


def worst(ctx: DistContext, m: dict[str, float]) -> dict[str, float]:
    keys = sorted(m)
    signed = torch.tensor([-m[k] if k in SMALLEST else m[k] for k in keys], dtype=torch.float64, device=ctx.device)
    if ctx.multi:
        dist.all_reduce(signed, op=dist.ReduceOp.MAX)
    return {k: (-v if k in SMALLEST else v) for k, v in zip(keys, signed.tolist())}


def run_case(ctx: DistContext, case: Case, args, trace: dict | None = None) -> dict[str, float]:
    """The case's metrics (worst over the ranks); with args.trace, this rank's Tracer summary goes into `trace`
    (with the backends each run started from)."""
    import mini.ops
    from mini.checkpoint import expert_range
    from mini.ops import backends
    from mini.parallel.exchange import MoEExchange
    mini.ops.set_backend(case.backend)
    mini.ops.set_deterministic(getattr(args, "deterministic", False))
    cfg = case.config()
    prompts = prompts_of(cfg, case, ctx.rank, args.seed)
    tracer = Tracer(args.trace_steps) if getattr(args, "trace", False) else None
    started = {"ep": str(backends.current())}
    t0 = time.perf_counter()
    ep_exchange = MoEExchange(ctx)
    ep_exchange.trace = tracer
    model = build_model(cfg, case, ctx.device, args.seed, expert_range(cfg, ctx.rank, ctx.world), ep_exchange)
    with traced_attention(tracer):
        ep_tokens, ep_logits = greedy(model, ep_exchange, prompts, args.decode_steps, case, tracer=tracer)
    del model
    t1 = time.perf_counter()
    started["one"] = str(backends.current())
    one_exchange = MoEExchange(DistContext(0, 1, ctx.device, None))
    model = build_model(cfg, case, ctx.device, args.seed, range(cfg.n_routed_experts), one_exchange)
    if tracer is not None:
        tracer.compare()
        one_exchange.trace = tracer
    with traced_attention(tracer):
        one_tokens, one_logits = greedy(model, one_exchange, prompts, args.decode_steps, case, forced=ep_tokens,
                                        tracer=tracer)
    if tracer is not None and trace is not None:
        trace.update(rank=ctx.rank, backends_at_start=started, **tracer.summary())
    model.moe_exchange = None  # the same weights through mini.ops.moe.moe
    _, plain_logits = greedy(model, None, prompts, args.decode_steps, case, forced=ep_tokens)
    del model
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    m = case_metrics(ep_tokens, ep_logits, one_tokens, one_logits, plain_logits)
    m.update(ep_s=t1 - t0, one_s=time.perf_counter() - t1)
    return worst(ctx, m)


def _rank(ctx: DistContext, args) -> dict:
    if not ctx.multi:
        raise SuiteError("ep-exact needs at least 2 ranks (torchrun --nproc-per-node N, or --nproc N)")
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SuiteError(f"ep-exact: unknown cases {unknown}; known: {', '.join(CASES)}")
    metrics, traces = {}, {}
    tracing = bool(getattr(args, "trace", False))
    for name in names:
        mine: dict = {}
        m = run_case(ctx, CASES[name], args, mine)
        if tracing:
            traces[name] = _gather(ctx, mine)
            m["trace_sites_differing"] = float(max(sum(not d["bit_identical"] for d in t["sites"])
                                                   for t in traces[name]))
        if ctx.rank == 0:  # as it comes: a run cut short keeps the cases it finished
            print(f"ep-exact {name}: {json.dumps(m)}", flush=True)
            for t in traces.get(name, []):
                print(f"ep-exact {name} trace, rank {t['rank']}: started {t['backends_at_start']}; first difference "
                      f"{json.dumps(t['first_difference'])}", flush=True)
        metrics.update({f"{name}.{k}": v for k, v in m.items()})
    cuda = ctx.device.type == "cuda"
    definition = {"cases": {n: {**CASES[n].__dict__, "lens": [list(x) for x in CASES[n].lens]} for n in names},
                  "ranks": ctx.world, "decode_steps": args.decode_steps, "seed": args.seed, "backend": ctx.backend,
                  "deterministic": bool(getattr(args, "deterministic", False)),
                  "trace_steps": args.trace_steps if tracing else 0,
                  "device": torch.cuda.get_device_name(ctx.device) if cuda else "cpu"}
    result = {"suite": "ep-exact", "definition": definition, "metrics": metrics}
    if tracing:
        result["trace"] = traces
    return result


def _gather(ctx: DistContext, obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not ctx.multi:
        return [obj]
    out = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def run(args) -> dict:
    return run_on_ranks("ep-exact", _rank, args)
