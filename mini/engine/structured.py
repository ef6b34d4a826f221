"""Grammar-constrained decoding (structured outputs, forced tool calls) with llguidance.

A request's `SamplingParams.grammar` is an llguidance grammar in its Lark syntax (JSON schemas go in as
`%json {...}`; mini.server.grammars builds them). Its Sequence holds a matcher: the matcher consumes every token
appended to the output (LLMEngine._fetch, `advance`) and gives, before each draw, the bitmask of the tokens that keep
the output in the grammar. The sampler sets the other logits to -inf (mini.engine.sampler.sample), so the draw
itself, greedy or seeded, is unchanged among the allowed tokens.

Where the host time goes. A step's masks are a `MaskJob`: started once the step's forward is launched and its rows'
previous tokens are consumed, finished (`MaskJob.result`) just before the step's sampling is enqueued. With
overlapped steps the job runs in the background: one worker thread calls llguidance's parallel fill (its own thread
pool, the GIL released), while the engine's thread does the bookkeeping of the step read back (detokenizing, stop
checks, outputs); only what is left of the fill when that is done waits (docs/design.md, "Structured outputs").
`timings` (a list, when set) records each job's `MaskTiming`: the benchmark's host and exposed mask time.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass

import torch


COMPILED_KEPT = 64  # compiled grammars kept for `GrammarBackend.matcher` (the most recently used)


@dataclass
class MaskTiming:
    """Host seconds of one step's masks. `consume_s` + `fill_s` is the work; `exposed_s` is what the engine's
    thread spent on it (the consume, starting and finishing the job, waiting for the fill): its critical path."""
    rows: int  # rows with a grammar
    consume_s: float  # the matchers consume the tokens read back since the previous mask (engine's thread)
    fill_s: float  # llguidance's fill (the worker thread when in the background)
    exposed_s: float
    background: bool


class GrammarBackend:
    """The tokenizer as llguidance sees it (built once), a thread pool for the batch's masks, and the worker thread
    that runs a background fill."""

    def __init__(self, tokenizer, vocab_size: int, threads: int | None = None):
        import llguidance
        self._ll = llguidance
        backend = getattr(tokenizer, "backend", None)
        if backend is None:
            raise ValueError("structured outputs need the model's tokenizer.json")
        self.vocab_size = vocab_size
        self.eos_id = tokenizer.eos_id
        self.tokenizer = llguidance.LLTokenizer(grammar_vocabulary(backend.to_str()), n_vocab=vocab_size,
                                                eos_token=tokenizer.eos_id)
        # a batch's masks in parallel (llguidance drops the GIL): half the cores, at most 8
        self.executor = llguidance.LLExecutor(threads or max(1, min(8, (os.cpu_count() or 2) // 2)))
        self.words = (vocab_size + 31) // 32
        self.timings: list[MaskTiming] | None = None  # a list: each job appends its MaskTiming
        self.background = True  # False: every fill on the engine's thread (the benchmark's comparison)
        self._consume_s = 0.0  # consumed since the last job started
        self._jobs: queue.SimpleQueue | None = None  # the worker's inbox (made with the worker, on first use)
        self._compiled: dict[str, object] = {}  # grammar text -> its matcher in the start state, oldest use first
        self._compiled_lock = threading.Lock()  # check runs on request threads, matcher on the engine's

    def check(self, grammar: str) -> None:
        """Raise ValueError with llguidance's message if the grammar does not compile against the vocabulary. Run
        where a request is validated (the server's worker thread): the compiled grammar is kept for `matcher`."""
        self._compiled_matcher(grammar)

    def matcher(self, grammar: str):
        """A fresh matcher: a copy (~1 µs) of the grammar's compiled one, so the engine's thread does not compile
        (~1 ms for a chat request's tools grammar) a grammar `check` has seen, nor one it has seen recently:
        agents send the same tools every turn."""
        return self._compiled_matcher(grammar).deep_copy()

    def _compiled_matcher(self, grammar: str):
        """The grammar's matcher in its start state, never advanced (only copied); the last COMPILED_KEPT kept."""
        with self._compiled_lock:
            m = self._compiled.pop(grammar, None)
            if m is not None:
                self._compiled[grammar] = m  # now the most recent
                return m
        m = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"the grammar cannot be used: {m.get_error()}")
        with self._compiled_lock:
            self._compiled[grammar] = m
            while len(self._compiled) > COMPILED_KEPT:
                del self._compiled[next(iter(self._compiled))]
        return m

    def advance(self, pairs: list[tuple[object, int]]) -> None:
        """Each matcher consumes its sampled token. A token the mask did not allow (only EOS after the end) puts the
        matcher in its error state, where its mask allows only EOS: never an exception in the engine loop."""
        t = time.perf_counter()
        for matcher, token in pairs:
            if not matcher.is_stopped():
                matcher.consume_token(token)
        self._consume_s += time.perf_counter() - t

    def forced(self, matcher, limit: int) -> list[int]:
        """The next tokens the grammar forces after what `matcher` consumed (llguidance's fast-forward tokens: the
        tokenization of the bytes no other output could continue with, e.g. DSML markup or a JSON key), at most
        `limit`; none once the matcher stopped or failed. They become certain drafts (mini.engine.speculative):
        verified, never taken on trust, so a forced token the mask does not make the only choice (the forced text
        split another way is allowed too) is accepted only where the target draws it."""
        if limit <= 0 or matcher.is_stopped() or matcher.is_error():
            return []
        t = time.perf_counter()
        tokens = matcher.compute_ff_tokens()[:limit]
        self._consume_s += time.perf_counter() - t
        return tokens

    def start(self, matchers: list, device, background: bool = False) -> "MaskJob | None":
        """Start filling the bitmask of a batch's rows (`matchers[i]`: row i's, or None); None when no row has one.
        `background`: fill on the worker thread (the matchers must not be touched until `result`)."""
        if all(m is None for m in matchers):
            return None
        return MaskJob(self, matchers, device, background)

    def bitmask(self, matchers: list, device) -> torch.Tensor | None:
        """int32 [n, words] on `device`: bit t of row i set = token t allowed for row i (all set for rows with no
        matcher); None when no row has one. Filled now, on this thread."""
        job = self.start(matchers, device)
        return None if job is None else job.result()

    def _submit(self, job: "MaskJob") -> None:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_worker, args=(self._jobs,), name="mini-grammar-masks", daemon=True).start()
        self._jobs.put(job)
        # Hand the GIL over until the fill is under way: else the worker, woken while this thread runs Python,
        # may wait a whole switch interval (5 ms) before it can start the fill.
        job.started.wait()


def grammar_vocabulary(tokenizer_json: str) -> str:
    """The tokenizer as llguidance must read it. llguidance takes every added token for a special one, which no
    grammar text matches; V4.1's `</think>` (and `<think>`, the role markers) are added but not special: the model
    ends its reasoning with that one token, which a thinking-mode grammar's `</think>` must allow (else the mask
    forbids it and the reasoning never ends). So non-special added tokens of a byte-level BPE become the plain
    vocabulary entries they are (their text in the byte-level alphabet, same id); special ones stay special."""
    import json

    from mini.tokenizer import _byte_chars
    data = json.loads(tokenizer_json)
    model, decoder = data.get("model") or {}, data.get("decoder") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict) or decoder.get("type") != "ByteLevel":
        return tokenizer_json
    chars, vocab, kept = _byte_chars(), model["vocab"], []
    key_of = {i: key for key, i in vocab.items()}  # a vocabulary may also list an added token under its raw text
    for tok in data.get("added_tokens") or []:
        text = "".join(chars[b] for b in tok["content"].encode("utf-8"))
        if tok.get("special") or vocab.get(text, tok["id"]) != tok["id"]:  # special, or its text is another token
            kept.append(tok)
            continue
        vocab.pop(key_of.get(tok["id"]), None)
        vocab[text] = tok["id"]
    data["added_tokens"] = kept
    return json.dumps(data, ensure_ascii=False)


def _worker(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        job.started.set()
        job.fill()
        job.done.set()


class MaskJob:
    """One step's bitmask: a pinned host buffer being filled (here, or on the worker thread), uploaded by `result`."""

    def __init__(self, backend: GrammarBackend, matchers: list, device, background: bool):
        t0 = time.perf_counter()
        self.backend, self.device = backend, torch.device(device)
        n = len(matchers)
        # pinned on CUDA, so that the upload does not wait for the step in flight; torch's caching host allocator
        # reuses a block only once the copies that read it are done
        self.mask = torch.empty((n, backend.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.mask.fill_(-1)
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        self.live = [(m, i) for m, i in rows if not (m.is_stopped() or m.is_error())]
        self.ended = [i for m, i in rows if m.is_stopped() or m.is_error()]
        self.fill_s, self.error = 0.0, None
        self.started, self.done = threading.Event(), threading.Event()
        self.background = background and backend.background and bool(self.live)
        consume_s, backend._consume_s = backend._consume_s, 0.0
        self._timing = MaskTiming(len(rows), consume_s, 0.0, consume_s, self.background)
        if self.background:
            backend._submit(self)
        else:
            self.fill()
            self.done.set()
        self._timing.exposed_s += time.perf_counter() - t0

    def fill(self) -> None:
        """llguidance's parallel fill of the live rows (the GIL is released inside)."""
        t = time.perf_counter()
        try:
            if self.live:
                self.backend.executor.unsafe_compute_mask_ptr(self.live, self.mask.data_ptr(), self.backend.words * 4,
                                                              self.mask.shape[0])
        except BaseException as e:  # raised again on the engine's thread, by `result`
            self.error = e
        self.fill_s = time.perf_counter() - t

    def result(self) -> torch.Tensor:
        """Wait for the fill; the bitmask on the device. Rows whose matcher has finished or failed, or whose mask
        came out empty, allow only EOS (never an all -inf row)."""
        t0 = time.perf_counter()
        self.done.wait()
        if self.error is not None:
            raise self.error
        mask = self.mask
        eos_only = self.ended + (torch.nonzero(~mask.any(1)).flatten().tolist() if self.live else [])
        if eos_only:
            eos = self.backend.eos_id
            bit = eos % 32
            mask[eos_only] = 0
            mask[eos_only, eos // 32] = 1 << bit if bit < 31 else -(1 << 31)  # int32 bits
        out = mask.to(self.device, non_blocking=True) if self.device.type == "cuda" else mask.to(self.device)
        t = self._timing
        t.fill_s = self.fill_s
        t.exposed_s += time.perf_counter() - t0
        if self.backend.timings is not None:
            self.backend.timings.append(t)
        return out
