"""`spec-decode`: speculative decoding's speed at real V4.1-Flash width, one emulated EP4 rank (issue 27 item 6).

The model is rank4-decode's (mini/bench/rank4_decode.py: random weights, this rank's 96 experts, the exchange
emulated) with DSpark's three stages added at V4.1-Flash's sizes (spec §2.7: block 5, 128 experts top-3, Markov
rank 256). For each B in `--batch` at context C, with k = `--spec-tokens` drafts:

- `decode_ms`: the plain decode step of B rows, rank4-decode's measurement (one CUDA graph of exactly B rows);
- `verify_ms`: the verify step as the engine replays it (mini.engine.cuda_graphs, one graph of exactly B sequences x
  (1 + k) rows: each sequence's token and a draft of k tokens at the next positions);
- `verify_proxy_ms`: the PROXY of a verify step that issue 27 measured before verify graphs existed, kept beside
  it: a decode step of B x (1 + k) sequences, each at context C (it over-counts attention and the cache: each row
  reads a context of its own, where a verify step's 1 + k rows of one sequence read one);
- `draft_ms`: DSpark's draft step as the engine's static draft step runs it after a verify step that accepted the
  whole draft (the most it writes): the B x (1 + k) committed rows' features into every stage's ring
  (`write_ring_rows`, device ops only), then one draft of the block's positions per sequence (`propose`, the whole
  block whatever k is), each in a CUDA graph of its own as mini.engine.cuda_graphs holds them where capture works,
  else eager (`draft_graph` says which). The features are random: the work is the same whatever they are.

Random weights accept almost nothing, so acceptance is EMULATED: for each acceptance length L in `--acceptance`
(tokens committed per verify step, bonus token included) a speculative step commits L tokens per sequence and takes
verify + draft, so per user L / (verify + draft) against plain decode's 1 / decode; per GPU, B times that. Every
such figure is named `emulated_accept_L`; `target_speedup` is issue 27's (B = 1: 2.0x at L = 2.8; B = 64: 1.3x at
2.8; B = 256: 1.0x at the lowest L).

`--tiny`: tiny-goodput (mini/bench/serve.py, `mini serve` in a subprocess) of tiny-v4.1-dspark, the same fixed
workload without and with `--speculative dspark`; acceptance there is what the random tiny draft module achieves.
"""
from __future__ import annotations

import argparse
import shlex
import statistics

import torch

from mini.bench import rank4_decode
from mini.testing.emulated_ep import record_moe_calls
from mini.testing.suites import SuiteError

SUITE = "spec-decode"
TARGETS = {1: (2.8, 2.0), 64: (2.8, 1.3), 256: (None, 1.0)}  # B: (acceptance, speed-up); None: the lowest


def add_args(p) -> None:
    rank4_decode.add_args(p)
    p.set_defaults(batch="1,16,64,256", context="4096", profile_steps=0)
    p.add_argument("--spec-tokens", type=int, default=0, help="drafts k per verify step (0: DSpark's block size)")
    p.add_argument("--acceptance", default="2.0,2.8,3.5", help="emulated tokens committed per verify step")
    p.add_argument("--proxy", action=argparse.BooleanOptionalAction, default=True,
                   help="also the verify proxy (a decode step of B x (1 + k) sequences)")
    p.add_argument("--tiny", action="store_true", help="tiny-v4.1-dspark goodput without and with speculation")
    p.add_argument("--tiny-args", default="", help="more tiny-goodput options for --tiny, one string")


def dspark_config(name: str):
    """The preset with its DSpark stages: V4.1-Flash's (spec §2.7; its config.json has block 5) where it has none."""
    from mini.config import preset
    cfg = preset(name)
    if cfg.has_dspark:
        return cfg
    if not cfg.is_v41:
        raise SuiteError(f"{SUITE}: preset {name!r} is not V4.1: it has no DSpark draft module")
    return cfg.replace(n_mtp_layers=3, dspark_block_size=5)


class DraftStep:
    """The draft step of B sequences that committed `rows` tokens each, up to position C, on rings of their own
    (zeros: the work is the same)."""

    def __init__(self, model, batch: int, context: int, rows: int, seed: int, dtype):
        from mini.model.dspark import DSparkRings
        cfg, dev = model.config, model.embed.device
        g = torch.Generator().manual_seed(seed)
        self.model, self.graphs = model, None
        self.rings = DSparkRings(cfg, batch, dev, dtype)
        self.features = torch.randn(batch * rows, len(cfg.dspark_target_layers) * cfg.dim, generator=g).to(dev, dtype)
        self.written = (context - rows + 1 + torch.arange(rows)).repeat(batch).to(dev)  # each sequence's rows
        self.written_slots = torch.arange(batch).repeat_interleave(rows).to(dev)
        self.positions = torch.full((batch,), context, dtype=torch.int64, device=dev)
        self.slots = torch.arange(batch, device=dev)
        self.anchors = torch.randint(3, cfg.vocab_size, (batch,), generator=g).to(dev)

    def write(self) -> None:
        from mini.model.dspark import write_ring_rows
        if self.graphs is not None:
            self.graphs["write"].replay()
            return
        # every row of the step is committed here, each at a ring entry of its own (rows < W per sequence)
        write_ring_rows(self.model.dspark, self.model.config, self.features, self.written, self.written_slots,
                        self.rings)

    def propose(self) -> torch.Tensor:
        from mini.model.dspark import propose
        m = self.model
        if self.graphs is not None:
            self.graphs["propose"].replay()
            return self.ids
        return propose(m.dspark, m.config, m.embed, m.head, self.rings, self.anchors, self.positions, self.slots).ids

    def capture(self) -> str:
        """Capture `write` and `propose` in a CUDA graph each (the engine's write and draft graphs) after an eager
        run of both that must not sync with the host; returns why not ('' when captured)."""
        dev = self.anchors.device
        try:
            torch.cuda.set_sync_debug_mode("error")  # a host sync would break the capture: found eagerly first
            try:
                self.write()
                self.propose()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize(dev)
            graphs = {"write": torch.cuda.CUDAGraph(), "propose": torch.cuda.CUDAGraph()}
            with torch.cuda.graph(graphs["write"]):
                self.write()
            with torch.cuda.graph(graphs["propose"]):
                self.ids = self.propose()
            self.graphs = graphs
            return ""
        except Exception as e:  # noqa: BLE001 - the reason goes into the result; the step stays eager
            torch.cuda.synchronize(dev)
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def measure_draft(model, args, batch: int, context: int, rows: int, cuda: bool) -> tuple[dict[str, float], dict]:
    step = DraftStep(model, batch, context, rows, args.seed, getattr(torch, args.dtype))
    step.write()
    step.propose()  # the eager warm-up: kernels compiled
    routing = record_moe_calls(step.propose)  # the draft MoE's rows per expert (humming_decode_study: .draft)
    why = step.capture() if cuda else "not CUDA"
    for _ in range(args.warmup):
        step.write()
        step.propose()
    write = rank4_decode.time_calls(step.write, args.steps, cuda)
    prop = rank4_decode.time_calls(step.propose, args.steps, cuda)
    m = {"draft_write_ms": statistics.median(write), "draft_propose_ms": statistics.median(prop),
         "draft_graph": float(step.graphs is not None)}
    m["draft_ms"] = m["draft_write_ms"] + m["draft_propose_ms"]
    return m, {"draft_write_ms": write, "draft_propose_ms": prop, "draft_graph_refused": why,
               "pairs_per_local_expert": routing}


def speedups(B: int, decode_ms: float, verify_ms: float, draft_ms: float, acceptance: list[float],
             label: str) -> dict[str, float]:
    """Per user and per GPU tok/s at each emulated acceptance L, and the speed-up over plain decode."""
    out = {}
    for L in acceptance:
        user = L * 1e3 / (verify_ms + draft_ms)
        p = f"{label}.emulated_accept_{L}."
        out |= {p + "per_user_tok_s": user, p + "per_gpu_tok_s": B * user, p + "speedup": user * decode_ms / 1e3}
    if B in TARGETS:
        at, want = TARGETS[B]
        at = min(acceptance) if at is None else at
        if at in acceptance:
            out[f"{label}.emulated_accept_{at}.meets_target"] = float(out[f"{label}.emulated_accept_{at}.speedup"]
                                                                      >= want)
    return out


def measure_batch(model, cfg, exchange, args, B: int, C: int, k: int, acceptance: list[float],
                  cuda: bool) -> tuple[dict[str, float], dict]:
    """One B at context C: the plain step, the draft step, and each verify step measured (label -> its step)."""
    raw, verify = {}, {}
    plain, raw["decode"] = rank4_decode.measure_shape(model, cfg, exchange, args, B, C, what=SUITE)
    verify["verify"], raw["verify"] = rank4_decode.measure_shape(model, cfg, exchange, args, B, C, what=SUITE,
                                                                 width=1 + k)
    m = {"decode_ms": plain["ms_per_step"], "decode.per_user_tok_s": 1e3 / plain["ms_per_step"],
         "decode.per_gpu_tok_s": plain["tok_per_s_per_gpu"]}
    m_draft, raw["draft"] = measure_draft(model, args, B, C, 1 + k, cuda)
    m |= m_draft
    try:
        if args.proxy:
            verify["verify_proxy"], raw["verify_proxy"] = rank4_decode.measure_shape(model, cfg, exchange, args,
                                                                                     B * (1 + k), C, what=SUITE)
    except SuiteError as e:  # B x (1 + k) contexts of their own may not fit (B = 256 at 32K: ~200 GB)
        raw["verify_proxy"] = str(e)
        print(f"{SUITE} B={B} C={C}: no verify_proxy: {e}", flush=True)
    if B in TARGETS:
        m["target_speedup"] = TARGETS[B][1]
    for label, v in verify.items():
        m[f"{label}_ms"], m[f"{label}_over_decode"] = v["ms_per_step"], v["ms_per_step"] / m["decode_ms"]
        m |= speedups(B, m["decode_ms"], v["ms_per_step"], m["draft_ms"], acceptance, label)
    if cuda:
        m["peak_mem_gb"] = max(v["peak_mem_gb"] for v in (plain, *verify.values()))
    figures = "; ".join(f"{label} {m[label + '_ms']:.2f} ms ({m[label + '_over_decode']:.2f}x), speed-up per user at "
                        "EMULATED acceptance " + ", ".join(f"L={L:g} {m[f'{label}.emulated_accept_{L}.speedup']:.2f}x"
                                                           for L in acceptance) for label in verify)
    print(f"{SUITE} B={B} C={C} k={k}: decode {m['decode_ms']:.2f} ms, draft {m['draft_ms']:.2f} ms "
          f"({'graph' if m['draft_graph'] else 'eager'}); {figures or 'no verify step measured'}"
          + (f" (target {TARGETS[B][1]}x)" if B in TARGETS else ""), flush=True)
    return m, raw


def run(args) -> dict:
    if args.tiny:
        return run_tiny(args)
    batches = rank4_decode.int_list(args.batch, "batch", SUITE)
    contexts = rank4_decode.int_list(args.context, "context", SUITE)
    acceptance = [float(a) for a in args.acceptance.split(",") if a.strip()]
    if not acceptance or min(acceptance) < 1:
        raise SuiteError(f"{SUITE}: --acceptance needs lengths >= 1 (tokens per verify step), got {args.acceptance!r}")
    cfg = dspark_config(args.preset)
    k = args.spec_tokens or cfg.dspark_block_size
    if not 1 <= k <= cfg.dspark_block_size:
        raise SuiteError(f"{SUITE}: --spec-tokens must be 1..{cfg.dspark_block_size} (DSpark's block), got {k}")
    cuda = args.device.startswith("cuda")
    cfg, exchange, model, metrics = rank4_decode.build(args, cfg)
    raw = {}
    for B in batches:
        for C in contexts:
            m, raw[f"b{B}_c{C}"] = measure_batch(model, cfg, exchange, args, B, C, k, acceptance, cuda)
            metrics |= {f"b{B}_c{C}.{n}": v for n, v in m.items()}
    definition = rank4_decode.definition(args, batches, contexts) | {
        "spec_tokens": k, "dspark_block": cfg.dspark_block_size, "dspark_experts": cfg.dspark_n_routed_experts,
        "acceptance": acceptance, "acceptance_is": "EMULATED (random weights accept almost nothing): tokens "
        "committed per verify step, bonus included", "verify": "verify: the verify step's graph, B sequences x "
        "(1 + k) rows; verify_proxy: a decode step of B x (1 + k) sequences at the context (over-counts attention)",
        "targets": {str(B): {"acceptance": a or min(acceptance), "speedup": s} for B, (a, s) in TARGETS.items()}}
    return {"suite": SUITE, "definition": definition, "metrics": metrics, "raw": raw}


def run_tiny(args) -> dict:
    """tiny-goodput of tiny-v4.1-dspark, the same workload without and with speculation."""
    from mini.bench import serve
    p = argparse.ArgumentParser(prog=f"{SUITE} --tiny-args")
    serve.add_args(p)
    base = ["--model", "tiny-v4.1-dspark", "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed)]
    metrics, definition, runs = {}, {}, {}
    for name, extra in (("plain", []), ("speculative", ["--speculative", "dspark"])):
        result = serve.run(p.parse_args(base + shlex.split(args.tiny_args) + extra))
        metrics |= {f"{name}.{n}": v for n, v in result["metrics"].items()}
        definition, runs[name] = result["definition"], result["runs"]
    for n in ("output_tok_s", "goodput_req_s", "tpot_p50_ms"):
        if metrics[f"plain.{n}"] > 0:
            metrics[f"speculative_over_plain.{n}"] = metrics[f"speculative.{n}"] / metrics[f"plain.{n}"]
    definition = {**definition, "speculative": ["none", "dspark"], "tiny": True,
                  "acceptance_is": "the tiny random draft module's own (spec_tokens_per_verify), not emulated"}
    return {"suite": SUITE, "definition": definition, "metrics": metrics, "runs": runs}
