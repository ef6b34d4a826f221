"""A test-only drafter (mini.step.Drafter) that knows the answer: it proposes each sequence's continuation from a
plain run (`futures`, by prompt), wrong at the position `plan` names for each proposal in turn, so a test reaches
every accept length 0..K, and each cache edge they cross, and compares speculation with plain decode bit for bit
(tests/engine/test_speculative.py and the graphs' tests; tests/fuzz/test_fuzz_speculative.py on random configs)."""
from __future__ import annotations


class OracleDrafter:
    """Proposes the plain run's continuation of each prompt, with one token changed at the position `plan` names
    for each proposal in turn (a position >= the draft's length: the whole draft is right)."""

    min_confidence = 0.0  # (no confidence: ignored)

    def __init__(self, futures: dict[tuple, list[int]], plan: list[int], vocab: int, max_draft: int = 5):
        # max_draft: the longest draft it offers (the engine's spec_tokens default); 5, DSpark's block, unless given
        self.futures, self.plan, self.vocab, self.max_draft = futures, plan, vocab, max_draft
        self.proposals = 0

    def propose(self, cache, commits):
        drafts = []
        for c in commits:
            if c.anchor is None or c.max_draft == 0:
                drafts.append([])
                continue
            history = c.history()
            prompt = next(p for p in self.futures if tuple(history[:len(p)]) == p)
            n = len(history) - len(prompt)  # the next output index
            draft = (self.futures[prompt][n:] + [0] * c.max_draft)[:c.max_draft]
            wrong = self.plan[self.proposals % len(self.plan)]
            self.proposals += 1
            if wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % self.vocab
            drafts.append(draft)
        return drafts

    def static_draft(self, static, cache):
        return None  # drafts on the host only (`propose`)
