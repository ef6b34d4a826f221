"""Rejection sampling for speculative decoding (mini/engine/acceptance.py) keeps the target's distribution: a
chi-square test over many seeded draws on a 5-token vocabulary, with negative controls that must fail (the
acceptance test reading the uniform that drew the draft; a residual that is the target itself)."""
import torch

from mini.engine.acceptance import DRAFT, race, rejection_sample

P = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05], [0.05, 0.05, 0.20, 0.30, 0.40], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.10, 0.10, 0.20, 0.30, 0.30], [0.30, 0.30, 0.20, 0.10, 0.10]])
TRIALS = 4000


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs`: P(X >= statistic), X ~ chi2(V - 1)."""
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = probs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2))


def _outputs(**control) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first output token over all trials, and of the second where the first draft was accepted."""
    first, second = torch.zeros(5), torch.zeros(5)
    for seed in range(TRIALS):
        seeds, counters = torch.tensor([seed]), torch.arange(2)
        draft = race(Q, seeds.repeat(2), counters, DRAFT).tolist()  # d_i ~ q_i, the draft's own stream
        a, token = rejection_sample(P, Q, draft, seed, 0, **control)
        out = draft[:a] + [token]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def test_speculative_sampling_keeps_the_target_distribution():
    first, second = _outputs()
    assert _p_value(first, P[0]) > 1e-3
    assert second.sum() > 500 and _p_value(second, P[1]) > 1e-3


def test_shared_noise_biases_the_output():
    first, _ = _outputs(accept_purpose=DRAFT)  # the draft won its race with a large uniform: rejected too often
    assert _p_value(first, P[0]) < 1e-6


def test_a_biased_residual_biases_the_output():
    first, _ = _outputs(residual_of=lambda p, q: p)
    assert _p_value(first, P[0]) < 1e-6
