"""Batched sampling: penalties, logit bias, grammar masks, temperature, top-k / top-p / min-p, seeded draws,
logprobs.

All the math runs on `[n, vocab]` tensors; the only per-sequence work is packing parameters into tensors.

Seeded draws are counter-based, so a request's tokens depend only on its seed and its own history, never on
which other requests share the step: the draw for the request's `k`-th output token is the Gumbel-style
exponential race `argmax_v p_v / E_v`, with `E_v = -log(u_v)` and `u_v` a splitmix64 hash of (seed, k, v).
This is an exact sample from `p` (the race winner of independent exponentials is distributed as `p`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mini.engine.sequence import Sequence

_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 tensors (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[n, vocab]` float32 uniforms in (0, 1), a pure function of (seed, counter, token id)."""
    base = splitmix64(splitmix64(seeds) + counters)
    h = splitmix64(base[:, None] + torch.arange(vocab, device=seeds.device, dtype=torch.int64))
    return (_shr(h, 40).float() + 0.5) * (1.0 / (1 << 24))


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device`. On CUDA through pinned memory, without waiting: a copy from pageable
    memory waits for all the work queued before it (a step in flight), which overlapped steps must not."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplingBatch:
    """Per-row parameters of one step, as tensors on the logits' device."""
    temperature: torch.Tensor  # [n] f32, 0 = greedy
    top_p: torch.Tensor  # [n] f32
    top_k: torch.Tensor  # [n] i64, vocab = off
    min_p: torch.Tensor  # [n] f32
    seeds: torch.Tensor  # [n] i64
    counters: torch.Tensor  # [n] i64: index of the token being drawn in the request's output
    presence: torch.Tensor  # [n] f32
    frequency: torch.Tensor  # [n] f32
    repetition: torch.Tensor  # [n] f32
    output_counts: torch.Tensor | None  # [n, vocab] f32 counts of output tokens (None: no penalties)
    seen: torch.Tensor | None  # [n, vocab] bool, token appears in prompt or output (None: no repetition penalty)
    bias: torch.Tensor | None  # [n, vocab] f32 added to the logits (OpenAI logit_bias; None: no row has one)
    allowed: torch.Tensor | None  # [n, words] int32 bitmask of the tokens a row's grammar allows (None: no grammar)
    n_logprobs: int  # max top-n over the rows (-1: none wants logprobs)
    all_greedy: bool
    any_filter: bool  # some row uses top-k, top-p or min-p (else the sort is skipped)

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], vocab: int, device, allowed: torch.Tensor | None = None
                  ) -> "SamplingBatch":
        """`allowed`: the rows' grammar bitmask on `device` (mini.engine.structured; LLMEngine._sample sets it when
        the masks are filled in the background)."""
        ps = [s.params for s in seqs]
        out_counts = seen = None
        if any(p.presence_penalty or p.frequency_penalty for p in ps):
            out_counts = _token_counts([s.output_token_ids for s in seqs], vocab, device)
        if any(p.repetition_penalty != 1.0 for p in ps):
            seen = _token_counts([s.tokens for s in seqs], vocab, device) > 0
        # two host tensors, two copies to the device (not one per parameter), neither waiting for the device
        floats = torch.tensor([[p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                                p.repetition_penalty] for p in ps], dtype=torch.float32)
        floats = to_device(floats, device).unbind(1)
        ints = torch.tensor([[p.top_k if 0 < p.top_k < vocab else vocab, s.seed, s.num_output_tokens]
                             for s, p in zip(seqs, ps)], dtype=torch.int64)
        ints = to_device(ints, device).unbind(1)
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], presence=floats[3], frequency=floats[4],
            repetition=floats[5], top_k=ints[0], seeds=ints[1], counters=ints[2],
            output_counts=out_counts, seen=seen, bias=_logit_bias(seqs, vocab, device), allowed=allowed,
            n_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
            all_greedy=all(p.temperature == 0 for p in ps),
            any_filter=any(0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0 for p in ps))


# below min_tokens, EOS and stop_token_ids get this bias: never drawn, except where a grammar allows nothing else
# (-inf would leave such a row no token at all)
HOLD_BIAS = -1e30


def _logit_bias(seqs: list[Sequence], vocab: int, device) -> torch.Tensor | None:
    """OpenAI's logit_bias, and min_tokens' hold on the tokens that would end the output."""
    held = [s for s in seqs if s.num_output_tokens < s.params.min_tokens]
    if not held and not any(s.params.logit_bias for s in seqs):
        return None
    bias = torch.zeros(len(seqs), vocab, dtype=torch.float32)
    for i, s in enumerate(seqs):
        for tid, value in (s.params.logit_bias or {}).items():
            if tid < vocab:
                bias[i, tid] = value
        if s.num_output_tokens < s.params.min_tokens:
            ends = [t for t in (*s.params.stop_token_ids, s.eos_token_id) if t is not None and t < vocab]
            bias[i, ends] = HOLD_BIAS
    return to_device(bias, device)


def _token_counts(histories: list[list[int]], vocab: int, device) -> torch.Tensor:
    counts = torch.zeros(len(histories), vocab, dtype=torch.float32, device=device)
    width = max((len(h) for h in histories), default=0)
    if width == 0:
        return counts
    ids = torch.zeros(len(histories), width, dtype=torch.int64)
    ones = torch.zeros(len(histories), width, dtype=torch.float32)
    for i, h in enumerate(histories):
        ids[i, :len(h)] = torch.tensor(h, dtype=torch.int64)
        ones[i, :len(h)] = 1.0
    return counts.scatter_add_(1, to_device(ids, device), to_device(ones, device))


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [n] i64
    logprobs: torch.Tensor | None  # [n] f32: raw logprob of the chosen token
    top_ids: torch.Tensor | None  # [n, n_logprobs] i64
    top_logprobs: torch.Tensor | None  # [n, n_logprobs] f32


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.seen is not None:  # CTRL-style: shrink the logit of every token seen in prompt or output
        rp = b.repetition[:, None]
        logits = torch.where(b.seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if b.output_counts is not None:  # OpenAI-style: output tokens only
        logits = logits - b.frequency[:, None] * b.output_counts - b.presence[:, None] * (b.output_counts > 0)
    return logits


def filtered_probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Softmax at each row's temperature, with top-k, top-p and min-p applied (renormalisation is implicit in
    the race, which only compares ratios)."""
    temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if not b.any_filter:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    mass_before = sorted_p.cumsum(-1) - sorted_p
    drop = (rank >= b.top_k[:, None]) | (mass_before >= b.top_p[:, None]) \
        | (sorted_p < b.min_p[:, None] * sorted_p[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    return probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))


def unpack_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The allowed tokens of grammar rows (mini.engine.structured writes the mask): bool [n, vocab] from an int32
    [n, words] bitmask (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, device=mask.device, dtype=torch.int32)
    return ((mask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]


def apply_bias_and_mask(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.bias is not None:
        logits = logits + b.bias
    if b.allowed is not None:  # tokens outside a row's grammar can never be drawn
        logits = logits.masked_fill(~unpack_bitmask(b.allowed, logits.shape[-1]), float("-inf"))
    return logits


def sample(logits: torch.Tensor, b: SamplingBatch) -> SampleOutput:
    """Choose one token per row of `logits` (fp32 `[n, vocab]`). Logprobs are those of the raw logits."""
    raw = logits
    logits = apply_bias_and_mask(apply_penalties(logits, b), b)
    ids = logits.argmax(dim=-1)
    if not b.all_greedy:
        probs = filtered_probs(logits, b)
        race = probs / -torch.log(uniform_noise(b.seeds, b.counters, logits.shape[-1]))
        ids = torch.where(b.temperature > 0, race.argmax(dim=-1), ids)
    if b.n_logprobs < 0:
        return SampleOutput(ids, None, None, None)
    lp = torch.log_softmax(raw, dim=-1)
    top_lp, top_ids = lp.topk(b.n_logprobs, dim=-1) if b.n_logprobs else (lp[:, :0], ids[:, None][:, :0])
    return SampleOutput(ids, lp.gather(1, ids[:, None])[:, 0], top_ids, top_lp)
