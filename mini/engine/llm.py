"""The engine core (one `step()` = schedule, forward, sample, stop checks) and the offline `LLM` front end.

Overlapped decode steps (`EngineOptions.overlap`; default: on where CUDA graphs are used). A pure-decode step
without penalties is launched and left in flight: its sampled ids stay on the device, and `step()` returns. The
next `step()` plans and prepares step N+1 while step N runs, launches it with step N's ids fed on the device
(mini.step.TokenFeed), and only then reads step N's ids back and does its bookkeeping (append, stop checks,
detokenize, outputs) while step N+1 runs. Outputs lag one step; tokens are those of the plain engine (bit for bit
in the deterministic mode; in the default mode a row's bits depend on its step's row count, below):

* A sequence whose step-N token ends it is still in step N+1; that extra token is discarded, never emitted, and
  its slot and blocks are returned only once step N+1 has been read back (the device may still write them). So
  step N+1 can have a row more than the plain engine's, which the default mode's kernels may see (one row and
  2-16 read the weights differently, docs/kernels.md).
  Length limits are known without the token, so such a sequence is not planned again (Sequence.length_capped).
* A step that is not pure decode, or samples with penalties (they read the whole history), first reads back the
  step in flight, then runs as the plain engine does, without the sequences that just finished.
* A model whose static decode step needs a fed token on the host before the launch (mini.model.static_decode)
  calls `TokenFeed.fetch` itself, after every other input is copied: step N's ids are read back then (a wait for
  the device); the bookkeeping still overlaps step N+1. The eager forward (CPU, tests) reads them back before
  building its batch.
* Speculating, a step is a verify step (`Speculation.verifies`: a chunk carries drafts, or a sequence will draft
  on the step's token) and reads back the step in flight first; every other step is plain decode's, overlapped as
  above, and the drafter takes its rows into its state after the launch (`Speculation.plain_step`; on CUDA graphs
  the decode step's own graph has written them).
* A sequence preempted while its token is in flight gets that token when it is read back (it is part of the
  history to recompute); its blocks are reused at once, which is safe because every device write (replays,
  eager forwards, slot copies, input copies) is ordered on the one stream after the step in flight.
"""
from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field, fields, replace

import torch

from mini.engine.block_manager import BlockManager, PrefixCacheStats
from mini.engine.model_runner import ForwardTiming, ModelRunner, size_cache
from mini.engine.cuda_graphs import is_decode_step
from mini.engine.sampler import SampleOutput, SamplingBatch, sample
from mini.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from mini.engine.sequence import SamplingParams, Sequence, TokenLogprobs
from mini.engine.speculative import FORCED_DRAFT, Speculation, SpecStats
from mini.step import Drafter, ImageSpan, StepModel, TokenFeed


@dataclass
class EngineOptions:
    device: str | None = None  # default: cuda when available
    dtype: torch.dtype = torch.bfloat16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_tokens: int = 128
    num_blocks: int | None = None  # None: sized from memory (see model_runner.size_cache)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_snapshots: int = 32  # spare state slots holding prefix-cache snapshots
    snapshot_prompt_end: bool = False  # see scheduler: trade one step of TTFT for hits on a prompt's first repeat
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0  # seeds of requests that do not bring their own
    enforce_eager: bool = False  # no CUDA graphs for decode steps (they are used on CUDA with the fast backend)
    overlap: bool | None = None  # overlapped decode steps (see the module doc); None: on where graphs are used
    deterministic: bool = False  # a request's output does not depend on its batch (docs/design.md, Determinism)
    speculative: str | None = None  # "dspark": the model's own drafter proposes, each step verifies (speculative.py)
    spec_tokens: int | None = None  # the longest draft (None: the drafter's own, DSpark's block size)
    spec_min_confidence: float = 0.0  # drafts stop at the first token the drafter is less sure of (0: never)
    spec_max_rows: int | None = 384  # a step's verify rows, (1 + k) per decoding sequence, at most (None: no cap)
    spec_adaptive: bool = True  # each sequence drafts as long as its past acceptance pays (speculative.py)
    forced_drafts: bool = True  # tokens a grammar forces are drafts, verified in one step (speculative.py)

    @classmethod
    def pick(cls, opts: dict) -> tuple["EngineOptions", dict]:
        """Split keyword options into engine options and the rest."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in opts.items() if k in names}), {k: v for k, v in opts.items() if k not in names}


def deterministic_options(o: EngineOptions) -> EngineOptions:
    """EngineOptions.deterministic: prefix caching off, saying so: a hit starts a prompt's computation at a cached
    block boundary, a chunking the miss did not have (the scheduler's deterministic chunks are fixed per prompt only
    without it). The kernels' mode is the engine's context (`LLMEngine.mode`)."""
    import warnings

    if o.enable_prefix_caching:
        warnings.warn("deterministic mode: prefix caching is off (a cache hit would change a prompt's chunking)",
                      stacklevel=3)
    return replace(o, enable_prefix_caching=False, snapshot_prompt_end=False)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop strings removed)
    new_token_ids: list[int]  # since the previous output of this request
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # all output tokens so far (when asked)
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None


class StepOutputs(list):
    """What `step()` returns: its RequestOutputs (a list), and whether it ran a forward (`forward`). A step that
    only flushed aborts or read back the step in flight runs none; a data-parallel rank then still joins the
    other ranks' MoE layers with an empty batch (mini.parallel)."""

    def __init__(self, outputs=(), forward: bool = False):
        super().__init__(outputs)
        self.forward = forward


@dataclass
class StepTimes:
    """Where one step's time went (LLMEngine.step_times): host seconds per phase, the forward's GPU span."""
    n_seqs: int
    decode: bool  # every chunk was one decode token
    graph: bool  # the forward was a CUDA-graph replay
    schedule_s: float
    prepare_s: float  # input preparation (ModelRunner.run)
    forward_s: float  # host time of the forward call: kernel launches or one replay
    sample_s: float  # after the forward call: sampling, block commits, reading back and the bookkeeping of this
    # step or (overlapped) of the previous one, including the wait for it
    total_s: float
    gpu_s: float | None  # CUDA events around the forward
    started: float = 0.0  # perf_counter at the start of the step() call (spacing of steps: their period)


@dataclass(eq=False)
class _Launched:
    """A step whose forward is enqueued, and its sampling (`pending` until `_sample`: grammar masks filled in the
    background); `_fetch` reads its sampled ids back."""
    seqs: list[Sequence]  # those that sample, in row order
    out: SampleOutput | None  # on the device (None: nothing samples)
    host: SampleOutput | None  # copies on the host, valid once `ready` has passed
    ready: torch.cuda.Event | None  # recorded after the copies (None: already on the host)
    timing: ForwardTiming | None  # when timed
    ids: list[int] = field(default_factory=list)  # the sampled ids on the host (set by _fetch)
    kept: list[tuple[int, Sequence]] | None = None  # rows whose token was appended (set by _fetch)
    release_after: list[Sequence] = field(default_factory=list)  # finished while this step was in flight
    times: StepTimes | None = None  # host phases of the call that launched it; gpu_s filled when read back
    pending: tuple | None = None  # (logits, SamplingBatch, grammar MaskJob or None) until `_sample` enqueues it


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # tokens computed in prefill chunks
    decode_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    overlapped_steps: int = 0  # steps left in flight (the module doc)
    capped_steps: int = 0  # steps whose token budget a prefill cap cut (`step(prefill_cap=)`)
    # step() calls that ran a forward and the host seconds they took, by kind (`step_kind`): with overlap a call's
    # time is about one step's period, so these say where the engine's time went (speculation against plain decode)
    kind_steps: dict[str, int] = field(default_factory=dict)
    kind_seconds: dict[str, float] = field(default_factory=dict)
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding's drafted / accepted tokens


STEP_KINDS = ("prefill", "decode", "verify")


def step_kind(chunks, verifying: bool) -> str:
    """A step's kind for EngineStats: "verify" (speculation's verify step, prefill chunks with it or not),
    "prefill" (a prompt chunk in it), else "decode"."""
    return "verify" if verifying else "decode" if all(c.is_decode for c in chunks) else "prefill"


@dataclass(frozen=True)
class EngineLoad:
    """The engine's work at the start of a step (LLMEngine.load), for placing requests across engines."""
    prefill_tokens: int  # prompt (history) tokens not yet in the cache: waiting + running in prefill
    decode_tokens: int  # context (tokens in the cache) of the sequences that decode
    decode_seqs: int  # sequences that decode (one token each per step)
    cache_free_tokens: int  # free cache blocks x block tokens


class LLMEngine:
    """Synchronous core. Not thread-safe: one thread calls add_request / abort / step (see async_engine)."""

    def __init__(self, model: StepModel, config, tokenizer, options: EngineOptions, drafter: Drafter | None = None):
        """`drafter`: speculate with this drafter (tests); `options.speculative` "dspark" takes the model's own."""
        o = deterministic_options(options) if options.deterministic else options
        drafter = drafter or _model_drafter(model, o.speculative)
        if drafter is not None:
            drafter.min_confidence = o.spec_min_confidence
        self.options, self.config, self.tokenizer = o, config, tokenizer
        # the kernels' deterministic mode, entered before any CUDA graph is captured and held while the engine
        # lives (the mode is process-wide: ops read it); `close()` leaves it, restoring the mode found
        self.mode = contextlib.ExitStack()
        if o.deterministic:
            import mini.ops
            self.mode.enter_context(mini.ops.deterministic_mode())
        device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
        shape = size_cache(model, device, o.dtype, o.block_tokens, o.max_num_seqs,
                           o.num_snapshots if o.enable_prefix_caching else 0, o.num_blocks, o.gpu_memory_utilization,
                           o.max_model_len or config.max_position_embeddings)
        self.max_model_len = min(o.max_model_len or config.max_position_embeddings,
                                 shape.n_blocks * o.block_tokens)
        self.model = model
        # speculation: verify steps replay graphs of up to 1 + K rows per sequence (mini.engine.cuda_graphs)
        spec_tokens = (o.spec_tokens or drafter.max_draft) if drafter is not None else 0
        self.runner = ModelRunner(model, config, shape, device, o.dtype, enforce_eager=o.enforce_eager,
                                  max_model_len=self.max_model_len, max_rows=1 + spec_tokens,
                                  verify_rows=o.spec_max_rows, drafter=drafter)
        self.blocks = BlockManager(shape.n_blocks, o.block_tokens, o.max_num_seqs, shape.n_snapshots,
                                   o.enable_prefix_caching)
        chunk = SchedulerConfig.deterministic_chunk(o.max_num_seqs, o.max_num_batched_tokens) if o.deterministic else 0
        self.scheduler = Scheduler(SchedulerConfig(o.max_num_seqs, o.max_num_batched_tokens, o.snapshot_prompt_end,
                                                   chunk), self.blocks)
        self.step_times: list[StepTimes] | None = None  # a list: step() appends each step's StepTimes
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.warmup_s: float | None = None  # how long the serving warm-up took (`warmed_up`); None: not warmed up
        self._rng = random.Random(o.seed)
        self._aborted: list[Sequence] = []
        # off by default on CPU, where nothing runs asynchronously (tests turn it on)
        self.overlap = o.overlap if o.overlap is not None else (self.runner.graphs is not None
                                                                and self.runner.device.type == "cuda")
        self._inflight: _Launched | None = None  # an overlapped step not read back yet
        self.spec = None if drafter is None else Speculation(self, drafter, o.spec_tokens or drafter.max_draft,
                                                             o.spec_max_rows, forced=o.forced_drafts,
                                                             adaptive=o.spec_adaptive)
        # the verify step: speculation's, or without it one for the drafts of forced tokens alone
        self.verify = self.spec or (Speculation(self, None, FORCED_DRAFT, o.spec_max_rows) if o.forced_drafts
                                    else None)
        self._grammars = None  # see `grammars`

    # ------------------------------------------------------------------ what serving over several engines needs
    @property
    def decode_graphs(self) -> bool:
        """Pure-decode steps replay CUDA graphs (mini.engine.cuda_graphs)."""
        return self.runner.graphs is not None

    def decode_bucket(self, n_seqs: int) -> int:
        """The graph bucket a decode step of `n_seqs` sequences replays (needs `decode_graphs`)."""
        return self.runner.graphs.bucket(n_seqs)

    @torch.inference_mode()
    def replay_padding(self, bucket: int) -> None:
        """Replay the decode graph of `bucket` with padding rows only: writes nothing a sequence reads (a
        data-parallel rank without tokens of its own joins the other ranks' step, mini.parallel)."""
        self.runner.graphs.replay_padding(bucket)

    def load(self) -> EngineLoad:
        """What is queued and running now, and the free cache."""
        sched, blocks = self.scheduler, self.blocks
        decoding = [s for s in sched.running if not s.in_prefill]
        return EngineLoad(prefill_tokens=sum(s.num_pending for s in sched.waiting)
                          + sum(s.num_pending for s in sched.running if s.in_prefill),
                          decode_tokens=sum(s.num_computed for s in decoding), decode_seqs=len(decoding),
                          cache_free_tokens=blocks.n_free_blocks * blocks.block_tokens)

    def limit_context(self, tokens: int) -> None:
        """Admit only requests within `tokens` of context (at most the engine's own): engines whose pools were
        sized from free memory then take the same prompts (data-parallel ranks agree on the smallest)."""
        self.max_model_len = min(self.max_model_len, tokens)

    def reset_stats(self) -> None:
        """Counters (EngineStats, the prefix cache's) back to zero."""
        self.stats = EngineStats()
        self.blocks.stats = PrefixCacheStats()

    def warmed_up(self, seconds: float) -> None:
        """The serving warm-up ran (mini.engine.warmup) in `seconds`: its steps leave the counters. Its drafts'
        acceptance stays in speculation's engine-wide α (`Speculation.pool`): where they failed, the first
        requests draft nothing until a probe pays, instead of a round of full drafts beside the burst's prefill
        steps (docs/engine.md, "The draft length")."""
        self.warmup_s = seconds
        self.reset_stats()

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request cannot run (the server answers 400 with the message)."""
        if not ids:
            raise ValueError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this server's context is {self.max_model_len} "
                             "tokens (prompt + at least one output token)")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens {params.max_tokens} plus the prompt's {len(ids)} tokens exceeds this "
                             f"server's context of {self.max_model_len} tokens")
        if params.logit_bias and max(params.logit_bias) >= self.config.vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {self.config.vocab_size})")
        if params.grammar is not None:
            self.grammars.check(params.grammar)

    @property
    def grammars(self):
        """The grammar backend (mini.engine.structured), made on first use; ValueError without a tokenizer."""
        if self._grammars is None:
            from mini.engine.structured import GrammarBackend
            self._grammars = GrammarBackend(self.tokenizer, self.config.vocab_size)
        return self._grammars

    def check_images(self, ids: list[int], images: list[ImageSpan]) -> None:
        """Raise ValueError unless `images` are spans of the prompt `ids`, in order, apart, and the model reads
        images."""
        if images and not self.model.reads_images:
            raise ValueError("this model has no vision tower: it cannot read images")
        end = 0
        for k, span in enumerate(images):
            if span.length < 1 or span.start < end or span.end > len(ids):
                raise ValueError(f"image {k} at positions [{span.start}, {span.end}) is not a span of the prompt's "
                                 f"{len(ids)} tokens after the previous image")
            end = span.end

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    images: list[ImageSpan] | None = None) -> Sequence:
        """`images`: the prompt's image spans (its ids expanded, mini.model.image_input.PromptImages.spans)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids, images = self.encode(prompt), list(images or [])
        self.check_prompt(ids, params)
        self.check_images(ids, images)
        seq = Sequence(request_id, ids, params, seed=params.seed if params.seed is not None
                       else self._rng.getrandbits(62), eos_token_id=self.config.eos_id,
                       max_total_tokens=self.max_model_len, images=images)
        if self.tokenizer is not None:
            seq.detok = self.tokenizer.stream(skip_special_tokens=params.skip_special_tokens)
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        self._remove(seq)
        seq.finish("abort")
        self._aborted.append(seq)

    def close(self) -> None:
        """Leave the engine's kernel mode (`mode`: the deterministic mode it entered), restoring the mode found.
        The engine may not step afterwards in that mode; a process that serves until it ends need not call it."""
        self.mode.close()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted) or self._inflight is not None

    def _remove(self, seq: Sequence) -> None:
        """Out of the scheduler; its cache back now, or once the step in flight that computes it is read back; its
        images released where no other live sequence holds them."""
        later = self._inflight if seq.num_inflight else None
        self.scheduler.remove(seq, release=later is None)
        if later is not None:
            later.release_after.append(seq)
        if seq.images:  # a step in flight has its image rows already: the model may drop its own copy now
            held = {s.digest for r in self.requests.values() if r is not seq for s in r.images}
            gone = sorted({s.digest for s in seq.images} - held)
            if gone:
                self.model.release_images(gone)

    # ------------------------------------------------------------------ one step
    def step(self, prefill_cap: int | None = None) -> StepOutputs:
        """One step. `prefill_cap`: at most this many prompt tokens besides the decodes (None: the step's whole
        budget); the deterministic mode's chunks are fixed by the prompt, so it ignores the cap."""
        t0 = time.perf_counter()
        outputs = [self._output(s, []) for s in self._aborted]
        self._aborted = []
        if self.verify is not None and self.verify.forced:  # tokens grammars force become drafts before the plan
            if self._inflight is not None and self.verify.forcing(self._inflight.seqs):
                prev, self._inflight = self._inflight, None  # the tokens to draft after are those in flight
                outputs += self._resolve(prev)
            self.verify.force([s for s in self.scheduler.running if not s.in_prefill])
        if self.scheduler.config.chunk_tokens > 0:  # the deterministic mode's chunks are the prompt's: no cap
            prefill_cap = None
        plan = self.scheduler.schedule(self._budget(prefill_cap), prefill_cap)
        self.stats.preemptions += len(plan.preempted)
        verifying = self.verify is not None and self.verify.verifies(plan)
        prev, self._inflight = self._inflight, None
        overlap = self.overlap and not verifying and self._overlappable(plan.chunks)
        if prev is not None and not overlap:  # this step runs on known tokens: finish the one in flight first
            outputs += self._resolve(prev)
            prev = None
            plan.chunks = [c for c in plan.chunks if not c.seq.is_finished]
        if not plan.chunks:
            return StepOutputs(outputs, forward=False)
        self.stats.steps += 1
        self.runner.copy_slots(plan.restores)
        kind = step_kind(plan.chunks, verifying)
        if verifying:  # verify drafts, or take this step's tokens as anchors of drafts (mini.engine.speculative)
            outputs += self.verify.step(plan)
            self._count_step(kind, t0)
            return StepOutputs(outputs, forward=True)
        t1 = time.perf_counter()
        step = self._launch(plan.chunks, prev)
        if self.verify is not None:
            self.verify.plain_step(plan)
        t2 = time.perf_counter()
        if prev is not None:
            self._inflight = step  # where _remove defers the cache of sequences that finish now
            outputs += self._resolve(prev)
        # the computed blocks' hashes read tokens up to num_computed: all on the host now
        snapshots = [s for s in (self.blocks.commit(c.seq) for c in plan.chunks if not c.seq.is_finished)
                     if s is not None]
        self.runner.copy_slots(snapshots)
        self._sample(step)  # a step whose grammar masks were filled in the background meanwhile
        self._inflight = step if overlap else None
        self.stats.overlapped_steps += int(overlap)
        if not overlap:
            outputs += self._resolve(step)
        if self.step_times is not None:
            r, end = step.timing, time.perf_counter()
            step.times = StepTimes(len(plan.chunks), all(c.is_decode for c in plan.chunks), r.graph, t1 - t0,
                                   r.prepare_s, r.forward_s, end - t2, end - t0, None, t0)
            if not overlap:
                self._record(step)
        self._count_step(kind, t0)
        return StepOutputs(outputs, forward=True)

    def _count_step(self, kind: str, t0: float) -> None:
        st = self.stats
        st.kind_steps[kind] = st.kind_steps.get(kind, 0) + 1
        st.kind_seconds[kind] = st.kind_seconds.get(kind, 0.0) + time.perf_counter() - t0

    def _budget(self, prefill_cap: int | None) -> int:
        """The step's token budget: the configured one, or the decodes plus `prefill_cap` when that is less (the
        scheduler spends its budget on the decodes first)."""
        full = self.scheduler.config.max_num_batched_tokens
        if prefill_cap is None:
            return full
        decodes = sum(1 for s in self.scheduler.running if not s.in_prefill)
        budget = min(full, decodes + prefill_cap)
        self.stats.capped_steps += int(budget < full)
        return budget

    def _overlappable(self, chunks: list[ScheduledChunk]) -> bool:
        """The one place that decides: a step may be left in flight (and launched before the previous step is read
        back) when it is pure decode and no sequence samples with penalties."""
        return bool(chunks) and is_decode_step(chunks) and not any(c.seq.params.penalized for c in chunks)

    def _launch(self, chunks: list[ScheduledChunk], prev: _Launched | None) -> _Launched:
        """Forward and sample on the device; start copying the sampled ids to the host. `prev`: the step in flight,
        whose ids feed this step's rows on the device, or are read back where the runner needs them on the host."""
        feed = None
        if prev is not None and any(c.seq.num_inflight for c in chunks):
            row_of = {id(s): i for i, s in enumerate(prev.seqs)}
            feed = TokenFeed(prev.out.token_ids, [row_of[id(c.seq)] if c.seq.num_inflight else -1 for c in chunks],
                             lambda: self._fetch(prev))
        self.runner.timing = self.step_times is not None
        logits = self.runner.run(chunks, feed)
        for c in chunks:
            c.seq.num_computed = c.end
            if c.is_decode:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += c.length
        seqs = [c.seq for c in chunks if c.samples]
        if logits.shape[0] != len(seqs):  # a fetch changed what samples: never sample rows into the wrong sequences
            raise RuntimeError(f"{logits.shape[0]} logit rows for {len(seqs)} sampling sequences")
        step = _Launched(seqs, None, None, None, self.runner.last_timing if self.runner.timing else None)
        if seqs:
            masks = self._grammar_masks(seqs, prev, logits.device)
            batch = SamplingBatch.from_seqs(seqs, logits.shape[-1], logits.device)
            for s in seqs:
                s.num_inflight += 1  # the rows' tokens are in flight from now (see _remove)
            step.pending = (logits, batch, masks)
            if masks is None or not masks.background:
                self._sample(step)
        return step

    def _sample(self, step: _Launched) -> None:
        """Enqueue the step's sampling (its grammar rows' masks waited for first) and the copy of its ids to the
        host. A no-op once done."""
        if step.pending is None:
            return
        logits, batch, masks = step.pending
        step.pending = None
        if masks is not None:
            batch.allowed = masks.result()
        step.out = sample(logits, batch)
        step.host, step.ready = _copy_to_host(step.out)

    def _fetch(self, step: _Launched) -> list[int]:
        """Wait for the step's sampled ids, append them to their sequences' histories and return them (one per row
        of step.seqs). A sequence that finished meanwhile (its previous token ended it, or it was aborted) drops
        its token."""
        if step.kept is not None:
            return step.ids
        self._sample(step)  # (done by the step() that launched it; never read back a step not sampled)
        step.kept = []
        if step.out is None:
            return step.ids
        if step.ready is not None:
            step.ready.synchronize()
        ids = step.ids = step.host.token_ids.tolist()
        constrained = []
        for i, seq in enumerate(step.seqs):
            seq.num_inflight -= 1
            if not seq.is_finished:
                seq.output_token_ids.append(ids[i])
                if seq.matcher is not None:
                    constrained.append((seq.matcher, ids[i]))
                step.kept.append((i, seq))
        if constrained:
            self.grammars.advance(constrained)
        return ids

    def _grammar_masks(self, seqs: list[Sequence], prev: _Launched | None, device):
        """Start the bitmask of the rows with a grammar (a structured.MaskJob; None: no row has one). Called after
        the forward is launched: a row whose previous token is still in flight (overlapped steps) needs it first,
        so the step in flight is read back here, while this step's forward runs on the device. Overlapped (`prev`),
        the fill then runs in the background while `step` does the bookkeeping of the step read back, and `_sample`
        enqueues the sampling behind the forward once it is done (docs/design.md, "Structured outputs")."""
        if not any(s.matcher is not None for s in seqs):
            return None
        if prev is not None and any(s.matcher is not None and s.num_inflight for s in seqs):
            self._fetch(prev)
        return self.grammars.start([s.matcher for s in seqs], device, background=prev is not None)

    def _resolve(self, step: _Launched) -> list[RequestOutput]:
        """Read a launched step back: its tokens, stop checks and outputs. Gives back the cache of sequences that
        finished while it was in flight (it computed them)."""
        self._fetch(step)  # the device is done with the step once its ids are on the host
        for seq in step.release_after:
            self.blocks.release(seq)
        step.release_after = []
        if step.times is not None and self.step_times is not None:
            self._record(step)
        if not step.kept:
            return []
        h = step.host
        chosen_lp = h.logprobs.tolist() if h.logprobs is not None else None
        top_ids = h.top_ids.tolist() if h.top_ids is not None else None
        top_lp = h.top_logprobs.tolist() if h.top_logprobs is not None else None
        now = time.monotonic()
        results = []
        for i, seq in step.kept:
            token = seq.output_token_ids[-1]
            if seq.first_token_time is None:
                seq.first_token_time = now
            if chosen_lp is not None and seq.params.logprobs is not None:
                k = seq.params.logprobs
                top = dict(zip(top_ids[i][:k], top_lp[i][:k]))
                seq.output_logprobs.append(TokenLogprobs(token, chosen_lp[i], top))
            self._check_stop(seq, token)
            if seq.is_finished:
                self._remove(seq)
                self.requests.pop(seq.request_id, None)
            results.append(self._output(seq, [token]))
        return results

    def _record(self, step: _Launched) -> None:
        """Append the step's StepTimes (its GPU span is read now: the step is done or being waited for)."""
        t = step.times
        t.gpu_s = step.timing.gpu_s() if step.timing is not None else None
        self.step_times.append(t)
        step.times = None

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if not p.ignore_eos and token == seq.eos_token_id:
            self._finish(seq, "stop", None)  # the EOS / stop token's own text is not part of the output
            return
        if token in p.stop_token_ids:
            self._finish(seq, "stop", token)
            return
        if seq.detok is not None:
            seq.decoded += seq.detok.push(token)
            if p.stop and self._stop_string(seq):
                return
        if seq.at_length_limit():  # the tokens read back so far (one of a later step may be in flight)
            self._finish(seq, "length", None)
        elif seq.detok is not None:  # stream only text that can no longer become the start of a stop string
            hold = max((len(s) for s in p.stop), default=1) - 1
            seq.text = seq.decoded[:max(len(seq.decoded) - hold, seq.emitted_chars)]

    def _stop_string(self, seq: Sequence) -> bool:
        """Find the earliest stop string in the text; it may straddle any number of token boundaries."""
        text = seq.decoded
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, seq.emitted_chars - longest)
        hits = [(i, s) for s in seq.params.stop if (i := text.find(s, search_from)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        seq.finish("stop", s)
        seq.text = text[:i + len(s)] if seq.params.include_stop_str_in_output else text[:i]
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish(reason, stop_reason)
        if seq.detok is not None:
            seq.decoded += seq.detok.flush()
            seq.text = seq.decoded

    def _output(self, seq: Sequence, new_ids: list[int]) -> RequestOutput:
        new_text = seq.text[seq.emitted_chars:]
        seq.emitted_chars = len(seq.text)
        return RequestOutput(
            seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.text, new_ids, new_text,
            seq.is_finished, seq.finish_reason, seq.stop_reason,
            list(seq.output_logprobs), seq.num_cached_prefix, seq.arrival_time,
            seq.first_token_time, seq.finish_time)


def _model_drafter(model: StepModel, speculative: str | None) -> Drafter | None:
    """The drafter `EngineOptions.speculative` names: None, or "dspark" (the model's own draft module)."""
    if speculative is None:
        return None
    if speculative != "dspark":
        raise ValueError(f"speculative {speculative!r}: the one drafter is 'dspark'")
    if model.drafter is None:
        raise ValueError("--speculative dspark: this model has no DSpark draft module (mtp.* weights)")
    return model.drafter


def _copy_to_host(out: SampleOutput) -> tuple[SampleOutput, torch.cuda.Event | None]:
    """Start copying the sampled ids (and logprobs) to pinned host memory; the event says when they are there."""
    if out.token_ids.device.type != "cuda":
        return out, None

    def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.numel() == 0:  # nothing to copy (top_ids of logprobs=0 are [n, 0])
            return None if t is None else torch.empty(t.shape, dtype=t.dtype)
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    host = SampleOutput(*map(pinned, (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)))
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def build_engine(model_or_path, **opts) -> LLMEngine:
    """`model_or_path`: a checkpoint directory / preset name, or a loaded model (mini.model.Model or any
    mini.step.StepModel; then pass `config` and `tokenizer`). Other keyword options: EngineOptions
    fields."""
    options, rest = EngineOptions.pick(opts)
    if isinstance(model_or_path, str):
        from mini.model.load import load_model  # the factory: the engine's one import of the model package
        device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, config, tokenizer = load_model(model_or_path, device=device, dtype=options.dtype)
    else:
        model, config, tokenizer = model_or_path, rest.pop("config"), rest.pop("tokenizer", None)
    return LLMEngine(model, config, tokenizer, options, **rest)


class LLM:
    """Offline generation: `LLM("tiny-v4.1", num_blocks=64).generate(["hello"], SamplingParams(max_tokens=8))`."""

    def __init__(self, model_or_path, **opts):
        self.engine = build_engine(model_or_path, **opts)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 images: list[list[ImageSpan]] | None = None) -> list[RequestOutput]:
        """`prompts`: a string, a list of token ids, or a list of either. Outputs come back in prompt order.
        `images`: each prompt's image spans (mini.step.ImageSpan), its ids expanded."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        images = images if images is not None else [[]] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but images for {len(images)}")
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        params = sampling_params
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p, spans in zip(prompts, params, images):
            ids.append(f"offline-{self._next_id}")
            self._next_id += 1
            self.engine.add_request(ids[-1], prompt, p, spans)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            for o in self.engine.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]
