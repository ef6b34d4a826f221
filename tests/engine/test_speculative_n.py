"""`n > 1` with speculation (docs/engine.md, DSpark speculative decoding): the server's fork (mini.server.app
`_start_n`: choice 0 ends its prefill with a snapshot at the prompt's last block boundary, the others are submitted
later with seed + i and take the prompt from the prefix cache) taken while choice 0 is in the middle of
speculation. Tiny-v4.1-dspark with DSpark as the drafter, CPU, fp32, the kernels' deterministic mode: every
choice's tokens and logprobs equal plain decode's under the same fork, and every draft a child proposes (from the
DSpark rings its snapshot restore gave it) equals the draft proposed at the same history without prefix caching."""
from dataclasses import replace

import torch

from mini.engine import LLM, SamplingParams

OPTS = dict(device="cpu", dtype=torch.float32, block_tokens=16, num_blocks=64)
PROMPTS = [[5 + (11 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate([37, 21])]
# greedy with distinct seeds (n = 2: one output twice) and seeded sampling (n = 3: seeds 7, 8, 9)
GROUPS = [(PROMPTS[0], SamplingParams(temperature=0, seed=3, max_tokens=7, ignore_eos=True, logprobs=1), 2),
          (PROMPTS[1], SamplingParams(temperature=0.8, seed=7, max_tokens=7, ignore_eos=True, logprobs=1), 3)]


class Recording:
    """Wraps a drafter: every draft it proposes, by the history it was anchored on."""

    def __init__(self, drafter):
        self.drafter, self.max_draft, self.min_confidence, self.drafts = drafter, drafter.max_draft, 0.0, {}

    def propose(self, cache, commits):
        out = self.drafter.propose(cache, commits)
        for c, d in zip(commits, out):
            if d:
                self.drafts.setdefault(tuple(c.history()), []).append(d)
        return out

    def static_draft(self, static, cache):
        return None  # drafts on the host only (`propose`)


def _fork(llm, after: int = 2):
    """Each group as the server runs it: choice 0 (share_prompt) alone until it has `after` tokens, then the other
    choices with seed + i. Returns the outputs by choice, and whether choice 0 had a draft pending at the fork."""
    e, final = llm.engine, {}

    def step():
        for o in e.step():
            if o.finished:
                final[o.request_id] = o

    for g, (prompt, params, _) in enumerate(GROUPS):
        e.add_request(f"{g}-0", prompt, replace(params, share_prompt=True))
    while any(len(e.requests[f"{g}-0"].output_token_ids) < after for g in range(len(GROUPS))):
        step()
    pending = all(e.requests[f"{g}-0"].draft for g in range(len(GROUPS)))
    for g, (prompt, params, n) in enumerate(GROUPS):
        for i in range(1, n):
            e.add_request(f"{g}-{i}", prompt, replace(params, seed=params.seed + i))
    while e.has_work():
        step()
    return [[final[f"{g}-{i}"] for i in range(n)] for g, (_, _, n) in enumerate(GROUPS)], pending


def _same(got, want):
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [[(lp.logprob, lp.top) for lp in o.logprobs] for o in got] == \
        [[(lp.logprob, lp.top) for lp in o.logprobs] for o in want]


def test_n_choices_forked_mid_speculation_equal_plain_decode(kernels_deterministic):
    plain, _ = _fork(LLM("tiny-v4.1-dspark", **OPTS))
    # full drafts (no acceptance rule): which histories draft must not depend on the other requests' outcomes
    spec = LLM("tiny-v4.1-dspark", **OPTS, speculative="dspark", spec_adaptive=False)
    spec.engine.spec.drafter = forked = Recording(spec.engine.spec.drafter)
    outs, pending = _fork(spec)
    assert pending  # choice 0 was speculating when the others came
    for got, want in zip(outs, plain):
        _same(got, want)
        assert all(o.num_cached_tokens == 16 * (len(o.prompt_token_ids) // 16) for o in got[1:])  # the snapshot
    assert outs[0][0].token_ids == outs[0][1].token_ids  # greedy: the seed changes nothing
    assert len({tuple(o.token_ids) for o in outs[1]}) > 1  # seeded: the choices differ
    # the children's drafts: those made at the same histories with every choice prefilled from scratch
    alone = LLM("tiny-v4.1-dspark", **OPTS, enable_prefix_caching=False, speculative="dspark", spec_adaptive=False)
    alone.engine.spec.drafter = ref = Recording(alone.engine.spec.drafter)
    alone.generate([p for p, _, n in GROUPS for _ in range(n)],
                   [replace(s, seed=s.seed + i) for _, s, n in GROUPS for i in range(n)])
    assert forked.drafts.keys() == ref.drafts.keys()
    for history, drafts in forked.drafts.items():
        assert all(d == ref.drafts[history][0] for d in drafts + ref.drafts[history]), history
    assert spec.engine.stats.spec.drafted_tokens > 0
