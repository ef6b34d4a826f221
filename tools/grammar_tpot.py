"""What grammar-constrained decoding costs: batch-B decode TPOT with and without a JSON schema on every request.

One engine (tiny-v4.1 by default; on CUDA: bf16, fast backend, CUDA-graph decode with overlapped steps, as
`mini serve`) runs rounds of `--batch` requests of `--input-len` random tokens and `--output-len` sampled tokens
(EOS ignored), alternating three kinds: `plain`; `schema`, every request following SCHEMA (an array of at least 64
small objects: the grammar stays active for the whole output) with the engine's masks as served (overlapped: filled
on the worker thread while the engine's thread does the bookkeeping); `schema_sync`, the same with every fill on the
engine's thread (GrammarBackend.background off). Per round, over the full-batch decode steps after `--skip`:
TPOT = the median spacing of consecutive steps (start to start; with overlap one step() call per step) and its 90th
percentile, the step() wall time and its host phases (StepTimes: schedule, prepare, forward, sample = everything
after the forward call), the forward's GPU span, and per step's masks (structured.MaskTiming) the host time:
`grammar_consume_ms` (matchers consume the tokens read back), `grammar_fill_ms` (llguidance's fill),
`grammar_host_ms` (the two), `grammar_exposed_ms` (what the engine's thread spent on masks: consume, start, wait
for the fill, upload: the critical path), `grammar_background` (fraction of fills on the worker). The result: the
median of each over the rounds of a kind, `slowdown` = TPOT(schema) / TPOT(plain) - 1 (issue 14's target: <= 0.10)
and `slowdown_sync` the same for schema_sync.

    python3 tools/grammar_tpot.py --json out.json     # phase grammar of scripts/gpu.sh; report 008 (docs/perf/)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                     "name": {"type": "string", "maxLength": 12},
                                     "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c"]}},
    "required": ["id", "name", "ok", "kind"], "additionalProperties": False}}


KINDS = ("plain", "schema", "schema_sync")


def _round(engine, config, args, grammar, seed: int, background: bool = True) -> dict:
    from mini.engine import SamplingParams
    rng = random.Random(seed)
    if grammar is not None:
        engine.grammars.background = background
        engine.grammars.timings = []
    for i in range(args.batch):
        params = SamplingParams(temperature=0.8, seed=seed * 1000 + i, max_tokens=args.output_len,
                                ignore_eos=True, grammar=grammar)
        engine.add_request(f"{seed}-{i}", [rng.randrange(8, config.vocab_size) for _ in range(args.input_len)],
                           params)
    engine.step_times = []
    while engine.has_work():
        engine.step()
    steps = sorted((t for t in engine.step_times if t.decode and t.n_seqs == args.batch), key=lambda t: t.started)
    steps = steps[args.skip:]
    if len(steps) < 3:
        raise ValueError("too few full-batch decode steps: raise --output-len")
    out = {"steps": len(steps), "tpot_ms": 1e3 * statistics.median(b.started - a.started
                                                                    for a, b in zip(steps, steps[1:])),
           "step_ms": 1e3 * statistics.median(t.total_s for t in steps),
           "tpot_p90_ms": 1e3 * statistics.quantiles([b.started - a.started for a, b in zip(steps, steps[1:])],
                                                      n=10)[-1]}
    for phase in ("schedule", "prepare", "forward", "sample"):  # where the step() call's host time goes
        out[f"{phase}_ms"] = 1e3 * statistics.median(getattr(t, f"{phase}_s") for t in steps)
    if steps[0].gpu_s is not None:
        out["gpu_ms"] = 1e3 * statistics.median(t.gpu_s for t in steps)
    if grammar is not None:
        masks = [t for t in engine.grammars.timings if t.rows == args.batch][args.skip:]
        engine.grammars.timings = None
        for key, value in (("consume", lambda t: t.consume_s), ("fill", lambda t: t.fill_s),
                           ("host", lambda t: t.consume_s + t.fill_s), ("exposed", lambda t: t.exposed_s)):
            out[f"grammar_{key}_ms"] = 1e3 * statistics.median(value(t) for t in masks)
        out["grammar_background"] = sum(t.background for t in masks) / len(masks)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-v4.1")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each kind, alternating")
    p.add_argument("--device", default=None)
    p.add_argument("--overlap", action="store_true", help="overlapped steps also without CUDA graphs (CPU tests)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from mini.engine import SamplingParams
    from mini.engine.llm import build_engine
    from mini.model import load_model
    from mini.server.grammars import json_grammar
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        from mini.ops import set_backend
        set_backend("fast")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, config, tokenizer = load_model(args.model, device=device, dtype=dtype)
    need = args.input_len + args.output_len + 1
    engine = build_engine(model, config=config, tokenizer=tokenizer, device=device, dtype=dtype,
                          max_num_seqs=args.batch, enable_prefix_caching=False, max_model_len=need + 128,
                          num_blocks=args.batch * -(-need // 128) + 8, overlap=True if args.overlap else None,
                          forced_drafts=False)  # the masks' cost per decode step: keys not verified as drafts
    grammar = json_grammar(SCHEMA)
    engine.check_prompt([5], SamplingParams(grammar=grammar))  # compiles against the vocabulary, or says why not
    rounds = {kind: [] for kind in KINDS}
    for r in range(args.rounds):
        for j, kind in enumerate(KINDS):
            res = _round(engine, config, args, None if kind == "plain" else grammar, seed=len(KINDS) * r + j,
                         background=kind != "schema_sync")
            rounds[kind].append(res)
            print(kind, r, json.dumps({k: round(v, 3) for k, v in res.items()}), flush=True)
    metrics = {}
    for kind, rs in rounds.items():
        for key in rs[0]:
            metrics[f"{kind}_{key}"] = statistics.median(x[key] for x in rs)
    metrics["slowdown"] = metrics["schema_tpot_ms"] / metrics["plain_tpot_ms"] - 1
    metrics["slowdown_sync"] = metrics["schema_sync_tpot_ms"] / metrics["plain_tpot_ms"] - 1
    result = {"suite": "grammar-tpot", "definition": {
        "model": args.model, "device": device, "dtype": str(dtype).removeprefix("torch."), "batch": args.batch,
        "input_len": args.input_len, "output_len": args.output_len, "skip": args.skip, "rounds": args.rounds,
        "graphs": engine.runner.graphs is not None, "overlap": engine.overlap, "kinds": KINDS, "schema": SCHEMA},
        "metrics": metrics, "rounds": rounds}
    print(json.dumps(metrics, indent=1))
    if args.json:
        from mini.testing.suites import environment, write_result
        write_result(args.json, {**result, "env": environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
