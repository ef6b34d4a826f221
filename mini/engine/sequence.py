"""A request's life in the engine: sampling parameters, token history, cache placement, detokenized text.

A Sequence is the scheduler's unit. Its token history is `prompt_token_ids + output_token_ids`;
`num_computed` of those are already in the cache (prefill chunks advance it by the chunk length, a decode by one).
After a preemption by recompute the whole history is fed again as a prompt, so `num_computed` simply resets to 0.

With overlapped decode steps (see mini.engine.llm) a sampled token may still be on the device when the next step
is planned: `num_inflight` counts those tokens. They are part of `num_tokens` (what the scheduler plans with) but
not yet of `output_token_ids` (what stop checks, outputs and block hashes read).
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mini.step import ImageSpan

if TYPE_CHECKING:
    from mini.engine.speculative import DraftRecord


@dataclass
class SamplingParams:
    """vLLM's names and defaults. `temperature == 0` is greedy."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: until the context is full
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs per token (0: only the sampled token's)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    grammar: str | None = None  # llguidance Lark grammar the output must follow (mini.engine.structured)
    share_prompt: bool = False  # other requests will take this prompt from the prefix cache (n > 1): end its
    # prefill with a snapshot at the prompt's last block boundary (see mini.engine.scheduler)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens (vLLM's min_tokens)
    skip_special_tokens: bool = True  # the text leaves out BOS / EOS / pad (role and think markers always stay)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    @property
    def penalized(self) -> bool:
        """Sampling reads the token history (penalties), so every earlier token must be known on the host."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the server turns it into an HTTP 400)."""
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)
        need(math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        need(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        need(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(0 < self.repetition_penalty <= 10 and math.isfinite(self.repetition_penalty),
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        need(self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids >= 0")
        need(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        need(all(isinstance(t, int) and t >= 0 and isinstance(v, (int, float)) and -100 <= v <= 100
                 for t, v in (self.logit_bias or {}).items()),
             "logit_bias maps token ids >= 0 to values in [-100, 100]")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives (token id -> logprob), from the raw logits."""
    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampler's per-request seed (params.seed, or drawn by the engine)
    eos_token_id: int | None = None
    max_total_tokens: int = 1 << 30  # model context
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens of the history already in the cache
    num_cached_prefix: int = 0  # of those, tokens taken from the prefix cache (last admission)
    split_at: int = 0  # end a prefill chunk at this block boundary (a snapshot there would be reused)
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache keys of the full blocks computed so far
    slot: int = -1
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    detok: object | None = None  # incremental detokenizer (mini.tokenizer.StreamDecoder: push / flush)
    decoded: str = ""  # all output text decoded so far
    text: str = ""  # output text with stop strings handled (what the user gets)
    emitted_chars: int = 0  # how much of `text` was already streamed
    num_inflight: int = 0  # sampled tokens not yet read back from the device (overlapped steps)
    matcher: object | None = None  # grammar state (llguidance matcher) when params.grammar is set
    draft: list[int] = field(default_factory=list)  # speculative decoding: tokens proposed after the last one
    draft_forced: bool = False  # the draft is a grammar's forced tokens, not the drafter's (speculative.force)
    draft_record: DraftRecord | None = None  # how often the drafter's drafts were accepted (made at its first)
    images: list[ImageSpan] = field(default_factory=list)  # the prompt's image spans, in order (mini.step)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """History length, tokens in flight included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, in flight included (the sampler's counter for the next draw)."""
        return len(self.output_token_ids) + self.num_inflight

    def at_length_limit(self, count_inflight: bool = False) -> bool:
        """The one "finished by length" rule: max_tokens output tokens, or the context (max_total_tokens) full.
        `count_inflight`: count the tokens still in flight too (see `length_capped`)."""
        p, n_out = self.params, len(self.output_token_ids) + (self.num_inflight if count_inflight else 0)
        return (p.max_tokens is not None and n_out >= p.max_tokens) \
            or len(self.prompt_token_ids) + n_out >= self.max_total_tokens

    @property
    def length_capped(self) -> bool:
        """max_tokens or the context is reached (by a token in flight, when overlapped): no step may follow."""
        return self.at_length_limit(count_inflight=True)

    @property
    def num_pending(self) -> int:
        """Tokens of the history not yet in the cache (a decode has exactly one: the last sampled token)."""
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_pending > 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()
