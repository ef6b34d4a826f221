"""CUDA-graph-captured EP/DP decode on the GPU.

One GPU: a one-rank NCCL group used as a group (`_OneRankGroup`: the exchange then runs its all-gather and
reduce-scatter instead of the one-device shortcut), so the collectives are really captured and replayed:
* one MoE exchange captured in a CUDA graph and replayed == the eager exchange on the same inputs, bit for bit;
* the DP engine on that group replays decode graphs (buckets 1-8) and generates the plain single-GPU engine's
  greedy tokens with the same log-probabilities, bit for bit, and enforce_eager's tokens.
* with DSpark speculation, decode steps replay graphs and verify steps run eagerly, and the outputs are plain
  decode's under --deterministic.
Two GPUs (skipped unless two are visible): `--ep 2`-style ranks with graphs generate one GPU's greedy tokens."""
import dataclasses
import random

import pytest
import torch

from mini.engine import LLM, SamplingParams
from mini.parallel.groups import DistContext
from mini.parallel.launch import spawn

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", dtype=torch.bfloat16, max_num_seqs=8, block_tokens=128, max_model_len=1024,
              num_blocks=64, enable_prefix_caching=False)


@dataclasses.dataclass(frozen=True)
class _OneRankGroup(DistContext):
    """A one-rank process group used as a group: the exchange runs its collectives (a plain one-rank context
    skips them)."""

    @property
    def multi(self) -> bool:
        return True


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _summary(outs):
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def _one_rank_nccl(ctx: DistContext) -> DistContext:
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=ctx.device)
    return _OneRankGroup(0, 1, ctx.device, "nccl")


def _exchange_graph(ctx: DistContext):
    """Layers 0 (hash-routed) and the last of tiny-v4.1: the exchange captured once per layer, replayed on three
    fresh inputs each, against the eager exchange on the same inputs."""
    import mini.ops
    import mini.parallel.exchange as exchange_mod
    from mini.model import load_model
    from mini.ops.moe import gate, routed_wire_ok
    mini.ops.set_backend("fast")
    group = _one_rank_nccl(ctx)
    model, cfg, _ = load_model("tiny-v4.1", device=ctx.device, dtype=torch.bfloat16)
    calls = []
    gather = exchange_mod.all_gather

    def counted(*a, **kw):
        calls.append(torch.cuda.is_current_stream_capturing())
        return gather(*a, **kw)
    exchange_mod.all_gather = counted
    results, g = [], torch.Generator(device=ctx.device).manual_seed(0)
    for blk in (model.blocks[0], model.blocks[-1]):
        ex, T = exchange_mod.MoEExchange(group), 8
        ex.set_counts([T])
        x = torch.empty(T, cfg.dim, device=ctx.device, dtype=torch.bfloat16)
        ids = torch.empty(T, device=ctx.device, dtype=torch.int64)

        def fresh():
            x.copy_(torch.randn(T, cfg.dim, device=ctx.device, generator=g).bfloat16())
            ids.copy_(torch.randint(0, cfg.vocab_size, (T,), device=ctx.device, generator=g))
        fresh()
        assert ex.glue == "fused" and routed_wire_ok(x, gate(x, blk.moe, cfg, blk.plan, ids)[1], blk.moe)
        stream = torch.cuda.Stream(ctx.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ex(x, blk.moe, cfg, blk.plan, input_ids=ids)  # warm-up: kernels compiled
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            out = ex(x, blk.moe, cfg, blk.plan, input_ids=ids)
        for _ in range(3):
            fresh()
            graph.replay()
            replayed = out.clone()
            with torch.inference_mode():
                eager = ex(x, blk.moe, cfg, blk.plan, input_ids=ids)
            results.append((replayed.cpu(), eager.cpu()))
    return results, calls


def test_exchange_captured_in_a_cuda_graph_equals_eager_one_rank_nccl():
    results, calls = spawn(1, _exchange_graph, device="cuda")[0]
    assert calls.count(True) == 2, calls  # one all-gather per layer was captured (the reduce-scatter beside it)
    for replayed, eager in results:
        assert torch.isfinite(eager).all() and eager.abs().sum() > 0
        assert torch.equal(replayed, eager), f"{(replayed != eager).sum().item()} elements differ"


PROMPTS = dict(lengths=[64, 70, 90, 100, 127, 150, 181], seed=7)


def _engine_runs(ctx: DistContext):
    """On the one-rank NCCL group: the DP engine with graphs, then with enforce_eager; then the plain engine."""
    import mini.ops
    from mini.model import load_model
    from mini.parallel.dp import DPModel
    mini.ops.set_backend("fast")
    group = _one_rank_nccl(ctx)
    prompts, params = _prompts(**PROMPTS), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    model, cfg, tok = load_model("tiny-v4.1", device=ctx.device, dtype=torch.bfloat16)
    runs = {}
    for name, eager in (("dp_graphs", False), ("dp_eager", True)):
        dp = DPModel(model, group)
        llm = LLM(dp, config=cfg, tokenizer=tok, enforce_eager=eager, **ENGINE)
        llm.engine.step_times = []
        runs[name] = _summary(llm.generate(prompts, params))
        graphs = llm.engine.runner.graphs
        runs[name + "_info"] = (None if graphs is None else sorted(n for n, _ in graphs.graphs),
                                sum(t.graph for t in llm.engine.step_times), dataclasses.asdict(dp.kinds))
        del llm
    model.moe_exchange = None  # the same weights through mini.ops.moe.moe
    llm = LLM(model, config=cfg, tokenizer=tok, **ENGINE)
    runs["plain"] = _summary(llm.generate(prompts, params))
    return runs


def test_dp_decode_graphs_one_rank_nccl_equal_the_plain_engine():
    runs = spawn(1, _engine_runs, device="cuda")[0]
    buckets, graph_steps, kinds = runs["dp_graphs_info"]
    assert buckets == [1, 2, 4, 8] and graph_steps == 19 and kinds["static"] == 19, runs["dp_graphs_info"]
    assert runs["dp_eager_info"][0] is None and runs["dp_eager_info"][1] == 0
    tokens = {name: [t for t, _ in runs[name]] for name in ("dp_graphs", "dp_eager", "plain")}
    assert tokens["dp_graphs"] == tokens["plain"] == tokens["dp_eager"]
    # graphs on both: the one-rank exchange computes what the one-device MoE computes, bit for bit
    got, want = (torch.tensor([x for _, lp in runs[name] for x in lp]) for name in ("dp_graphs", "plain"))
    assert torch.equal(got, want), f"log-probabilities differ by up to {(got - want).abs().max().item():.3g}"


def _ep2_rank(ctx: DistContext):
    import mini.ops
    from mini.parallel.dp import generate, load_ep_model
    mini.ops.set_backend("fast")
    model, cfg, tok = load_ep_model("tiny-v4.1", ctx, torch.bfloat16)
    llm = LLM(model, config=cfg, tokenizer=tok, **ENGINE)
    outs = generate(llm, ctx, _prompts(**PROMPTS), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    return ([o.token_ids for o in outs], sorted(n for n, _ in llm.engine.runner.graphs.graphs),
            dataclasses.asdict(model.kinds))


def _one_gpu(ctx: DistContext):
    import mini.ops
    mini.ops.set_backend("fast")
    llm = LLM("tiny-v4.1", **ENGINE)
    return [o.token_ids for o in llm.generate(_prompts(**PROMPTS),
                                              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (kind nvidia-h200-x2)")
def test_ep2_decode_graphs_greedy_equals_one_gpu():
    want = spawn(1, _one_gpu, device="cuda")[0]
    ranks = spawn(2, _ep2_rank, device="cuda")
    for tokens, buckets, kinds in ranks:
        assert tokens == want
        assert buckets == [1, 2, 4, 8] and kinds["static"] + kinds["idle_static"] >= 19, kinds


def _speculating_runs(ctx: DistContext):
    """On the one-rank NCCL group, tiny-v4.1-dspark under --deterministic with decode graphs: plain decode, then
    DSpark speculation with every draft verified."""
    import mini.ops
    from mini.model import load_model
    from mini.parallel.dp import DPModel
    mini.ops.set_backend("fast")
    group = _one_rank_nccl(ctx)
    prompts, params = _prompts(**PROMPTS), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    model, cfg, tok = load_model("tiny-v4.1-dspark", device=ctx.device, dtype=torch.bfloat16)
    runs = {}
    for name, spec in (("plain", {}), ("spec", dict(speculative="dspark", spec_adaptive=False))):
        dp = DPModel(model, group)
        llm = LLM(dp, config=cfg, tokenizer=tok, deterministic=True, **ENGINE, **spec)
        runs[name] = _summary(llm.generate(prompts, params))
        graphs = llm.engine.runner.graphs
        runs[name + "_info"] = (sorted(n for n, _ in graphs.graphs), sorted(graphs.verify_graphs),
                                dataclasses.asdict(dp.kinds),
                                llm.engine.stats.spec.drafted_tokens)
        llm.engine.close()
        del llm
    return runs


def test_dp_speculation_one_rank_nccl_verifies_eagerly_and_equals_plain_decode():
    """Speculation over EP ranks on CUDA (one-rank NCCL group): decode steps replay their graphs, verify steps run
    eagerly (DPModel captures no verify graph), and the tokens and log-probabilities are plain decode's, bit for bit
    under --deterministic."""
    runs = spawn(1, _speculating_runs, device="cuda")[0]
    buckets, verify, plain_kinds, _ = runs["plain_info"]
    spec_buckets, spec_verify, kinds, drafted = runs["spec_info"]
    assert buckets == spec_buckets == [1, 2, 4, 8] and verify == spec_verify == []
    assert drafted > 0 and kinds["eager"] > plain_kinds["eager"] and kinds["static"] > 0, runs["spec_info"]
    assert runs["spec"] == runs["plain"]
