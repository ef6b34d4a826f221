"""Data-parallel attention over EP ranks: each request lives on one rank, every rank runs its own engine, and
the MoE layers of all ranks meet in the exchange once per layer.

    ctx = groups.init()
    model, cfg, tok = load_ep_model("tiny-v4.1", ctx, dtype)     # this rank's experts only
    llm = LLM(model, config=cfg, tokenizer=tok, **engine_options) # an ordinary engine over the DPModel
    outputs = generate(llm, ctx, prompts, params)                 # every rank passes the same prompts

A step in which a rank has no tokens still has to take part in every MoE layer (its experts serve the other
ranks' tokens): `DPModel.join_idle` runs the exchange with empty inputs; `generate` calls it whenever the rank's
engine step ran no forward (`LLMEngine.step().forward`), and stops when no rank has work left.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mini.checkpoint import expert_range
from mini.config import PRESETS, ModelConfig, preset
from mini.parallel.exchange import MoEExchange
from mini.parallel.groups import DistContext


class DPModel:
    """A Model of one EP/DP rank, as the engine steps it (mini.engine.model_runner.StepModel): each forward first
    exchanges the step's token counts."""
    exchanges_tokens = True

    def __init__(self, model, ctx: DistContext):
        self.model, self.exchange = model, MoEExchange(ctx)
        model.moe_exchange = self.exchange
        self.config = model.config

    @property
    def hasher(self):
        return self.model.hasher

    @property
    def engram_on_device(self) -> bool:
        return self.model.engram_on_device

    def engram_rows(self, hash_ids: torch.Tensor) -> torch.Tensor:
        return self.model.engram_rows(hash_ids)

    def build_batch(self, chunks, device):
        return self.model.build_batch(chunks, device)

    def new_cache(self, n_slots: int, n_blocks: int, block_tokens: int, device, dtype):
        return self.model.new_cache(n_slots, n_blocks, block_tokens, device, dtype)

    def cache_bytes(self, block_tokens: int, dtype) -> tuple[int, int]:
        return self.model.cache_bytes(block_tokens, dtype)

    def forward(self, batch, cache) -> torch.Tensor:
        self.exchange.begin_step(batch.n_tokens)
        return self.model.forward(batch, cache)

    @torch.inference_mode()
    def join_idle(self) -> int:
        """Serve the other ranks' tokens in a step without own tokens; returns the step's total token count
        (0: no rank had any, nothing ran)."""
        total = self.exchange.begin_step(0)
        if total:
            self.exchange.join_idle([(b.moe, b.plan) for b in self.model.blocks], self.model.config,
                                    self.model.dtype)
        return total


def load_ep_model(path_or_preset: str, ctx: DistContext, dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[DPModel, ModelConfig, object]:
    """`mini.model.load_model` with only this rank's routed experts, wrapped for DP attention."""
    from mini.model import load_model
    cfg = preset(path_or_preset) if path_or_preset in PRESETS else ModelConfig.load(path_or_preset)
    model, cfg, tok = load_model(path_or_preset, device=ctx.device, dtype=dtype,
                                 experts=expert_range(cfg, ctx.rank, ctx.world))
    return DPModel(model, ctx), cfg, tok


def _any_rank(ctx: DistContext, flag: bool) -> bool:
    t = torch.tensor([int(flag)], device=ctx.device)
    if ctx.multi:
        dist.all_reduce(t)
    return bool(t.item())


def generate(llm, ctx: DistContext, prompts: list, params) -> list:
    """Greedy/sampled generation of `prompts` spread over the ranks (prompt i on rank i % world); returns every
    prompt's final RequestOutput, in prompt order, on every rank. `llm` is an LLM over a DPModel."""
    engine, dp = llm.engine, llm.engine.runner.model
    params = params if isinstance(params, list) else [params] * len(prompts)
    mine = range(ctx.rank, len(prompts), ctx.world)
    for i in mine:
        engine.add_request(f"dp-{i}", prompts[i], params[i])
    final = {}
    while _any_rank(ctx, engine.has_work()):
        ran_forward = False
        if engine.has_work():
            outputs = engine.step()
            final.update({o.request_id: o for o in outputs if o.finished})
            ran_forward = outputs.forward
        if not ran_forward:
            dp.join_idle()
    outputs = [final[f"dp-{i}"] for i in mine]
    if not ctx.multi:
        return outputs
    gathered = [None] * ctx.world
    dist.all_gather_object(gathered, outputs)
    return [gathered[i % ctx.world][i // ctx.world] for i in range(len(prompts))]
