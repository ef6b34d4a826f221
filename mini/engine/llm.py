"""The engine core (one `step()` = schedule, forward, sample, stop checks) and the offline `LLM` front end."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, fields

import torch

from mini.engine.block_manager import BlockManager
from mini.engine.model_runner import ModelRunner, size_cache
from mini.engine.sampler import SamplingBatch, sample
from mini.engine.scheduler import Scheduler, SchedulerConfig
from mini.engine.sequence import SamplingParams, Sequence, TokenLogprobs


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

    @classmethod
    def pick(cls, opts: dict) -> tuple["EngineOptions", dict]:
        """Split keyword options into engine options and the rest."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in opts.items() if k in names}), {k: v for k, v in opts.items() if k not in names}


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


@dataclass
class StepTimes:
    """Where one step's time went (LLMEngine.step_times): host seconds per phase, the forward's GPU span."""
    n_seqs: int
    decode: bool  # every chunk was one decode token
    graph: bool  # the forward was a CUDA-graph replay
    schedule_s: float
    prepare_s: float  # input preparation (ModelRunner.run)
    forward_s: float  # host time of the forward call: kernel launches or one replay
    sample_s: float  # block commits, sampling, stop checks, outputs (includes waiting for the GPU to finish)
    total_s: float
    gpu_s: float | None  # CUDA events around the forward


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # tokens computed in prefill chunks
    decode_tokens: int = 0
    preemptions: int = 0
    steps: int = 0


class LLMEngine:
    """Synchronous core. Not thread-safe: one thread calls add_request / abort / step (see async_engine)."""

    def __init__(self, model, config, tokenizer, options: EngineOptions, batch_cls=None, cache_cls=None,
                 seq_chunk_cls=None):
        if batch_cls is None or cache_cls is None or seq_chunk_cls is None:
            from mini.model import Batch, KVCache, SeqChunk
            batch_cls, cache_cls, seq_chunk_cls = batch_cls or Batch, cache_cls or KVCache, seq_chunk_cls or SeqChunk
        o = options
        self.options, self.config, self.tokenizer = o, config, tokenizer
        device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
        shape = size_cache(cache_cls, config, device, o.dtype, o.block_tokens, o.max_num_seqs,
                           o.num_snapshots if o.enable_prefix_caching else 0, o.num_blocks, o.gpu_memory_utilization,
                           o.max_model_len or config.max_position_embeddings)
        self.max_model_len = min(o.max_model_len or config.max_position_embeddings,
                                 shape.n_blocks * o.block_tokens)
        self.runner = ModelRunner(model, config, shape, device, o.dtype, batch_cls, cache_cls, seq_chunk_cls,
                                  cuda_graphs=use_cuda_graphs(model, device, o.dtype, o.enforce_eager),
                                  max_model_len=self.max_model_len)
        self.blocks = BlockManager(shape.n_blocks, o.block_tokens, o.max_num_seqs, shape.n_snapshots,
                                   o.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(o.max_num_seqs, o.max_num_batched_tokens, o.snapshot_prompt_end),
                                   self.blocks)
        self.step_times: list[StepTimes] | None = None  # a list: step() appends each step's StepTimes
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._rng = random.Random(o.seed)
        self._aborted: list[Sequence] = []

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

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.encode(prompt)
        self.check_prompt(ids, params)
        seq = Sequence(request_id, ids, params, seed=params.seed if params.seed is not None
                       else self._rng.getrandbits(62), eos_token_id=self.config.eos_id,
                       max_total_tokens=self.max_model_len)
        if self.tokenizer is not None:
            seq.detok = self.tokenizer.stream(skip_special_tokens=True)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        self.scheduler.abort(seq)
        seq.finish("abort")
        self._aborted.append(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = [self._output(s, []) for s in self._aborted]
        self._aborted = []
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if not plan.chunks:
            return outputs
        self.stats.steps += 1
        self.runner.copy_slots(plan.restores)
        t1 = time.perf_counter()
        self.runner.timing = self.step_times is not None
        logits = self.runner.run(plan.chunks)
        t2 = time.perf_counter()
        for c in plan.chunks:
            c.seq.num_computed = c.end
            if c.is_decode:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += c.length
        sampled = [c.seq for c in plan.chunks if c.samples]
        snapshots = [s for s in (self.blocks.commit(c.seq) for c in plan.chunks) if s is not None]
        self.runner.copy_slots(snapshots)
        if sampled:
            outputs += self._append_tokens(sampled, logits)
        if self.step_times is not None:
            r, end = self.runner.last_timing, time.perf_counter()
            self.step_times.append(StepTimes(
                len(plan.chunks), all(c.is_decode for c in plan.chunks), r.graph, t1 - t0, r.prepare_s, r.forward_s,
                end - t2, end - t0, r.gpu_s()))
        return outputs

    def _append_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        out = sample(logits, SamplingBatch.from_seqs(seqs, logits.shape[-1], logits.device))
        ids = out.token_ids.tolist()
        chosen_lp = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        now = time.monotonic()
        results = []
        for i, seq in enumerate(seqs):
            n_before = len(seq.output_token_ids)
            seq.output_token_ids.append(ids[i])
            if seq.first_token_time is None:
                seq.first_token_time = now
            if chosen_lp is not None and seq.params.logprobs is not None:
                k = seq.params.logprobs
                top = dict(zip(top_ids[i][:k], top_lp[i][:k]))
                seq.output_logprobs.append(TokenLogprobs(ids[i], chosen_lp[i], top))
            self._check_stop(seq, ids[i])
            if seq.is_finished:
                self.scheduler.finish(seq)
                self.requests.pop(seq.request_id, None)
            results.append(self._output(seq, seq.output_token_ids[n_before:]))
        return results

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
        if (p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens) \
                or seq.num_tokens >= seq.max_total_tokens:
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


def use_cuda_graphs(model, device, dtype: torch.dtype, enforce_eager: bool) -> bool:
    """Decode steps replay CUDA graphs on CUDA with the fast ops backend in bf16, on one device, unless
    enforce_eager: the reference ops have data-dependent shapes (the MoE's per-expert token lists), and an EP
    exchange sizes its messages from the token counts it exchanges on the host."""
    from mini.ops import backend
    return (torch.device(device).type == "cuda" and backend() == "fast" and dtype == torch.bfloat16
            and getattr(model, "moe_exchange", None) is None and not enforce_eager)


def build_engine(model_or_path, **opts) -> LLMEngine:
    """`model_or_path`: a checkpoint directory / preset name, or a loaded Model (then pass `config` and
    `tokenizer`). Other keyword options: EngineOptions fields, plus batch_cls / cache_cls / seq_chunk_cls."""
    options, rest = EngineOptions.pick(opts)
    if isinstance(model_or_path, str):
        from mini.model import load_model
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

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """`prompts`: a string, a list of token ids, or a list of either. Outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        params = sampling_params
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params):
            ids.append(f"offline-{self._next_id}")
            self._next_id += 1
            self.engine.add_request(ids[-1], prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            for o in self.engine.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]
