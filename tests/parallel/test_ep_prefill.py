"""The `ep-prefill` suite on 2 gloo ranks at tiny-v4.1 size: its result shape and stage accounting, its layer
truncation, and the exactness of the EP forward it times against one process holding every expert."""
import argparse
import dataclasses

import pytest
import torch

from mini.bench import ep_prefill
from mini.testing.suites import check_result
from mini.checkpoint import random_state
from mini.parallel.groups import DistContext
from mini.parallel.launch import spawn
from mini.model import Model

TOP_STAGES = ("sparse_attention_core", "key_gathering", "indexer_topk", "other_attention", "routed_experts", "gate",
              "shared_expert", "exchange_glue", "communication", "hc_norm_other", "unattributed")


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    ep_prefill.add_args(p)
    p.add_argument("--json", default=None)
    return p.parse_args(["--preset", "tiny-v4.1", "--device", "cpu", "--dtype", "float32", "--engram-rows", "97",
                         "--block-tokens", "16", *extra])


def test_suite_runs_on_two_local_ranks():
    args = _args("--nproc", "2", "--tokens", "45", "--seqs", "2", "--steps", "2", "--warmup", "1")
    result = check_result("ep-prefill", ep_prefill.run(args))  # finite numbers, contract shape
    m, d = result["metrics"], result["definition"]
    assert d["ranks"] == 2 and d["backend"] == "gloo" and d["layers"] == 8 and d["tokens_per_rank"] == 45
    assert len(result["raw"]["step_ms"]) == 2 and m["mean_step_ms"] > 0
    assert m["tok_per_s_per_gpu"] == pytest.approx(44 / (m["mean_step_ms"] / 1e3))  # 2 sequences of 22
    assert m["stage.communication_ms"] > 0 and m["stage.routed_experts_ms"] > 0 and m["stage.gate_ms"] > 0
    assert m["stage.exchange_glue_ms"] >= 0 and m["peak_mem_gb"] > 0
    top = sum(m[f"stage.{s}_ms"] for s in TOP_STAGES)
    assert top == pytest.approx(m["stage.step_ms"], rel=1e-9)  # the stages partition the step ...
    assert abs(m["stage.unattributed_fraction"]) < 0.05  # ... and the wrapped functions cover nearly all of it


def test_layers_keep_every_layer_kind():
    def kinds(cfg):  # each layer's plan without its index
        return {dataclasses.replace(p, layer=0) for p in cfg.layers}

    eight, twelve = ep_prefill.layer_config("v4.1-flash", 8), ep_prefill.layer_config("v4.1-flash", 12)
    assert (eight.n_layers, twelve.n_layers, eight.dim) == (8, 12, 5120)
    assert kinds(eight) == kinds(twelve) == kinds(ep_prefill.layer_config("tiny-v4.1", 0))
    assert ep_prefill.layer_config("v4.1-flash", 0).n_layers == 40
    with pytest.raises(ep_prefill.SuiteError, match="every layer kind"):
        ep_prefill.layer_config("v4.1-flash", 5)


# odd lengths; rank 0 brings more tokens than rank 1, so the exchange pads rank 1's rows
TOKENS = [[[5 + (11 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate(lens)] for lens in ([13, 6], [9])]


def _ep_logits(ctx: DistContext, args) -> torch.Tensor:
    r = ep_prefill.build(ctx, ep_prefill.layer_config(args.preset, args.layers), args, TOKENS[ctx.rank])
    return r.step()


def test_ep_logits_equal_one_process():
    args = _args()
    logits = spawn(2, _ep_logits, args, device="cpu")
    cfg = ep_prefill.layer_config(args.preset, args.layers)
    full = Model(cfg, random_state(cfg, "cpu", args.seed, engram_rows=args.engram_rows), "cpu", torch.float32)
    for rank, got in enumerate(logits):
        # the same batch and a fresh cache, built as the suite builds them, on one process with every expert
        r = ep_prefill.build(DistContext(0, 1, torch.device("cpu"), None), cfg, args, TOKENS[rank])
        want = full.forward(r.batch, r.cache)
        assert got.shape == want.shape == (len(TOKENS[rank]), cfg.vocab_size)
        assert torch.isfinite(want).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # only the fp32 cross-rank sum order differs
