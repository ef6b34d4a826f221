"""How many of 24 requests change under concurrent load: each sent alone, then all again among 48 others of varied
lengths (chunked prefill, decodes mixed in), through one engine; greedy tokens and their logprobs compared bit for
bit. Run with and without the deterministic mode (issue 17's count):

    python3 tools/det_drift.py --json out.json [--deterministic] [--enforce-eager] [--model tiny-v4.1]

Prints and writes {"deterministic", "graphs", "changed_tokens", "changed_logprobs", "requests"}.
"""
from __future__ import annotations

import argparse
import json
import random
import sys

import torch


def prompts(n: int, seed: int, lens=(3, 17, 40, 90, 200, 333)) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(3, 500) for _ in range(g.choice(lens))] for _ in range(n)]


def drift(llm, n: int = 24, load: int = 48, max_tokens: int = 32, seed: int = 0) -> dict:
    """Alone vs among load, for `llm` (a mini.engine.LLM): counts of requests whose tokens / logprobs changed."""
    from mini.engine import SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    mine, others = prompts(n, seed), prompts(load, seed + 1)
    alone = [llm.generate([p], greedy)[0] for p in mine]
    mixed = list(enumerate(mine)) + [(None, p) for p in others]
    random.Random(seed + 2).shuffle(mixed)
    outs = llm.generate([p for _, p in mixed], greedy)
    tok = lp = 0
    for (i, _), o in zip(mixed, outs):
        if i is None:
            continue
        tok += o.token_ids != alone[i].token_ids
        lp += [x.logprob for x in o.logprobs] != [x.logprob for x in alone[i].logprobs]
    return {"changed_tokens": tok, "changed_logprobs": lp, "requests": n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-v4.1")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from mini.engine import LLM
    llm = LLM(a.model, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16,
              max_num_seqs=64, max_num_batched_tokens=a.max_num_batched_tokens, enforce_eager=a.enforce_eager,
              enable_prefix_caching=False, deterministic=a.deterministic)
    r = {"deterministic": a.deterministic, "graphs": llm.engine.runner.graphs is not None, **drift(llm)}
    print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
