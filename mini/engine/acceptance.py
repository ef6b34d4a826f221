"""Rejection sampling for speculative decoding (Leviathan et al. 2023, Chen et al. 2023), with the sampler's
counter-based draws (mini.engine.sampler): the output keeps the target's distribution whatever the drafts are.

For output index n + i (row i of a verify chunk) with target probabilities p_i and draft probabilities q_i (both
after the same penalties, bias, mask, temperature and filters) and the draft's token d_i ~ q_i:
* accept d_i when u_i · q_i(d_i) <= p_i(d_i), u_i uniform (probability min(1, p_i(d_i) / q_i(d_i)));
* else draw the token from the residual norm(max(0, p_i - q_i)) and stop;
* all k accepted: the next token is the target's own draw from p_k (the plain engine's stream for index n + k).
Each purpose has its own stream, a pure function of (seed, purpose, output index): the draft's draw, the
acceptance test and the residual never share a uniform (shared noise biases the output: the tests' negative
control).

Status (docs/engine.md): the rule and its statistical test; the engine does not use it yet (its one acceptance
rule takes a draft only where it equals the target's own draw, `speculative.accept`), because the drafter hands
over tokens, not the draft distributions q this rule needs.
"""
from __future__ import annotations

import torch

from mini.engine.sampler import _i64, splitmix64, uniform_noise

DRAFT, ACCEPT, RESIDUAL = 1, 2, 3  # stream purposes; 0 is the plain sampler's own stream


def stream(seeds: torch.Tensor, purpose: int) -> torch.Tensor:
    """Per-request seeds of one purpose's stream (purpose 0: the seeds themselves, the plain sampler's draws)."""
    return seeds if purpose == 0 else splitmix64(seeds ^ _i64(0xD1B54A32D192ED03 * purpose & ((1 << 64) - 1)))


def race(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, purpose: int) -> torch.Tensor:
    """[n] tokens drawn from the rows of `probs` [n, V] (unnormalized) with the purpose's exponential race."""
    noise = uniform_noise(stream(seeds, purpose), counters, probs.shape[-1])
    return (probs / -torch.log(noise)).argmax(-1)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: list[int], seed: int, counter: int,
                     accept_purpose: int = ACCEPT, residual_of=None) -> tuple[int, int]:
    """One sequence's verify: p [k + 1, V] target rows, q [k, V] draft rows, `draft` its k tokens, drawn for output
    indices counter..counter+k. Returns (a: drafts accepted, the token after them). `accept_purpose` and
    `residual_of(p_i, q_i)` exist for the tests' negative controls (the acceptance test reading the draft's own
    noise, a biased residual)."""
    k = len(draft)
    seeds = torch.tensor([seed], dtype=torch.int64, device=p.device)
    for i, d in enumerate(draft):
        counters = torch.tensor([counter + i], dtype=torch.int64, device=p.device)
        u = uniform_noise(stream(seeds, accept_purpose), counters, p.shape[-1])[0, d]  # the drafted token's uniform
        if u * q[i, d] <= p[i, d]:
            continue
        residual = (p[i] - q[i]).clamp(min=0) if residual_of is None else residual_of(p[i], q[i])
        return i, int(race(residual[None], seeds, counters, RESIDUAL)[0])
    counters = torch.tensor([counter + k], dtype=torch.int64, device=p.device)
    return k, int(race(p[k][None], seeds, counters, 0)[0])
