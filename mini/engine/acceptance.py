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

The engine (mini.engine.speculative) uses it for unseeded sampling requests, with the drafts as deterministic
proposals: q_i one-hot on d_i (`verify_proposals`). That is exact whatever chose d_i, as long as the choice does
not read the acceptance or residual streams at its own index (a drafter's choice reads the committed history
only): P(out = d) = p(d), P(out = x != d) = (1 - p(d)) · p(x) / (1 - p(d)) = p(x). DSpark's drafts are argmaxes,
so one-hot is its true q; a sampling drafter would accept more by handing over its q, which the Drafter contract
(mini.step) does not carry.
"""
from __future__ import annotations

import torch

from mini.engine.sampler import (SamplingBatch, _i64, apply_bias_and_mask, apply_penalties, filtered_probs,
                                 splitmix64, uniform_noise)

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
        residual = (p[i] - q[i]).clamp(min=0) if residual_of is None else residual_of(p[i], q[i])
        if u * q[i, d] <= p[i, d] or residual.sum() <= 0:  # (no residual mass: p_i == q_i but for rounding)
            continue
        return i, int(race(residual[None], seeds, counters, RESIDUAL)[0])
    counters = torch.tensor([counter + k], dtype=torch.int64, device=p.device)
    return k, int(race(p[k][None], seeds, counters, 0)[0])


def target_probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The distributions the sampler draws the rows of `logits` from (penalties, bias, grammar mask, temperature,
    top-k/p, min-p: the functions `sample` applies, in its order), normalized: the p of the rule above."""
    probs = filtered_probs(apply_bias_and_mask(apply_penalties(logits, b), b), b)
    return probs / probs.sum(-1, keepdim=True)


def verify_proposals(p: torch.Tensor, proposals: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                     residual_of=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule above for deterministic drafts (q one-hot on the proposed token), one row per output index, all
    rows of a step at once: row r drew output index counters[r] of the request seeded seeds[r] with distribution
    p[r], and `proposals[r]` is the draft token proposed for it. Returns ([n] bool: the proposal is accepted, with
    probability p[r, d]; [n] the residual's token, drawn from p[r] without d, meaningful where not accepted).
    Equal to `rejection_sample` with one-hot q row by row (tested). A residual with no mass left (p[r, d] == 1 but
    for rounding) accepts. `residual_of(p, q)`: the tests' negative control."""
    rows = torch.arange(p.shape[0], device=p.device)
    p_d = p[rows, proposals]
    u = uniform_noise(stream(seeds, ACCEPT), counters, p.shape[-1])[rows, proposals]
    q = torch.zeros_like(p)
    q[rows, proposals] = 1.0
    residual = (p - q).clamp(min=0) if residual_of is None else residual_of(p, q)
    accepted = (u <= p_d) | (residual.sum(-1) <= 0)
    return accepted, race(residual, seeds, counters, RESIDUAL)
