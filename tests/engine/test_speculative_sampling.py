"""Rejection sampling in the engine (mini/engine/speculative.py for unseeded sampling requests; the rule in
mini/engine/acceptance.py): speculation keeps the target's distribution.

The target is a Markov chain over 8 tokens (the logits after a history are TABLE[its last token]), so the
distribution of every output is known exactly. Thousands of unseeded requests of one prompt run in a few engine
steps (a fixed engine seed: reproducible), a drafter proposes the chain's most likely continuation (accepted about
half the time), and Pearson's chi-square compares the joint distributions of consecutive outputs with the exact
ones. Negative controls that must fail the same test: every draft accepted; a residual that keeps the rejected
draft (p instead of max(0, p - q)); the acceptance read from probabilities without the request's temperature.
Penalties, logit bias, top-p and min_tokens' hold: compared with plain decode's own draws (a two-sample test)."""
import functools

import pytest
import torch

import mini.engine.speculative as speculative
from mini.engine import SamplingParams
from mini.engine.acceptance import ACCEPT, rejection_sample, stream, target_probs, verify_proposals
from mini.engine.sampler import SamplingBatch, uniform_noise

import fake_model
from fake_model import markov_llm

V, PROMPT, N = 8, [3, 5], 3000
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(4)) * 1.2
PARAMS = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, logprobs=0)


def ChainDrafter(max_draft: int = 2):  # noqa: N802 (the drafter of fake_model, over this file's table)
    return fake_model.ChainDrafter(TABLE, max_draft)


def _run(params=PARAMS, drafter=None, seed=1, n=N):
    llm = markov_llm(TABLE, num_blocks=3 * n, max_num_seqs=n, max_num_batched_tokens=4 * n,
                     enable_prefix_caching=False, seed=seed, drafter=drafter, spec_max_rows=None,
                     spec_tokens=drafter.max_draft if drafter else None)
    outs = llm.generate([PROMPT] * n, params)
    assert all(len(o.token_ids) == params.max_tokens for o in outs)
    return outs, llm.engine


def _chain(temperature: float) -> list[torch.Tensor]:
    """Exact joint distributions [V, V] of (output i, output i + 1), i = 0, 1, 2, of the chain from PROMPT."""
    step = torch.softmax(TABLE.double() / temperature, dim=-1)  # [prev, next]
    marginal, joints = step[PROMPT[-1]], []
    for _ in range(PARAMS.max_tokens - 1):
        joints.append(marginal[:, None] * step)
        marginal = joints[-1].sum(0)
    return joints


def _p_value(observed: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """Pearson's chi-square over samples of one categorical variable: each sample's counts against its expected
    counts, cells expected fewer than 5 times pooled into one, `dof` = cells - 1 (one sample against known
    probabilities, or two against their pooled estimate). Returns P(X >= statistic), X ~ chi2(dof)."""
    rare = sum(expected).flatten() < 5 * len(expected)
    stat, cells = torch.zeros((), dtype=torch.float64), int((~rare).sum()) + bool(rare.any())
    for obs, exp in zip(observed, expected):
        obs, exp = obs.flatten().double(), exp.flatten().double()
        obs = torch.cat([obs[~rare], obs[rare].sum()[None]])
        exp = torch.cat([exp[~rare], exp[rare].sum()[None]])
        keep = exp > 0  # (the pooled cell of cells that cannot occur)
        stat += ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2, dtype=torch.float64), stat / 2))


def _pairs(outs, i: int) -> torch.Tensor:
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[i], o.token_ids[i + 1]] += 1
    return counts


def _fit(outs, temperature=PARAMS.temperature) -> list[float]:
    """p-values of the joint distributions of consecutive outputs against the chain's (outputs 1..3 are verified)."""
    return [_p_value([_pairs(outs, i)], [joint * len(outs)]) for i, joint in enumerate(_chain(temperature))]


def test_test_has_power_on_plain_decode():
    """The test itself: plain decode's draws fit the chain, and a wrong temperature is seen."""
    outs, _ = _run()
    assert min(_fit(outs)) > 1e-3
    assert min(_fit(outs, temperature=1.0)) < 1e-6


@pytest.fixture(scope="module")
def speculated():
    drafter = ChainDrafter()
    outs, engine = _run(drafter=drafter, seed=2)
    return outs, engine, drafter


def test_rejection_sampling_keeps_the_target_distribution(speculated):
    outs, engine, drafter = speculated
    assert min(_fit(outs)) > 1e-3, _fit(outs)
    spec = engine.stats.spec
    # every accept length occurs; roughly half the drafts are accepted
    assert len(spec.accept_lengths) == 3 and all(n > 100 for n in spec.accept_lengths), spec.accept_lengths
    assert 0.3 < spec.accepted_tokens / spec.drafted_tokens < 0.8
    assert engine.stats.steps <= 5  # thousands of requests, a few batched steps


def test_logprobs_are_the_targets_of_the_committed_tokens(speculated):
    outs, _, _ = speculated
    lp = torch.log_softmax(TABLE, dim=-1)
    for o in outs[:200]:
        prev = [PROMPT[-1]] + o.token_ids[:-1]
        want = [float(lp[p, t]) for p, t in zip(prev, o.token_ids)]
        assert [x.logprob for x in o.logprobs] == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("control", ["accept every draft", "residual keeps the draft", "no temperature"])
def test_negative_controls_fail(control, monkeypatch):
    if control == "accept every draft":
        def verify(p, proposals, seeds, counters):
            ok, residual = verify_proposals(p, proposals, seeds, counters)
            return torch.ones_like(ok), residual
        monkeypatch.setattr(speculative, "verify_proposals", verify)
    elif control == "residual keeps the draft":
        monkeypatch.setattr(speculative, "verify_proposals",
                            functools.partial(verify_proposals, residual_of=lambda p, q: p))
    else:
        monkeypatch.setattr(speculative, "target_probs", lambda logits, batch: torch.softmax(logits, dim=-1))
    outs, _ = _run(drafter=ChainDrafter(), seed=2)
    assert min(_fit(outs)) < 1e-6, _fit(outs)


def test_penalties_bias_top_p_and_min_tokens_keep_plain_decodes_distribution():
    """The verify rows' p is the sampler's: penalties and bias over the history with the drafts before the row,
    top-p, and min_tokens' hold (EOS = token 1 is never drawn before output 3; it may end the output after)."""
    params = SamplingParams(temperature=1.1, top_p=0.9, max_tokens=4, presence_penalty=0.8, frequency_penalty=0.3,
                            repetition_penalty=1.2, logit_bias={int(TABLE[5].argmax()): 1.5}, min_tokens=3)
    plain, _ = _run(params, seed=3, n=2000)
    spec, engine = _run(params, drafter=ChainDrafter(), seed=4, n=2000)
    assert engine.stats.spec.accepted_tokens > 500
    for outs in (plain, spec):
        assert all(1 not in o.token_ids[:3] for o in outs)
    for i in range(3):
        a, b = _pairs(plain, i), _pairs(spec, i)
        assert _p_value([a, b], [(a + b) / 2] * 2) > 1e-3, i  # two samples of one size: each expects half the pool


def test_batched_verify_is_the_reference_rule_with_one_hot_q():
    """verify_proposals row by row == rejection_sample with q one-hot on the proposal (same streams)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, V, generator=g) * 2, dim=-1)
    proposals = torch.where(torch.rand(64, generator=g) < 0.5, p.argmax(-1), torch.randint(0, V, (64,), generator=g))
    seeds, counters = torch.randint(0, 1 << 40, (64,), generator=g), torch.randint(0, 50, (64,), generator=g)
    ok, residual = verify_proposals(p, proposals, seeds, counters)
    for r in range(64):
        q = torch.zeros(1, V)
        q[0, proposals[r]] = 1.0
        a, token = rejection_sample(p[[r, r]], q, [int(proposals[r])], int(seeds[r]), int(counters[r]))
        assert bool(ok[r]) == (a == 1)
        if a == 0:
            assert int(residual[r]) == token != int(proposals[r])
    assert 10 < int(ok.sum()) < 54
    # the acceptance uniform is the draft token's in the ACCEPT stream
    u = uniform_noise(stream(seeds, ACCEPT), counters, V)[torch.arange(64), proposals]
    assert torch.equal(ok, u <= p[torch.arange(64), proposals])


def test_a_certain_draft_is_accepted_even_where_rounding_leaves_p_below_one():
    p = torch.zeros(3, V)
    p[:, 2] = 1.0 - 6e-8  # rounding: no other token has mass
    ok, _ = verify_proposals(p, torch.tensor([2, 2, 2]), torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]))
    assert ok.all()


def test_target_probs_is_what_sample_draws_from():
    """target_probs' rows (normalized) give the sampler's own race winner (same noise)."""
    from mini.engine.sampler import sample
    from mini.engine.sequence import Sequence
    seqs = [Sequence(f"r{i}", [3, 4, 4], SamplingParams(temperature=0.7, top_k=4, presence_penalty=0.5), seed=i,
                     eos_token_id=1, max_total_tokens=64) for i in range(32)]
    logits = torch.randn(32, V, generator=torch.Generator().manual_seed(1))
    b = SamplingBatch.from_seqs(seqs, V, "cpu")
    p = target_probs(logits, b)
    assert torch.allclose(p.sum(-1), torch.ones(32)) and ((p > 0).sum(-1) <= 4).all()
    race = (p / -torch.log(uniform_noise(b.seeds, b.counters, V))).argmax(-1)
    assert torch.equal(race, sample(logits, b).token_ids)


@pytest.mark.gpu
def test_rejection_verdicts_on_cuda_equal_the_cpus_gpu():
    """The rule's device path (target_probs, verify_proposals) on CUDA at a real vocabulary draws what the CPU's
    does: the streams are the same integer hashes; only p's rounding differs, so verdicts may differ where the
    uniform is within 1e-5 of p(d) and residual races only on near ties."""
    from mini.engine.sequence import Sequence
    vocab, n = 129280, 96
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=g) * 4
    seqs = [Sequence(f"r{i}", [3, 4, 4 + i], SamplingParams(temperature=0.6 + i / 200, top_p=0.95,
                                                            repetition_penalty=1.1), seed=1000 + i,
                     eos_token_id=1, max_total_tokens=64) for i in range(n)]
    proposals = logits.argmax(-1)
    got = {}
    for device in ("cpu", "cuda"):
        b = SamplingBatch.from_seqs(seqs, vocab, device)
        p = target_probs(logits.to(device), b)
        ok, residual = verify_proposals(p, proposals.to(device), b.seeds, b.counters)
        u = uniform_noise(stream(b.seeds, ACCEPT), b.counters, vocab)[torch.arange(n, device=device),
                                                                     proposals.to(device)]
        got[device] = (ok.cpu(), residual.cpu(), (u - p[torch.arange(n, device=device), proposals.to(device)]).cpu())
    ok, residual, margin = got["cpu"]
    assert 5 < int(ok.sum()) < n - 5
    assert torch.equal(ok | (margin.abs() < 1e-5), got["cuda"][0] | (margin.abs() < 1e-5))
    assert (residual == got["cuda"][1]).float().mean() > 0.97


def test_a_draft_the_grammar_refuses_is_always_rejected():
    """A grammar's mask enters p (target_probs): a refused proposal has p = 0, so it is rejected whatever the
    uniform, and the residual draws only tokens the grammar allows."""
    from mini.engine.sequence import Sequence
    n = 256
    seqs = [Sequence(f"r{i}", [3, 4], SamplingParams(temperature=1.0), seed=i, eos_token_id=1, max_total_tokens=64)
            for i in range(n)]
    b = SamplingBatch.from_seqs(seqs, V, "cpu")
    b.allowed = torch.full((n, 1), 0b01101100, dtype=torch.int32)  # tokens 2, 3, 5, 6
    logits = torch.zeros(n, V)
    logits[:, 0] = 5.0  # the unconstrained favourite, refused
    p = target_probs(logits, b)
    ok, residual = verify_proposals(p, torch.zeros(n, dtype=torch.int64), b.seeds, b.counters)
    assert not ok.any() and set(residual.tolist()) == {2, 3, 5, 6}
    ok, residual = verify_proposals(p, torch.full((n,), 3), b.seeds, b.counters)
    assert 0.1 < ok.float().mean() < 0.4 and set(residual[~ok].tolist()) == {2, 5, 6}  # p(3) = 1/4
