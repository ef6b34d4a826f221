"""Data-parallel attention over EP ranks: each request lives on one rank, every rank runs its own engine, and
the MoE layers of all ranks meet in the exchange once per layer.

    ctx = groups.init()
    model, cfg, tok = load_ep_model("tiny-v4.1", ctx, dtype)     # this rank's experts only
    llm = LLM(model, config=cfg, tokenizer=tok, **engine_options) # an ordinary engine over the DPModel
    outputs = generate(llm, ctx, prompts, params)                 # every rank passes the same prompts

A step in which a rank has no tokens still has to take part in every MoE layer (its experts serve the other
ranks' tokens): `DPModel.join_idle` runs the exchange with empty inputs (or replays the agreed decode graph with
padding rows only); `generate` calls it whenever the rank's engine step ran no forward (`LLMEngine.step().forward`),
and stops when no rank has work left.

CUDA graphs: before every forward the engine's runner asks the model to agree on the step with the other ranks
(`DPModel.agree_step`, mini.parallel.step_shape): every rank then replays the decode graph of the same bucket, or
every rank runs eagerly. The graphs are captured at start-up on every rank alike (same buckets, same order), each
capture's exchange sending the bucket's rows from every rank, so at replay the collectives need no token counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from mini.checkpoint import expert_range
from mini.config import PRESETS, ModelConfig, preset
from mini.parallel.exchange import MoEExchange
from mini.parallel.groups import DistContext
from mini.parallel.step_shape import EAGER, IDLE, StepAgreement, StepShape, host_group


@dataclass
class StepKinds:
    """How this rank's forwards ran: static (a decode graph's bucket; on the CPU the same step run eagerly) or
    eager, with tokens of its own or joined idle (all padding / empty)."""
    static: int = 0
    eager: int = 0
    idle_static: int = 0
    idle_eager: int = 0
    foreseen: int = 0  # static steps whose bucket was known without an agreement (`DPModel.foresee`)


class DPModel:
    """A Model of one EP/DP rank, as the engine steps it (mini.step.StepModel): each forward runs with the token
    counts agreed for its step (`agree_step`; without one, it exchanges them first), so its decode steps can be
    captured in CUDA graphs."""
    capturable = True

    def __init__(self, model, ctx: DistContext):
        self.model, self.exchange, self.ctx = model, MoEExchange(ctx), ctx
        model.moe_exchange = self.exchange
        self.config = model.config
        self.agreement = StepAgreement(ctx)
        self.kinds = StepKinds()
        self._shape: StepShape | None = None  # agreed for the next forward
        self._foreseen: int | None = None  # the bucket of the coming step, known without an agreement

    @property
    def reads_images(self) -> bool:
        return self.model.reads_images

    @property
    def drafter(self):
        """The model's DSpark draft module: a rank holds the whole draft (its experts too), so drafting needs no
        other rank; the verify step it leads to is an eager forward on every rank (`static_decode`)."""
        return self.model.drafter

    def build_batch(self, chunks, device):
        return self.model.build_batch(chunks, device)

    def release_images(self, digests: list[str]) -> None:
        self.model.release_images(digests)

    def static_decode(self, max_seqs: int, max_len: int, block_tokens: int, pad_slot: int, pad_block: int, device,
                      dtype, max_rows: int = 1):
        """Decode steps only (one row a sequence, whatever `max_rows`): a graph's exchange sends the same rows from
        every rank, which ranks verifying drafts of different widths would not, so a verify step runs eagerly (its
        rank asks for no bucket, and then every rank runs eagerly: `agree_step`)."""
        return self.model.static_decode(max_seqs, max_len, block_tokens, pad_slot, pad_block, device, dtype, 1)

    def new_cache(self, n_slots: int, n_blocks: int, block_tokens: int, device, dtype):
        return self.model.new_cache(n_slots, n_blocks, block_tokens, device, dtype)

    def cache_bytes(self, block_tokens: int, dtype) -> tuple[int, int]:
        return self.model.cache_bytes(block_tokens, dtype)

    def foresee(self, bucket: int) -> None:
        """Every rank knows (mini.parallel.serve: from the step's messages) that the coming step is a decode step
        of at most `bucket` rows on every rank: its `agree_step` or `join_idle` takes that bucket without an
        agreement. Every rank must be told the same, for the same step."""
        self._foreseen = bucket

    def _take_foreseen(self, n_tokens: int, bucket: int | None) -> StepShape | None:
        foreseen, self._foreseen = self._foreseen, None
        if foreseen is None:
            return None
        if bucket is None or n_tokens > foreseen:  # the other ranks replay `foreseen` now: this rank cannot follow
            raise RuntimeError(f"the step was foreseen as a decode step of at most {foreseen} rows; this rank's has "
                               f"{n_tokens} tokens{'' if bucket is not None else ' and needs an eager forward'}")
        self.kinds.foreseen += 1
        return StepShape((foreseen,) * self.ctx.world, foreseen)  # the counts of a static step: the bucket's rows

    def agree_step(self, n_tokens: int, bucket: int | None) -> int | None:
        """Agree with the other ranks on this rank's coming forward of `n_tokens` tokens, which fits the decode
        graph of `bucket` (None: it needs an eager forward); returns the bucket every rank replays (at least
        `bucket`), or None: every rank runs eagerly (mini.engine.model_runner calls it before every forward)."""
        self._shape = self._take_foreseen(n_tokens, bucket) or self.agreement.agree(
            n_tokens, EAGER if bucket is None else bucket)
        self.kinds.static += self._shape.bucket is not None
        self.kinds.eager += self._shape.bucket is None
        return self._shape.bucket

    def forward(self, batch, cache) -> torch.Tensor:
        shape, self._shape = self._shape, None
        n = batch.n_tokens
        if batch.input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            # a decode graph captured at start-up: every rank captures the same buckets in the same order
            self.exchange.set_counts([n] * self.ctx.world)
        elif shape is not None:
            counts = shape.exchange_counts()
            if counts[self.ctx.rank] != n:
                raise RuntimeError(f"the step agreed on {counts[self.ctx.rank]} tokens of this rank, its batch has {n}")
            self.exchange.set_counts(counts)
        else:  # a forward nobody agreed on (no runner): exchange the counts now
            self.exchange.begin_step(n)
        return self.model.forward(batch, cache)

    @torch.inference_mode()
    def join_idle(self, replay_padding: Callable[[int], None] | None = None) -> int:
        """Serve the other ranks' tokens in a step without own tokens; returns the step's total token count
        (0: no rank had any, nothing ran). `replay_padding(bucket)`: the engine's (LLMEngine.replay_padding) when
        it has decode graphs: when the others agree on a decode bucket, this rank replays it with padding rows
        only."""
        shape = self._take_foreseen(0, 0) if replay_padding is not None else None
        shape = shape or self.agreement.agree(0, IDLE if replay_padding is not None else EAGER)
        if not shape.total:
            return 0
        if shape.bucket is not None:
            self.kinds.idle_static += 1
            self._shape = shape  # read by the forward that the replay runs eagerly on the CPU
            replay_padding(shape.bucket)
            self._shape = None
        else:
            self.kinds.idle_eager += 1
            self.exchange.set_counts(shape.exchange_counts())
            self.exchange.join_idle([(b.moe, b.plan) for b in self.model.blocks], self.model.config,
                                    self.model.dtype)
        return shape.total


def load_ep_model(path_or_preset: str, ctx: DistContext, dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[DPModel, ModelConfig, object]:
    """`mini.model.load_model` with only this rank's routed experts, wrapped for DP attention."""
    from mini.model import load_model
    cfg = preset(path_or_preset) if path_or_preset in PRESETS else ModelConfig.load(path_or_preset)
    model, cfg, tok = load_model(path_or_preset, device=ctx.device, dtype=dtype,
                                 experts=expert_range(cfg, ctx.rank, ctx.world))
    return DPModel(model, ctx), cfg, tok


def _any_rank(ctx: DistContext, flag: bool) -> bool:
    """Over the hosts (step_shape.host_group): never waits for a step in flight on the device."""
    t = torch.tensor([int(flag)])
    if ctx.multi:
        dist.all_reduce(t, group=host_group(ctx))
    return bool(t.item())


def join_idle(engine) -> int:
    """A step of `engine` (an LLMEngine over a DPModel) that ran no forward of its own joins the other ranks'
    (`DPModel.join_idle`): eagerly, or replaying its agreed decode graph with padding rows only."""
    return engine.model.join_idle(engine.replay_padding if engine.decode_graphs else None)


class LockStepEngine:
    """An LLMEngine (over a DPModel) stepped as one rank of the lock step (the serving warm-up's `stepper`,
    mini.engine.warmup): a step without a forward of its own joins the other ranks' step, and `has_work` is whether
    any rank has work. Every rank must make the same calls in the same order (each rank's step is one agreement,
    whatever its engine did)."""

    def __init__(self, engine, ctx: DistContext):
        self.engine, self.ctx = engine, ctx

    def add_request(self, request_id: str, prompt, params):
        return self.engine.add_request(request_id, prompt, params)

    def has_work(self) -> bool:
        return _any_rank(self.ctx, self.engine.has_work())

    def step(self):
        outputs = self.engine.step()
        if not outputs.forward:
            join_idle(self.engine)
        return outputs


def generate(llm, ctx: DistContext, prompts: list, params, images: list | None = None) -> list:
    """Greedy/sampled generation of `prompts` spread over the ranks (prompt i on rank i % world); returns every
    prompt's final RequestOutput, in prompt order, on every rank. `llm` is an LLM over a DPModel; `images`: each
    prompt's image spans (LLM.generate's)."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    images = images if images is not None else [[]] * len(prompts)
    mine = range(ctx.rank, len(prompts), ctx.world)
    for i in mine:
        engine.add_request(f"dp-{i}", prompts[i], params[i], images[i])
    final = {}
    while _any_rank(ctx, engine.has_work()):
        ran_forward = False
        if engine.has_work():
            outputs = engine.step()
            final.update({o.request_id: o for o in outputs if o.finished})
            ran_forward = outputs.forward
        if not ran_forward:
            join_idle(engine)
    outputs = [final[f"dp-{i}"] for i in mine]
    if not ctx.multi:
        return outputs
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, outputs)
    return [gathered[i % ctx.world][i // ctx.world] for i in range(len(prompts))]
