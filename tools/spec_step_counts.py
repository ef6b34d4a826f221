"""What speculation does where drafts fail: the steps of an offline run of tiny-v4.1-dspark (random weights: its
DSpark drafts are rarely right) by kind, counted, and on a GPU timed, with parts of speculation turned off to see
what each costs.

`--requests` prompts of `--input-len` random tokens (seeded), `--output-len` greedy tokens each (EOS ignored), all
added at once, then `--late` more added when the first ones are `--late-after` steps into decode (a request that
arrives after the others' drafts failed). Printed per variant: the engine's steps, the steps that verified drafts
(the Speculation's `step`) and those that ran as plain decode, the drafted and accepted tokens; the steps by kind and
their host seconds (EngineStats.kind_steps / kind_seconds: with overlap a step() call is about one step's period),
the output tokens/s of each run (`--repeat`). A step that verifies costs a draft forward and 1 + k rows a sequence
where plain decode costs one row; where drafts fail, every verify step is time lost (docs/engine.md, "The draft
length"). `--src DIR` imports mini from another checkout (an older rule, A/B in one job; the counts only).

Variants (`--variants`, comma-separated, each its own engine; the last three are diagnostics that change the
engine in this process only, never in mini):
  plain           no speculation
  dspark          --speculative dspark as served
  no-ring-writes  dspark, but steps after which nobody drafts skip the drafter (DSpark's ring writes): the cost of
                  keeping the rings current (its drafts then read stale rings: acceptance is not this variant's);
                  on CUDA graphs a decode step's graph holds its own ring write, which this leaves in place
  no-probes       dspark without the probes every PROBE_EVERY steps
  fresh-alpha     dspark whose engine-wide acceptance is forgotten before each run (a fresh engine's: full drafts
                  at first, as the serving warm-up left it before docs/perf/018)

On CUDA each engine first runs the serving warm-up (mini.engine.warmup: kernels built, graphs captured, counters
reset), as `mini serve` does, then the workload `--repeat` times, timed (fresh prompts each time).

    python3 tools/spec_step_counts.py                    # report 017 (docs/perf/): counts on the CPU
    python3 tools/spec_step_counts.py --src /tmp/old     # the same workload on an older revision's rule
    python3 tools/spec_step_counts.py --device cuda --repeat 3 --variants plain,dspark,no-ring-writes,no-probes,fresh-alpha
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

VARIANTS = ("plain", "dspark", "no-ring-writes", "no-probes", "fresh-alpha")


def run_variant(variant: str, workloads: list[tuple[list, list]], args) -> dict:
    """`variant`'s engine runs each (early prompts, late prompts) workload in turn, its counters reset before each
    as after the serving warm-up (the engine's acceptance carries over from the run before, but fresh-alpha's);
    the counts are the last run's, the speed the median run's."""
    import torch

    import mini.engine.speculative as speculative
    from mini.engine.llm import LLM
    from mini.engine.sequence import SamplingParams

    cuda = args.device == "cuda"
    opts = dict(device=args.device, dtype=torch.bfloat16 if cuda else torch.float32,
                block_tokens=128 if cuda else 16, **({"num_blocks": 1024} if cuda else {}))  # (engines one by one)
    llm = LLM("tiny-v4.1-dspark", **opts, **({} if variant == "plain" else {"speculative": "dspark"}))
    engine = llm.engine
    if cuda:
        from mini.engine.warmup import warm_up
        warm_up(engine)
    probe_every = speculative.PROBE_EVERY
    if variant == "no-ring-writes":
        draft = engine.runner.draft
        engine.runner.draft = lambda drafter, commits: (
            [[] for _ in commits] if all(c.max_draft == 0 for c in commits) else draft(drafter, commits))
    elif variant == "no-probes":
        speculative.PROBE_EVERY = 1 << 30
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    speeds = []
    try:
        for n, (early, late) in enumerate(workloads):
            if n or cuda:  # (the CPU's first run is the engine's first: nothing to forget)
                engine.warmed_up(engine.warmup_s or 0.0)
            if variant == "fresh-alpha":
                engine.spec.pool = speculative.DraftRecord()
            start, steps, tokens = time.perf_counter(), 0, 0
            for i, p in enumerate(early):
                engine.add_request(f"{n}-early-{i}", p, params)
            while engine.has_work() or late:
                if late and engine.stats.steps >= args.late_after:
                    for i, p in enumerate(late):
                        engine.add_request(f"{n}-late-{i}", p, params)
                    late = []
                tokens += sum(len(o.new_token_ids) for o in engine.step())
                steps += 1
            if cuda:
                torch.cuda.synchronize()
            speeds.append(tokens / (time.perf_counter() - start))
    finally:
        speculative.PROBE_EVERY = probe_every
        engine.close()
    st = engine.stats
    # under speculation every step that ran a forward is a verify step or a plain one (SpecStats.plain_steps)
    spec = engine.spec is not None
    plain_steps = st.spec.plain_steps if spec else 0
    result = {"variant": variant, "steps": steps, "verify_steps": st.steps - plain_steps if spec else 0,
              "plain_decode_steps": plain_steps, "drafted_tokens": st.spec.drafted_tokens,
              "accepted_tokens": st.spec.accepted_tokens}
    if hasattr(st, "kind_steps"):  # (not in an older checkout's engine)
        result |= {"steps_by_kind": st.kind_steps, "ms_by_kind": {k: round(1000 * s, 3)
                                                                 for k, s in st.kind_seconds.items()}}
    if cuda:
        result |= {"output_tok_s": round(statistics.median(speeds), 1), "output_tok_s_runs": [round(x, 1)
                                                                                           for x in speeds]}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--late", type=int, default=0, help="requests added later (after --late-after steps)")
    p.add_argument("--late-after", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: warmed up as served, and timed")
    p.add_argument("--repeat", type=int, default=1, help="workloads run in turn by each variant's engine")
    p.add_argument("--variants", default="dspark", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1], help="the mini checkout")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    sys.path.insert(0, str(args.src))
    rng = random.Random(args.seed)
    workloads = []  # fresh prompts for each repetition (no prefix-cache hits across them)
    for _ in range(args.repeat):
        prompts = [[rng.randrange(5, 500) for _ in range(args.input_len)] for _ in range(args.requests + args.late)]
        workloads.append((prompts[:args.requests], prompts[args.requests:]))
    runs = []
    for v in variants:
        runs.append(run_variant(v, workloads, args))
        print(json.dumps(runs[-1]), flush=True)
        gc.collect()  # the engine's graphs and pools before the next one's
    workload = {k: v for k, v in vars(args).items() if k not in ("src", "json", "variants")}
    result = {"src": str(args.src), **runs[0], "runs": runs, "workload": workload}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
