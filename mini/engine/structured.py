"""Grammar-constrained decoding (structured outputs, forced tool calls) with llguidance.

A request's `SamplingParams.grammar` is an llguidance grammar in its Lark syntax (JSON schemas go in as
`%json {...}`; mini.server.grammars builds them). Its Sequence holds a matcher: the matcher consumes every token
appended to the output (LLMEngine._fetch) and gives, before each draw, the bitmask of the tokens that keep the
output in the grammar. The sampler sets the other logits to -inf (mini.engine.sampler.sample), so the draw itself,
greedy or seeded, is unchanged among the allowed tokens.

Masks are computed on the host, after the step's forward is launched: with overlapped decode steps that is while
step N+1's forward runs on the device, once step N's tokens are read back (see LLMEngine._launch). Why llguidance
rather than xgrammar, and what it costs: docs/design.md, "Structured outputs".
"""
from __future__ import annotations

import os

import torch

from mini.engine.sampler import to_device

class GrammarBackend:
    """The tokenizer as llguidance sees it (built once) and a thread pool for the batch's masks."""

    def __init__(self, tokenizer, vocab_size: int, threads: int | None = None):
        import llguidance
        self._ll = llguidance
        backend = getattr(tokenizer, "backend", None)
        if backend is None:
            raise ValueError("structured outputs need the model's tokenizer.json")
        self.vocab_size = vocab_size
        self.eos_id = tokenizer.eos_id
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_id)
        # a batch's masks in parallel (llguidance drops the GIL): half the cores, at most 8
        self.executor = llguidance.LLExecutor(threads or max(1, min(8, (os.cpu_count() or 2) // 2)))
        self.words = (vocab_size + 31) // 32

    def check(self, grammar: str) -> None:
        """Raise ValueError with llguidance's message if the grammar does not compile against the vocabulary."""
        is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"the grammar cannot be used: {messages[0] if messages else 'invalid'}")

    def matcher(self, grammar: str):
        m = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"the grammar cannot be used: {m.get_error()}")
        return m

    @staticmethod
    def consume(matcher, token: int) -> None:
        """Advance past a sampled token. A token the mask did not allow (only EOS after the end) puts the matcher
        in its error state, where its mask allows only EOS: never an exception in the engine loop."""
        if not matcher.is_stopped():
            matcher.consume_token(token)

    def bitmask(self, matchers: list, device) -> torch.Tensor | None:
        """int32 [n, words] on `device`: bit t of row i set = token t allowed for row i (all set for rows with no
        matcher); None when no row has one."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        mask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        live = [(m, i) for m, i in rows if not (m.is_stopped() or m.is_error())]
        if live:
            self.executor.unsafe_compute_mask_ptr(live, mask.data_ptr(), self.words * 4, len(matchers))
        for m, i in rows:
            if m.is_stopped() or m.is_error() or not bool(mask[i].any()):
                bit = self.eos_id % 32
                mask[i] = 0
                mask[i, self.eos_id // 32] = 1 << bit if bit < 31 else -(1 << 31)  # int32 bits
        return to_device(mask, device)
