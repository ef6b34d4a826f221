"""decode-host: where the time of a decode step goes at batch B, eager vs CUDA graphs (issue #3, item 8).

One model (`--model`, random tiny weights by default) serves `--batch` requests of `--input-len` random tokens and
`--output-len` greedy tokens each (EOS ignored) through LLMEngine, once per mode: `eager` (enforce_eager),
`graphs` (decode steps replay CUDA graphs; CUDA + fast backend only), and `graphs+overlap` / `eager+overlap`
(the same with overlapped decode steps, EngineOptions.overlap: step N+1 is prepared and launched before step N's
tokens are read back, whose bookkeeping then runs while step N+1 computes). LLMEngine.step_times records every
step; the pure-decode steps at the full batch (after `--skip` of them) are summarised by their medians:

* step_ms         wall time of LLMEngine.step() (overlapped: of the call that launched the step, which also reads
                  the previous step back: in steady state one call per step)
* gpu_ms          CUDA events around the forward (eager: first launch to last kernel, so launch gaps count here)
* host_ms         step_ms - gpu_ms: scheduling, input preparation, sampling and outputs, outside the forward
* host_share      host_ms / step_ms (the issue's target: under 10% at batch 64)
* period_ms       spacing of consecutive full-batch decode steps (start to start): step_ms plus the caller's loop
* gpu_idle_share  (period_ms - gpu_ms) / period_ms per step: how long the GPU waits for the host (with overlap
                  this is what is left of the host share; without, the same as host_share up to the loop)
* schedule_ms, prepare_ms, forward_call_ms (host time of the launches / one replay), sample_ms: the host phases

A mode with `+det` appended (e.g. `graphs+overlap+det`) runs the same with the deterministic mode on
(EngineOptions.deterministic: batch-invariant kernels, fixed prefill chunks), switched off again after it: the
mode's cost on a decode step with the scheduling held fixed (a burst's TPOT also moves with where prefill chunks
land). `--rounds N` runs the mode list N times, interleaved, and reports each figure's median over the rounds.

On CPU the graphs modes are left out and the GPU columns are absent.
"""
from __future__ import annotations

import random
import statistics
import traceback

import torch

import mini.ops

SUITE = "decode-host"
MODES = ("eager", "graphs", "graphs+overlap", "eager+overlap")


def add_args(p) -> None:
    p.add_argument("--model", default="tiny-v4.1")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--skip", type=int, default=3, help="full-batch decode steps not timed (warm-up)")
    p.add_argument("--modes", default=",".join(MODES[:3]),
                   help=f"comma-separated: {', '.join(MODES)}, each optionally with +det appended")
    p.add_argument("--rounds", type=int, default=1, help="run the mode list this many times, interleaved")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--host-threads", type=int, default=None,
                   help="torch.set_num_threads for the run (default: torch's): small host-side torch ops (the "
                        "Engram lookup, sampling parameters) pay for a wide thread pool")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's context (default: the model's, as `mini serve`; it sizes the graphs' index "
                        "tensors)")


def _measure(model, config, tokenizer, args, device, mode: str) -> dict[str, float]:
    from mini.engine.llm import build_engine
    base, det = mode.removesuffix("+det"), mode.endswith("+det")
    graphs, overlap = base.startswith("graphs"), base.endswith("+overlap")
    need = args.input_len + args.output_len + 1
    try:
        engine = build_engine(model, config=config, tokenizer=tokenizer, device=device, max_num_seqs=args.batch,
                              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                              max_model_len=args.max_model_len, enforce_eager=not graphs, overlap=overlap,
                              deterministic=det, num_blocks=None if device == "cuda" else args.batch * -(-need // 128))
        return _run_batch(engine, config, args, graphs, overlap, mode)
    finally:
        if det:  # process-wide: the next mode's engine must not capture with it
            mini.ops.set_deterministic(False)


def _run_batch(engine, config, args, graphs: bool, overlap: bool, mode: str) -> dict[str, float]:
    from mini.engine import SamplingParams
    if graphs and engine.runner.graphs is None:
        raise ValueError("CUDA graphs need CUDA and the fast backend in bf16")
    if engine.overlap != overlap:
        raise RuntimeError(f"mode {mode}: the engine's overlap is {engine.overlap}")
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(3, config.vocab_size) for _ in range(args.input_len)], params)
    engine.step_times = []
    while engine.has_work():
        engine.step()
    steps = [t for t in engine.step_times if t.decode and t.n_seqs == args.batch][args.skip:]
    if not steps:
        raise ValueError("no full-batch decode step to time: raise --output-len")
    if graphs and not all(t.graph for t in steps):
        raise RuntimeError("a decode step did not replay a graph")

    def med(f) -> float:
        return 1e3 * statistics.median(f(t) for t in steps)

    out = {"steps": len(steps), "step_ms": med(lambda t: t.total_s), "schedule_ms": med(lambda t: t.schedule_s),
           "prepare_ms": med(lambda t: t.prepare_s), "forward_call_ms": med(lambda t: t.forward_s),
           "sample_ms": med(lambda t: t.sample_s)}
    if steps[0].gpu_s is not None:
        out["gpu_ms"] = med(lambda t: t.gpu_s)
        out["host_ms"] = med(lambda t: t.total_s - t.gpu_s)
        out["host_share"] = statistics.median((t.total_s - t.gpu_s) / t.total_s for t in steps)
        out["decode_tok_s"] = args.batch / (out["step_ms"] / 1e3)
        ordered = sorted(steps, key=lambda t: t.started)
        pairs = [(b.started - a.started, a.gpu_s) for a, b in zip(ordered, ordered[1:])]
        if pairs:
            out["period_ms"] = 1e3 * statistics.median(p for p, _ in pairs)
            out["gpu_idle_share"] = statistics.median((p - g) / p for p, g in pairs)
    return out


def run(args) -> dict:
    from mini.model import load_model
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    modes = [m for m in args.modes.split(",") if m]
    if {m.removesuffix("+det") for m in modes} - set(MODES):
        raise ValueError(f"--modes: some of {', '.join(MODES)}, each optionally +det (graphs on CUDA only), "
                         f"got {args.modes!r}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if device != "cuda":
        modes = [m for m in modes if not m.startswith("graphs")]
    if not modes:
        raise ValueError(f"--modes {args.modes!r}: nothing runs on {device} (graphs modes need CUDA)")
    if args.host_threads is not None:
        torch.set_num_threads(args.host_threads)
    model, config, tokenizer = load_model(args.model, device=device, dtype=torch.bfloat16)
    samples, failed = {}, {}
    for _ in range(args.rounds):
        for mode in modes:
            if mode in failed:
                continue
            try:
                for k, v in _measure(model, config, tokenizer, args, device, mode).items():
                    samples.setdefault(f"{mode}_{k}", []).append(v)
            except Exception as e:  # one mode failing keeps the others' numbers (a device call measures them all)
                if len(modes) == 1:
                    raise
                traceback.print_exc()
                failed[mode] = f"{type(e).__name__}: {e}"
            if device == "cuda":
                torch.cuda.empty_cache()
    metrics = {k: statistics.median(v) for k, v in samples.items()}
    if not metrics:
        raise RuntimeError(f"every mode failed: {failed}")
    rows = list(dict.fromkeys(k.split("_", 1)[1] for k in metrics))
    print(f"{'':16s}" + "".join(f"{m:>16s}" for m in modes))
    for r in rows:
        print(f"{r:16s}" + "".join(f"{metrics.get(f'{m}_{r}', float('nan')):16.3f}" for m in modes))
    definition = {"model": args.model, "device": device, "dtype": "bfloat16", "batch": args.batch,
                  "input_len": args.input_len, "output_len": args.output_len, "skip": args.skip,
                  "modes": ",".join(modes), "rounds": args.rounds,
                  "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
                  "host_threads": torch.get_num_threads()}
    result = {"suite": SUITE, "definition": definition, "metrics": metrics}
    if failed:
        print(f"FAILED modes: {failed}")
        result["failed_modes"] = failed
    return result
