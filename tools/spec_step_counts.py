"""What the acceptance rule does where drafts fail, counted (not timed): the steps of an offline run of
tiny-v4.1-dspark (random weights: its DSpark drafts are rarely right) with `--speculative dspark`, by kind.

`--requests` prompts of `--input-len` random tokens (seeded), `--output-len` greedy tokens each (EOS ignored), all
added at once, then `--late` more added when the first ones are `--late-after` steps into decode (a request that
arrives after the others' drafts failed). Printed: the engine's steps, the steps that verified drafts (the
Speculation's `step`) and those that ran as plain decode, the drafted and accepted tokens. A step that verifies costs
a draft forward and 1 + k rows a sequence where plain decode costs one row; where drafts fail, every verify step is
time lost (docs/engine.md, "The draft length"). `--src DIR` imports mini from another checkout (an older rule,
A/B in one job).

    python3 tools/spec_step_counts.py                    # report 017 (docs/perf/)
    python3 tools/spec_step_counts.py --src /tmp/old     # the same workload on an older revision's rule
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--late", type=int, default=0, help="requests added later (after --late-after steps)")
    p.add_argument("--late-after", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1], help="the mini checkout")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.src))
    import torch

    from mini.engine.llm import LLM
    from mini.engine.sequence import SamplingParams

    rng = random.Random(args.seed)
    prompt = lambda: [rng.randrange(5, 500) for _ in range(args.input_len)]  # noqa: E731
    llm = LLM("tiny-v4.1-dspark", device="cpu", dtype=torch.float32, block_tokens=16, speculative="dspark")
    engine, counts = llm.engine, {"verify": 0, "plain": 0}
    for kind, name in (("verify", "step"), ("plain", "plain_step")):
        wrapped = getattr(engine.spec, name)

        def counted(plan, _wrapped=wrapped, _kind=kind):
            counts[_kind] += 1
            return _wrapped(plan)
        setattr(engine.spec, name, counted)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"early-{i}", prompt(), params)
    late, steps = args.late, 0
    while engine.has_work() or late:
        if late and counts["verify"] + counts["plain"] >= args.late_after:
            for i in range(late):
                engine.add_request(f"late-{i}", prompt(), params)
            late = 0
        engine.step()
        steps += 1
    spec = engine.stats.spec
    result = {"src": str(args.src), "steps": steps, "verify_steps": counts["verify"],
              "plain_decode_steps": counts["plain"], "drafted_tokens": spec.drafted_tokens,
              "accepted_tokens": spec.accepted_tokens, "workload": {k: v for k, v in vars(args).items()
                                                                   if k not in ("src", "json")}}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
