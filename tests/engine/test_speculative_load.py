"""Speculation's load rule (Speculation.load_cap, `--spec-max-rows`; docs/engine.md): the verify rows of a step,
(1 + k) per decoding sequence, stay within the row budget, drafts shrink (to none) as the batch grows and come back
as it empties, and outputs never change. On the fake model's Markov chain (tests/engine/fake_model.py), whose
verify rows are exactly plain decode's."""
import pytest
import torch

import fake_model
from fake_model import markov_llm
from mini.engine import SamplingParams
from mini.engine.speculative import Speculation

V, K = 16, 4
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(7)) * 2


def ChainDrafter():  # noqa: N802 (the drafter of fake_model, over this file's table)
    return fake_model.ChainDrafter(TABLE, K)


class _Drafter:
    max_draft = 5


@pytest.mark.parametrize("rows, want", [(384, {1: 5, 64: 5, 65: 4, 96: 3, 128: 2, 192: 1, 193: 0, 1000: 0}),
                                        (None, {1: 5, 1000: 5}), (1, {1: 0, 7: 0})])
def test_load_cap_fits_the_row_budget(rows, want):
    spec = Speculation(None, _Drafter(), 5, rows)
    assert {b: spec.load_cap(b) for b in want} == want
    for b in range(1, 400):
        assert rows is None or b * (1 + spec.load_cap(b)) <= max(rows, b)


def test_a_row_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="spec max rows must be at least 1"):
        Speculation(None, _Drafter(), 5, 0)


def _run(params, drafter=None, max_rows=None):
    llm = markov_llm(TABLE, num_blocks=128, max_num_seqs=16, seed=5, drafter=drafter,
                     spec_tokens=K if drafter else None, spec_max_rows=max_rows)
    prompts = [[2 + i % 13, 3 + (5 * i) % 11, 4 + i % 7] for i in range(len(params))]
    return llm.generate(prompts, params), llm.engine.model.steps


# greedy and seeded, ending at different lengths: the batch of decoding sequences shrinks from 12 to 1
LENGTHS = [3 + 2 * i for i in range(10)] + [30, 40]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) if i % 2 else
          SamplingParams(temperature=0.9, seed=i, max_tokens=n, ignore_eos=True, logprobs=1)
          for i, n in enumerate(LENGTHS)]


def _verify_steps(steps):
    """(decoding sequences, verify rows, draft lengths) of each step (a decode chunk: 1 + drafts tokens)."""
    out = []
    for chunks in steps:
        decode = [d for _, length, d in chunks if length == 1 + d]
        if decode:
            out.append((len(decode), sum(1 + d for d in decode), decode))
    return out


def test_the_load_rule_caps_verify_rows_and_never_changes_outputs():
    plain, _ = _run(PARAMS)
    free, free_steps = _run(PARAMS, ChainDrafter())
    capped, steps = _run(PARAMS, ChainDrafter(), max_rows=12)
    for outs in (free, capped):
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert [[(lp.logprob, lp.top) for lp in o.logprobs] for o in outs] == \
            [[(lp.logprob, lp.top) for lp in o.logprobs] for o in plain]
    assert max(rows for _, rows, _ in _verify_steps(free_steps)) > 12  # without the rule the rows exceed 12
    verify = _verify_steps(steps)
    for b, rows, drafts in verify:
        assert rows <= max(12, b), (b, drafts)
        assert max(drafts) <= max(0, min(K, 12 // b - 1)), (b, drafts)
    assert any(b >= 7 and max(drafts) == 0 for b, _, drafts in verify)  # a full batch decodes plainly
    assert any(b <= 2 and max(drafts) == K for b, _, drafts in verify)  # a small one takes whole drafts
    assert len(steps) < len(_run(PARAMS)[1])  # and speculation still saves steps
