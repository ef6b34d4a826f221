"""Batched sampler against per-row plain-Python references."""
import math

import pytest
import torch

from mini.engine.sampler import SamplingBatch, apply_penalties, filtered_probs, sample, uniform_noise
from mini.engine.sequence import SamplingParams, Sequence


def _seqs(params, outputs=None, prompts=None):
    seqs = []
    for i, p in enumerate(params):
        s = Sequence(f"r{i}", (prompts or [[1, 2, 3]] * len(params))[i], p, seed=1000 + i)
        s.output_token_ids = list((outputs or [[]] * len(params))[i])
        seqs.append(s)
    return seqs


def test_greedy_and_top_k_1_are_argmax():
    logits = torch.randn(5, 37)
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=2.0, top_k=1)] * 2
    b = SamplingBatch.from_seqs(_seqs(params), 37, "cpu")
    assert torch.equal(sample(logits, b).token_ids, logits.argmax(-1))


def test_filters_match_reference():
    torch.manual_seed(1)
    V = 23
    logits = torch.randn(4, V) * 2
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.6),
              SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.9, top_k=7, top_p=0.8, min_p=0.05)]
    b = SamplingBatch.from_seqs(_seqs(params), V, "cpu")
    got = filtered_probs(logits, b)
    for i, p in enumerate(params):
        probs = torch.softmax(logits[i] / p.temperature, -1).tolist()
        order = sorted(range(V), key=lambda v: -probs[v])
        keep, mass = set(), 0.0
        for rank, v in enumerate(order):
            ok = (p.top_k < 0 or rank < p.top_k) and mass < p.top_p and probs[v] >= p.min_p * probs[order[0]]
            if ok or rank == 0:
                keep.add(v)
            mass += probs[v]
        want = torch.tensor([probs[v] if v in keep else 0.0 for v in range(V)])
        torch.testing.assert_close(got[i], want)


def test_penalties_match_reference():
    V = 11
    logits = torch.randn(2, V)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5),
              SamplingParams(repetition_penalty=0.8)]
    seqs = _seqs(params, outputs=[[4, 4, 7], [2]], prompts=[[1, 9], [3, 3]])
    got = apply_penalties(logits, SamplingBatch.from_seqs(seqs, V, "cpu"))
    for i, s in enumerate(seqs):
        p, row = s.params, logits[i].tolist()
        for v in range(V):
            if v in s.tokens:
                row[v] = row[v] / p.repetition_penalty if row[v] > 0 else row[v] * p.repetition_penalty
            c = s.output_token_ids.count(v)
            row[v] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        torch.testing.assert_close(got[i], torch.tensor(row))


def test_seeded_draws_follow_the_distribution():
    """The counter-based race is an exact sampler: frequencies over many counters match the probabilities."""
    V, n = 6, 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(n, V)
    seqs = _seqs([SamplingParams(temperature=1.0)] * n)
    b = SamplingBatch.from_seqs(seqs, V, "cpu")
    b.seeds = torch.full((n,), 12345, dtype=torch.int64)
    b.counters = torch.arange(n, dtype=torch.int64)
    ids = sample(logits, b).token_ids
    freq = torch.bincount(ids, minlength=V).float() / n
    probs = torch.softmax(logits[0], -1)
    assert (freq - probs).abs().max() < 4 * math.sqrt(0.25 / n)


def test_noise_is_a_function_of_seed_counter_token():
    seeds = torch.tensor([1, 2, 1, -5], dtype=torch.int64)
    counters = torch.tensor([0, 0, 0, 7], dtype=torch.int64)
    u = uniform_noise(seeds, counters, 50)
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert torch.equal(uniform_noise(seeds[3:], counters[3:], 50)[0], u[3])
    assert float(u.min()) > 0 and float(u.max()) < 1


def test_logprobs_top_n():
    logits = torch.randn(3, 17)
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=0)]
    out = sample(logits, SamplingBatch.from_seqs(_seqs(params), 17, "cpu"))
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, lp.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, lp.topk(2, -1).values)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-3), dict(min_p=2),
                                 dict(max_tokens=0), dict(presence_penalty=3), dict(repetition_penalty=0),
                                 dict(logprobs=50), dict(temperature=float("nan"))])
def test_bad_params_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def _bits(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """int32 [n, words] bitmask from allowed-id lists (reference packing, one bit at a time)."""
    words = (vocab + 31) // 32
    mask = torch.zeros(len(allowed), words, dtype=torch.int64)
    for i, ids in enumerate(allowed):
        for t in ids:
            mask[i, t // 32] |= 1 << (t % 32)
    return torch.where(mask >= 1 << 31, mask - (1 << 32), mask).to(torch.int32)  # the same bits as int32


@pytest.mark.parametrize("vocab", [37, 64, 100])
def test_grammar_mask_only_allowed_tokens_are_drawn(vocab):
    torch.manual_seed(3)
    rng = torch.Generator().manual_seed(4)
    allowed = [sorted(torch.randperm(vocab, generator=rng)[:k].tolist()) for k in (1, 3, 5, vocab)]
    allowed[1] = [vocab - 1, 31, 0]  # the high bits of a word (bit 31 is the int32 sign)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.5), SamplingParams(temperature=0)]
    logits = torch.randn(4, vocab) * 4
    b = SamplingBatch.from_seqs(_seqs(params), vocab, "cpu", _bits(allowed, vocab))
    for counter in range(20):
        b.counters = torch.full((4,), counter, dtype=torch.int64)
        got = sample(logits, b).token_ids.tolist()
        assert all(t in a for t, a in zip(got, allowed))
    # greedy rows: the argmax among the allowed; the unrestricted row: the plain argmax
    assert got[0] == max(allowed[0], key=lambda t: logits[0, t]) and got[3] == int(logits[3].argmax())


def test_logit_bias_is_added_before_the_draw_and_not_to_logprobs():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    params = [SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=1),
              SamplingParams(temperature=0, logit_bias={3: -100.0}, logprobs=1)]
    b = SamplingBatch.from_seqs(_seqs(params), 10, "cpu")
    out = sample(logits, b)
    assert out.token_ids.tolist()[0] == 7 and out.token_ids.tolist()[1] != 3
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
