"""DP balance: which rank takes a new request, and how many prompt tokens each rank prefills per lock step.

Pure Python over `RankLoad` reports (no process group): every rank sends its load in the step message
(mini.parallel.serve), rank 0 places requests with `Placement`, and every rank derives the same per-step prefill
cap from the same reports with `prefill_cap`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLoad:
    """One rank's work as its engine sees it at the start of a step."""
    prefill_tokens: int = 0  # prompt (history) tokens not yet in the cache: waiting + running in prefill
    decode_tokens: int = 0  # context (tokens in the cache) of the sequences that decode
    decode_seqs: int = 0  # sequences that decode (one token each per step)
    cache_free_tokens: int = 0  # free KV-cache blocks x block tokens

    @property
    def tokens_in_flight(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def plus(self, prompt_tokens: int) -> RankLoad:
        """This load after a request of `prompt_tokens` was added (it will need as much cache)."""
        return RankLoad(self.prefill_tokens + prompt_tokens, self.decode_tokens, self.decode_seqs,
                        self.cache_free_tokens - prompt_tokens)

    @staticmethod
    def of(engine) -> RankLoad:
        """An LLMEngine's load (LLMEngine.load)."""
        load = engine.load()
        return RankLoad(load.prefill_tokens, load.decode_tokens, load.decode_seqs, load.cache_free_tokens)


class Placement:
    """Rank 0's choice of rank for a new request, by load.

    Ranks whose free cache holds the prompt come first (a rank without room would preempt or queue it); among
    them the fewest tokens in flight (prompt tokens still to prefill + decoding context: what the rank's steps
    and attention will cost), then the most free cache, then the lowest rank. When no rank has room, the one
    with the most free cache.

    Reports arrive once per step and lag the requests placed since; `place` adds those to the report (`plus`), so
    a burst placed between two reports spreads out instead of piling onto the rank that looked least loaded.
    """

    def __init__(self, world: int):
        self.reported = [RankLoad()] * world  # the latest reports, one per rank
        self.unreported = [0] * world  # prompt tokens placed on each rank since its report

    def report(self, loads: list[RankLoad], placed_before: list[int]) -> None:
        """New reports; `placed_before`: prompt tokens per rank placed after the reports were taken (the adds
        sent in the same step message as the reports, which the ranks apply after reporting)."""
        self.reported, self.unreported = list(loads), list(placed_before)

    def load(self, rank: int) -> RankLoad:
        return self.reported[rank].plus(self.unreported[rank])

    def choose(self, prompt_tokens: int) -> int:
        loads = [self.load(r) for r in range(len(self.reported))]
        fits = [r for r, ld in enumerate(loads) if ld.cache_free_tokens >= prompt_tokens]
        if not fits:
            return min(range(len(loads)), key=lambda r: (-loads[r].cache_free_tokens, r))
        return min(fits, key=lambda r: (loads[r].tokens_in_flight, -loads[r].cache_free_tokens, r))

    def place(self, prompt_tokens: int) -> int:
        rank = self.choose(prompt_tokens)
        self.unreported[rank] += prompt_tokens
        return rank


def prefill_cap(loads: list[RankLoad], min_chunk: int) -> int | None:
    """The most prompt tokens any rank prefills in the coming lock step (None: no cap).

    Ranks step together, so a step lasts as long as the busiest rank's. When every rank with work has prompt
    tokens to prefill, full chunks everywhere keep the ranks even: no cap. When some rank only decodes, a full
    prefill chunk on another rank would make that rank's decodes wait for it every step; so the prefilling
    ranks' chunks are cut to the largest decode batch of a rank that only decodes (its step's size), but never
    below `min_chunk` tokens, so that prompts keep moving (the idea: a step of a few hundred tokens costs not much
    more than a decode step on a GPU; not measured yet). Every rank computes this from the same reports, so they
    agree.
    """
    decode_only = [ld.decode_seqs for ld in loads if ld.decode_seqs and not ld.prefill_tokens]
    if not decode_only or not any(ld.prefill_tokens for ld in loads):
        return None
    return max(min_chunk, max(decode_only))
