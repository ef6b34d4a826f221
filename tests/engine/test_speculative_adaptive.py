"""Speculation's acceptance rule (Speculation.acceptance_cap, `--spec-adaptive`; docs/engine.md "The draft length"):
each sequence drafts as long as its past acceptance (beside the engine's) pays, none where its drafts keep failing (with a two-token probe
every PROBE_EVERY steps), and outputs never change. On the fake model's Markov chain (tests/engine/fake_model.py),
whose verify rows are exactly plain decode's, and on tiny-v4.1 for grammar-forced drafts."""
import pytest
import torch

import mini.ops
from fake_model import markov_llm
from mini.engine import LLM, SamplingParams
from mini.engine.speculative import (PROBE_DRAFT, PROBE_EVERY, RESTART_HITS, DraftRecord, least_paying_alpha,
                                     paying_draft)

V, K = 16, 5
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(7)) * 2


def _target(t: int) -> int:
    """The chain's greedy successor of token t (what a greedy request draws after it)."""
    return int(TABLE[t].argmax())


class SwitchDrafter:
    """mini.step.Drafter: wrong for its first `bad` calls, one after each step (each draft token one past the
    chain's greedy one: never a greedy request's token), the chain's greedy continuation after (always right for
    greedy requests). `asked`: the draft lengths it was asked for, per call (after step 1, 2, ...)."""
    min_confidence = 0.0

    def __init__(self, bad: int = 1 << 30, max_draft: int = K):
        self.bad, self.max_draft, self.asked = bad, max_draft, []

    def propose(self, cache, commits):
        out, wrong = [], len(self.asked) < self.bad
        self.asked.append([c.max_draft for c in commits if c.anchor is not None])
        for c in commits:
            draft, t = [], c.anchor
            while t is not None and len(draft) < c.max_draft:
                t = _target(t)
                draft.append((t + 1) % V if wrong else t)
            out.append(draft)
        return out

    def static_draft(self, static, cache):
        return None  # drafts on the host only (`propose`)


def _run(params, drafter=None, adaptive=True, n_seqs=4, **opts):
    """Outputs, the model's forwards ((start, length, drafts) per chunk) and the engine, one prompt per params."""
    llm = markov_llm(TABLE, num_blocks=256, max_num_seqs=16, seed=5, drafter=drafter,
                     spec_tokens=K if drafter else None, spec_adaptive=adaptive, **opts)
    prompts = [[2 + i % 13, 3 + (5 * i) % 11, 4 + i % 7] for i in range(len(params))]
    return llm.generate(prompts, params), llm.engine.model.steps, llm.engine


def _same(got, want):
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [[(lp.logprob, lp.top) for lp in o.logprobs] for o in got] == \
        [[(lp.logprob, lp.top) for lp in o.logprobs] for o in want]


def _rows(steps) -> int:
    """Decode and verify rows over all forwards (1 + drafts per decoding chunk)."""
    return sum(length for chunks in steps for _, length, d in chunks if length == 1 + d)


GREEDY = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (120, 100, 90, 130)]


@pytest.fixture(scope="module")
def plain():
    return _run(GREEDY)


def test_paying_draft_follows_the_cost_model():
    # none where drafts are never taken, full where they nearly always are, in between shorter
    assert [paying_draft(a, K, 16) for a in (0.0, 0.30, 0.36, 0.42, 0.6, 0.7, 0.8, 1.0)] == [0, 0, 1, 2, 3, 4, 5, 5]
    # a verify row is cheaper among few sequences: longer drafts pay at the same acceptance
    assert paying_draft(0.55, K, 1) == 3 and paying_draft(0.55, K, 64) == 2
    for b in (1, 16, 64, 256):  # monotone in alpha
        ks = [paying_draft(i / 100, K, b) for i in range(101)]
        assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == K
    assert paying_draft(1.0, 3, 16) == 3  # never past the longest allowed
    for b in (1, 4, 16, 40, 64, 256):  # the threshold the engine's foresight compares with
        least = least_paying_alpha(K, b)
        assert paying_draft(least, K, b) > 0 and paying_draft(least - 1e-9, K, b) == 0


def test_draft_record_estimates_acceptance():
    r = DraftRecord()
    assert r.alpha(1.0) == 1.0 and r.alpha(0.25) == 0.25  # no evidence of its own: the engine's α
    for _ in range(3):
        assert paying_draft(r.alpha(1.0), K, 16) > 0
        r.record(5, 0)
    assert paying_draft(r.alpha(1.0), K, 16) == 0  # three rejected drafts in a row: no more, even beside α = 1
    assert paying_draft(DraftRecord(0.0, 1.0).alpha(0.04), K, 16) == 0  # one, beside failing drafts elsewhere
    assert paying_draft(DraftRecord(0.0, 1.0).alpha(1.0), K, 16) > 0  # one, beside drafts taken elsewhere
    hits, misses = r.hits, r.misses
    r.record(2, 2)  # a whole draft accepted: no miss
    assert r.misses < misses and r.hits > hits
    r.probing = True
    r.record(2, 2)  # a probe accepted whole: afresh, long drafts even where the engine's drafts fail
    assert (r.hits, r.misses, r.probing) == (RESTART_HITS, 0.0, False)
    assert paying_draft(r.alpha(0.0), K, 1) == K and paying_draft(r.alpha(0.0), K, 64) >= 3
    r.probing = True
    r.record(2, 1)  # a probe half taken: one more miss
    assert r.misses == 1 and not r.probing


def test_failing_drafts_fall_to_probes_and_outputs_equal_plain_decode(plain):
    """An always-wrong drafter: after one verify step (its own miss beside every sequence's) a sequence drafts
    nothing but a PROBE_DRAFT-token probe every PROBE_EVERY steps; the rows of all forwards come within 20% of plain decode's (what the first steps' drafts
    and the probes cost; without the rule 1 + K times as many), the step count equals plain decode's (a wrong
    draft saves no step), outputs are plain decode's."""
    want, plain_steps, _ = plain
    junk = SwitchDrafter()
    outs, steps, engine = _run(GREEDY, junk)
    _same(outs, want)
    assert len(steps) == len(plain_steps)
    drafted = [sum(a) for a in junk.asked]  # tokens the drafter was asked for after each step (step i + 1)
    off = drafted.index(0)
    assert drafted[0] == 4 * K and off == 1, drafted[:10]
    assert all(d == 0 for i, d in enumerate(drafted[off:], off) if (i + 1) % PROBE_EVERY)
    assert all(d == 4 * PROBE_DRAFT for i, d in enumerate(drafted[off:80], off) if (i + 1) % PROBE_EVERY == 0)
    assert engine.stats.spec.accepted_tokens == 0
    assert engine.stats.spec.drafted_tokens == sum(drafted[:-1])  # every draft asked for was verified
    assert _rows(steps) <= 1.2 * _rows(plain_steps), (_rows(steps), _rows(plain_steps))
    off, off_steps, off_engine = _run(GREEDY, SwitchDrafter(), adaptive=False)  # today's rule: every step K
    _same(off, want)
    assert _rows(off_steps) > 5 * _rows(plain_steps)
    assert off_engine.stats.spec.drafted_tokens > 20 * engine.stats.spec.drafted_tokens


def test_good_drafts_stay_full(plain):
    """An oracle (the chain's greedy continuation, always right for greedy requests): every draft is as long as
    the other rules allow, the steps those of the rule off, a fraction of plain decode's."""
    want, plain_steps, _ = plain
    oracle, oracle_off = SwitchDrafter(bad=0), SwitchDrafter(bad=0)
    outs, steps, engine = _run(GREEDY, oracle)
    _same(outs, want)
    _, off_steps, _ = _run(GREEDY, oracle_off, adaptive=False)
    assert steps == off_steps and oracle.asked == oracle_off.asked  # full drafts (max_tokens' room allowing)
    assert len(steps) <= len(plain_steps) / 5
    spec = engine.stats.spec
    assert spec.accepted_tokens == spec.drafted_tokens


def test_a_drafter_that_turns_good_recovers_full_drafts(plain):
    """Wrong for its first 40 steps (drafts off after one verify step, the probe after step 32 rejected), right
    after: the probe after step 64 is accepted, which restarts each sequence's record (and lifts the engine's α),
    and full drafts follow; outputs are plain decode's throughout."""
    want, plain_steps, _ = plain
    drafter = SwitchDrafter(bad=40)
    outs, steps, _ = _run(GREEDY, drafter)
    _same(outs, want)
    asked = drafter.asked
    off = next(i for i, ks in enumerate(asked) if not any(ks))
    assert off == 1
    probes = [i + 1 for i in range(off, len(asked)) if any(asked[i])][:3]
    assert probes[:2] == [PROBE_EVERY, 2 * PROBE_EVERY], probes  # the probes, every sequence's at once
    assert all(asked[p - 1] == [PROBE_DRAFT] * 4 for p in probes[:2])
    assert probes[2] == 2 * PROBE_EVERY + 1 and asked[probes[2] - 1] == [K] * 4  # then full drafts
    assert len(steps) < 0.75 * len(plain_steps)


@pytest.mark.parametrize("bad", [1 << 30, 40])
def test_steps_without_drafts_overlap(plain, bad):
    """Overlapped scheduling under speculation: a step in which no sequence verifies a draft or will draft after it
    is plain decode's, launched before the step in flight is read back. With a drafter that is never right (or turns
    good after 40 steps) most steps are such; outputs, logprobs, every draft asked for and the probes' steps are
    those of the engine without overlap, and only the steps after which someone drafts wait for their tokens."""
    want, _, _ = plain
    ref_drafter, drafter = SwitchDrafter(bad), SwitchDrafter(bad)
    _, ref_steps, ref_engine = _run(GREEDY, ref_drafter)
    outs, steps, engine = _run(GREEDY, drafter, overlap=True)
    _same(outs, want)
    assert [(i, a) for i, a in enumerate(drafter.asked) if any(a)] == \
        [(i, a) for i, a in enumerate(ref_drafter.asked) if any(a)]
    assert engine.stats.spec.drafted_tokens == ref_engine.stats.spec.drafted_tokens
    assert engine.stats.spec.accepted_tokens == ref_engine.stats.spec.accepted_tokens
    assert ref_engine.stats.overlapped_steps == 0 and len(steps) <= len(ref_steps) + 1
    # every plain step is pure decode here (the prompts' steps verify: a new sequence drafts), so each overlaps
    assert engine.stats.overlapped_steps == engine.stats.spec.plain_steps
    assert engine.stats.spec.plain_steps >= (0.85 if bad > 1000 else 0.6) * len(steps)


def test_new_sequences_start_from_the_engines_recent_acceptance():
    """A never-right drafter: once the first four requests' drafts were rejected (one verify step), requests that
    arrive later draft nothing (but the probes) from their first step on, instead of learning it again in verify
    steps of their own; with an always-right drafter they draft in full at once. Outputs are plain decode's."""
    params = GREEDY + GREEDY[:2]
    want, _, _ = _run(params)
    prompts = [[2 + i % 13, 3 + (5 * i) % 11, 4 + i % 7] for i in range(len(params))]
    for bad, late_draft in ((1 << 30, False), (0, True)):
        drafter = SwitchDrafter(bad)
        llm = markov_llm(TABLE, num_blocks=256, max_num_seqs=16, seed=5, drafter=drafter, spec_tokens=K)
        engine, outs, late_asked = llm.engine, {}, None
        for i in range(4):
            engine.add_request(str(i), prompts[i], params[i])
        steps = 0
        while engine.has_work():
            if steps == 8:
                for i in (4, 5):
                    engine.add_request(str(i), prompts[i], params[i])
            asked = len(drafter.asked)
            outs |= {o.request_id: o for o in engine.step() if o.finished}
            if steps == 8:  # the late requests' prefill step: the drafts asked after it
                late_asked = drafter.asked[asked]
            steps += 1
        _same([outs[str(i)] for i in range(len(params))], want)
        # (a plain step asks the drafter for no draft at all)
        assert late_asked[-2:] == [K, K] if late_draft else not any(late_asked), late_asked
        # the engine's α: no draft pays at it even for a lone sequence, or every draft was taken
        assert engine.spec.engine_alpha < least_paying_alpha(K, 1) if bad else engine.spec.engine_alpha == 1.0


def test_sampled_requests_adapt_and_keep_their_outputs():
    """Seeded sampling (a draft is taken where it equals the seeded draw) with drafts that are seldom right:
    outputs equal plain decode's with the rule on and off, and the rule drafts far fewer tokens."""
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=80, ignore_eos=True, logprobs=1) for i in range(3)]
    want, _, _ = _run(params)
    on, _, on_engine = _run(params, SwitchDrafter())
    off, _, off_engine = _run(params, SwitchDrafter(), adaptive=False)
    _same(on, want)
    _same(off, want)
    assert on_engine.stats.spec.drafted_tokens < off_engine.stats.spec.drafted_tokens / 5


def test_the_flag_reaches_the_engine():
    from mini.args import ENGINE_FLAGS
    flag = next(f for f in ENGINE_FLAGS if f.name == "--spec-adaptive")
    assert flag.default is True and flag.type is None  # --spec-adaptive / --no-spec-adaptive
    _, _, engine = _run(GREEDY[:1], SwitchDrafter(), adaptive=False)
    assert engine.spec.adaptive is False


# ------------------------------------------------------------------------------------------- forced drafts
class JunkDrafter:
    """The anchor repeated: wrong almost always on tiny-v4.1 (as tests/engine/test_forced_drafts.py's)."""
    min_confidence = 0.0
    max_draft = 4

    def propose(self, cache, commits):
        return [[c.anchor] * c.max_draft if c.anchor is not None else [] for c in commits]

    def static_draft(self, static, cache):
        return None


def test_forced_drafts_are_not_cut_by_the_rule():
    """A regex whose free part lets junk drafts fail (the rule turns them off), then a forced literal: the forced
    run is still verified in runs of --spec-tokens, not recorded as the drafter's hits, and outputs, text and
    logprobs are the engine's without forced drafts or speculation."""
    from mini.server.grammars import regex_grammar

    literal = "the_forced_literal_of_many_tokens"
    params = SamplingParams(temperature=0, max_tokens=60, grammar=regex_grammar(f"[a-z]{{12}}{literal}"),
                            logprobs=1)
    opts = dict(device="cpu", dtype=torch.float32, block_tokens=16, num_blocks=64)
    with mini.ops.deterministic_mode():
        want = LLM("tiny-v4.1", **opts, forced_drafts=False).generate([[5, 6, 7]], params)
        llm = LLM("tiny-v4.1", **opts, drafter=JunkDrafter(), spec_tokens=4)
        llm.engine.add_request("r", [5, 6, 7], params)
        seq = llm.engine.requests["r"]
        outs = []
        while llm.engine.has_work():
            outs += [o for o in llm.engine.step() if o.finished]
    assert outs[0].text.endswith(literal), outs[0].text
    _same(outs, want)
    lengths = llm.engine.stats.spec.accept_lengths
    assert lengths[4] >= 5, lengths  # the literal's run, 4 a step, after the rule turned junk drafts off
    assert seq.draft_record.hits == 0  # forced tokens are not the drafter's hits (20 or more were accepted)


def test_the_warm_up_s_acceptance_stays():
    """The serving warm-up's drafts are evidence as any (LLMEngine.warmed_up resets the counters, not the engine's
    α): after a warm-up whose drafts failed the next request drafts nothing but the probes (no round of full drafts
    beside the first requests' prefill, docs/perf/018); after one whose drafts were taken it drafts in full."""
    for bad, want_first in ((1 << 30, []), (0, [K])):
        drafter = SwitchDrafter(bad)
        llm = markov_llm(TABLE, num_blocks=256, max_num_seqs=16, seed=5, drafter=drafter, spec_tokens=K)
        llm.generate([[2, 3, 4]] * 4, GREEDY)  # (the warm-up's requests)
        alpha = llm.engine.spec.engine_alpha
        llm.engine.warmed_up(0.0)
        assert llm.engine.spec.engine_alpha == alpha and llm.engine.stats.spec.drafted_tokens == 0
        asked = len(drafter.asked)
        llm.generate([[5, 6, 7]], GREEDY[:1])
        assert [k for k in drafter.asked[asked] if k] == want_first, drafter.asked[asked]