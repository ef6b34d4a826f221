"""EP/DP decode through the static decode path (what CUDA graphs capture) on gloo ranks: the ranks agree on one
bucket per step (mini.parallel.step_shape), pad their rows up to it, and a rank without tokens replays the bucket
with padding rows only; greedy tokens equal one process's. On the CPU DecodeGraphs "replays" by running the static
step eagerly, so the agreement, the padding and the exchange's counts are all exercised here; the real capture is
in test_dp_graphs_gpu.py."""
import dataclasses

import pytest
import torch

from mini.engine import LLM, SamplingParams
from mini.model import load_model
from mini.ops import deterministic_mode
from mini.parallel.launch import spawn
from mini.parallel.step_shape import EAGER, IDLE, StepShape, decide

# rank 0 of 2 gets prompts 0, 2, 4 (bucket 4), rank 1 gets 1, 3 (bucket 2, padded to 4) and finishes first
PROMPTS = [[5 + (7 * i + 3 * j) % 400 for j in range(n)] for i, n in enumerate([9, 19, 4, 11, 6])]
MAX_TOKENS = [7, 2, 5, 3, 6]
ENGINE = dict(device="cpu", dtype=torch.float32, block_tokens=32, num_blocks=24, enable_prefix_caching=False,
              max_num_seqs=8)


def _params():
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in MAX_TOKENS]


def _summary(outs):
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


# ---------------------------------------------------------------------------------------------------- the rule
def test_ranks_replay_the_largest_bucket_and_idle_ranks_join_it():
    assert decide([(3, 4), (2, 2)]) == StepShape((3, 2), 4)
    assert decide([(3, 4), (0, IDLE)]) == StepShape((3, 0), 4)
    assert decide([(0, IDLE), (1, 1), (0, IDLE), (9, 16)]).bucket == 16
    assert decide([(3, 4), (5, 8)]).exchange_counts() == [8, 8]


def test_one_eager_rank_makes_every_rank_eager():
    shape = decide([(3, 4), (130, EAGER), (0, IDLE)])
    assert shape.bucket is None and shape.exchange_counts() == [3, 130, 0]
    assert decide([(0, EAGER), (1, 1)]).bucket is None  # an idle rank without graphs


def test_no_tokens_anywhere_is_no_step():
    assert decide([(0, IDLE), (0, EAGER)]).total == 0
    assert decide([(0, IDLE), (0, IDLE)]).bucket is None


@pytest.mark.parametrize("report", [(3, 2), (0, 4), (2, IDLE), (1, -2), (-1, EAGER)])
def test_a_report_its_bucket_cannot_hold_is_refused(report):
    with pytest.raises(ValueError, match="step report"):
        decide([report, (1, 1)])


# ---------------------------------------------------------------------------------------------------- gloo ranks
def _run_static(ctx, overlap: bool):
    """One rank: the DP engine with the static decode path on (this spawned process only), recording every
    replay's (bucket, real rows)."""
    import mini.engine.model_runner as runner_module
    from mini.engine.cuda_graphs import DecodeGraphs
    from mini.parallel.dp import generate, load_ep_model
    from mini.ops import set_deterministic
    runner_module.use_cuda_graphs = lambda *a: True
    set_deterministic(True)  # this spawned process only: see test_static_dp_decode_equals_one_process
    replays, replay = [], DecodeGraphs.replay

    def recorded(self, n, n_real, width=1, span=None):
        replays.append((n, n_real))
        return replay(self, n, n_real, width, span)
    DecodeGraphs.replay = recorded
    model, cfg, tok = load_ep_model("tiny-v4.1", ctx, torch.float32)
    llm = LLM(model, config=cfg, tokenizer=tok, overlap=overlap, **ENGINE)
    outs = generate(llm, ctx, PROMPTS, _params())
    return _summary(outs), replays, dataclasses.asdict(model.kinds)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_static_dp_decode_equals_one_process(overlap):
    """Both sides take the CPU's batch-invariant GEMMs (the deterministic mode's, mini/ops/cpu_batch_invariant.py):
    a padded bucket has more rows than the eager step, and MKL rounds a row by the call's row count on some CPUs
    (this AMD EPYC's AVX2 path: 0.014 on one logprob, an FP8 rounding flipped at layer 2 of a 3-row vs 4-row step),
    which is not what this test is about: that padding rows and the exchange leave the real rows alone."""
    model, cfg, tok = load_model("tiny-v4.1", device="cpu", dtype=torch.float32)
    with deterministic_mode():
        want = _summary(LLM(model, config=cfg, tokenizer=tok, **ENGINE).generate(PROMPTS, _params()))
    results = spawn(2, _run_static, overlap, device="cpu")
    (outs0, replays0, kinds0), (outs1, replays1, kinds1) = results
    assert outs0 == outs1
    assert [t for t, _ in outs0] == [t for t, _ in want]
    torch.testing.assert_close(torch.tensor([x for _, lp in outs0 for x in lp]),
                               torch.tensor([x for _, lp in want for x in lp]), rtol=0, atol=1e-4)
    # lock step: both ranks replayed the same buckets, rank 1 padded its 2 rows up to rank 0's bucket of 4, then
    # joined rank 0's steps with padding rows only once its requests were done
    assert [n for n, _ in replays0] == [n for n, _ in replays1]
    assert (4, 2) in replays1 and (4, 3) in replays0
    assert any(real == 0 for _, real in replays1) and kinds1["idle_static"] > 0
    assert kinds0["static"] + kinds0["idle_static"] == len(replays0)
    assert kinds0["eager"] >= 1  # the prompts' prefill


# ---------------------------------------------------------------------------------------------------- serving
def _serve_rank(ctx, overlap: bool, preset: str = "tiny-v4.1", options: dict | None = None):
    """`mini serve --ep 2`'s lock step (DPDriver on rank 0, DPWorker.follow on the others) with the static decode
    path and overlapped steps: rank 0 adds every request at once, then steps until all have finished. `options`:
    the engine's beyond ENGINE."""
    import mini.engine.model_runner as runner_module
    from mini.engine import build_engine
    from mini.engine.async_engine import Add, Failed
    from mini.parallel.dp import load_ep_model
    from mini.parallel.serve import DPDriver, DPWorker
    runner_module.use_cuda_graphs = lambda *a: True
    model, cfg, tok = load_ep_model(preset, ctx, torch.float32)
    worker = DPWorker(build_engine(model, config=cfg, tokenizer=tok, overlap=overlap, **ENGINE, **(options or {})),
                      ctx)
    if ctx.rank != 0:
        worker.follow()
        return dataclasses.asdict(model.kinds)
    driver, final = DPDriver(worker), {}
    outputs = driver.step([Add(f"r{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, _params()))], False)
    for _ in range(200):
        for out in outputs:
            assert not isinstance(out, Failed), out.error
            if out.finished:
                final[out.request_id] = out
        if len(final) == len(PROMPTS):
            break
        outputs = driver.step([], False)
    driver.step([], True)
    return ([final[f"r{i}"].token_ids for i in range(len(PROMPTS))], driver.status(), dataclasses.asdict(model.kinds))


@pytest.mark.slow
def test_dp_serving_lock_step_with_static_overlapped_decode_equals_one_process():
    model, cfg, tok = load_model("tiny-v4.1", device="cpu", dtype=torch.float32)
    want = [o.token_ids for o in LLM(model, config=cfg, tokenizer=tok, **ENGINE).generate(PROMPTS, _params())]
    (tokens, status, kinds0), kinds1 = spawn(2, _serve_rank, True, device="cpu")
    assert tokens == want
    assert status["unfinished"] == [0, 0] and sum(status["placed"]) == len(PROMPTS)
    assert status["step_kinds"] == kinds0 and status["agree_us_mean"] > 0 and status["sync_us_mean"] > 0
    for kinds in (kinds0, kinds1):  # both ranks decoded through the static path, in the same steps
        assert kinds["static"] + kinds["idle_static"] == kinds0["static"] + kinds0["idle_static"] > 0
        # steady decode steps took their bucket from the step messages, without an agreement
        assert kinds["foreseen"] == kinds0["foreseen"] > 0


# ---------------------------------------------------------------------------------------------------- warm-up
def _warm_rank(ctx):
    """The serving warm-up on both ranks in lock step (two of its parts), then a lock-stepped engine where only
    rank 0 has a request: rank 1's steps join rank 0's."""
    import mini.engine.model_runner as runner_module
    from mini.engine import build_engine
    from mini.parallel.dp import LockStepEngine, load_ep_model
    from mini.parallel.serve import warm_up_ranks
    runner_module.use_cuda_graphs = lambda *a: True
    model, cfg, tok = load_ep_model("tiny-v4.1", ctx, torch.float32)
    engine = build_engine(model, config=cfg, tokenizer=tok, overlap=True, **ENGINE)
    warm_up_ranks(engine, ctx, parts=["trickle", "decode-buckets"])
    warmed = (engine.has_work(), engine.stats.steps, dataclasses.asdict(model.kinds))
    lock = LockStepEngine(engine, ctx)
    if ctx.rank == 0:
        lock.add_request("only", PROMPTS[0], _params()[0])
    outputs = []
    while lock.has_work():
        outputs += lock.step()
    return warmed, [o.token_ids for o in outputs if o.finished], dataclasses.asdict(model.kinds)


@pytest.mark.slow
def test_warm_up_and_a_lone_request_in_lock_step():
    model, cfg, tok = load_model("tiny-v4.1", device="cpu", dtype=torch.float32)
    want = LLM(model, config=cfg, tokenizer=tok, **ENGINE).generate(PROMPTS[:1], _params()[:1])[0].token_ids
    (warm0, done0, kinds0), (warm1, done1, kinds1) = spawn(2, _warm_rank, device="cpu")
    for has_work, steps, kinds in (warm0, warm1):
        assert not has_work and steps == 0  # every warm-up request ran to its end; counters reset
        assert kinds["static"] > 0 and kinds["eager"] > 0  # decode buckets replayed, prefill and mixed steps eager
    assert done0 == [want] and done1 == []
    assert kinds1["idle_static"] > warm1[2]["idle_static"]  # rank 1 joined rank 0's decode steps
    assert kinds0["static"] + kinds0["idle_static"] == kinds1["static"] + kinds1["idle_static"]


# ---------------------------------------------------------------------------------------------------- host messages
def _messages_rank(ctx):
    """A run of gathers whose payloads grow past the buffer (on one rank only), then shrink, against
    dist.all_gather_object; returns both and the collectives each gather took."""
    import torch.distributed as dist
    from mini.parallel.step_shape import HostMessages
    messages = HostMessages(ctx)
    sizes = [10, 3000, 5, 20_000, 20_000, 40]  # characters of rank 1's string; rank 0's stay short
    got, want, rounds = [], [], []
    for i, n in enumerate(sizes):
        obj = {"step": i, "rank": ctx.rank, "text": "x" * (n if ctx.rank == 1 else 3)}
        before = messages.rounds
        got.append(messages.gather(obj))
        rounds.append(messages.rounds - before)
        every = [None] * ctx.world
        dist.all_gather_object(every, obj)
        want.append(every)
    return got, want, rounds


def test_host_messages_gather_like_all_gather_object_in_one_collective_while_they_fit():
    for got, want, rounds in spawn(2, _messages_rank, device="cpu"):
        assert got == want
        # 1 KiB buffer at first; 3,000 > 1 KiB: a second round, then a 3 KiB buffer; 20,000 again; the same size
        # next time fits; 40 after 20,000 fits (the buffer shrinks to 1 KiB after it)
        assert rounds == [1, 2, 1, 2, 1, 1]


def test_a_step_is_foreseen_only_when_no_rank_can_prefill():
    from mini.engine.cuda_graphs import buckets
    from mini.parallel.balance import RankLoad
    from mini.parallel.serve import AbortRequest, AddRequest, StepMessage, foreseen_bucket

    def graphs(n):  # LLMEngine.decode_bucket of an engine with max_num_seqs 8
        return next(s for s in buckets(8) if s >= n)

    def msgs(*loads, commands=(), decode_graphs=True):
        return [StepMessage(True, commands=list(commands) if r == 0 else [], load=RankLoad(*ld),
                            decode_graphs=decode_graphs) for r, ld in enumerate(loads)]
    assert foreseen_bucket(msgs((0, 90, 3, 512), (0, 40, 2, 512)), graphs) == 4
    assert foreseen_bucket(msgs((0, 90, 3, 512), (0, 0, 0, 512)), graphs) == 4  # an idle rank joins
    assert foreseen_bucket(msgs((0, 90, 3, 512), (7, 40, 2, 512)), graphs) is None  # a rank prefills
    assert foreseen_bucket(msgs((0, 90, 3, 512), (0, 40, 2, 512), commands=[AddRequest("r", [1, 2], None)]),
                           graphs) is None  # a new request
    assert foreseen_bucket(msgs((0, 90, 3, 512), (0, 40, 2, 512), commands=[AbortRequest("r")]), graphs) == 4
    assert foreseen_bucket(msgs((0, 0, 0, 512), (0, 0, 0, 512)), graphs) is None  # nothing decodes
    assert foreseen_bucket(msgs((0, 90, 3, 512), decode_graphs=False), graphs) is None
    assert foreseen_bucket(msgs((0, 90, 3, 512)), None) is None


def test_a_step_that_breaks_what_was_foreseen_is_refused():
    from mini.parallel.dp import DPModel
    from mini.parallel.groups import DistContext
    model, _, _ = load_model("tiny-v4.1", device="cpu", dtype=torch.float32)
    dp = DPModel(model, DistContext(0, 1, torch.device("cpu"), None))
    dp.foresee(4)
    assert dp.agree_step(3, 4) == 4 and dp.kinds.foreseen == 1
    assert dp.agree_step(3, 4) == 4 and dp.kinds.foreseen == 1  # once: the next step agrees again
    for n, bucket in ((5, 8), (3, None)):  # more rows than foreseen; a step that needs an eager forward
        dp.foresee(4)
        with pytest.raises(RuntimeError, match="foreseen"):
            dp.agree_step(n, bucket)


@pytest.mark.slow
def test_dp_serving_lock_step_speculating_on_the_static_path():
    """Speculation over the lock step with the static decode path (tiny-v4.1-dspark, every draft verified,
    --deterministic): decode steps replay their buckets on both ranks, a verify step runs eagerly on every rank
    (DPModel builds decode steps only), no step is foreseen (any may verify), and the tokens are those of the same
    lock step without speculation."""
    opts = dict(deterministic=True, forced_drafts=False)
    (plain, _, plain_kinds), _ = spawn(2, _serve_rank, False, "tiny-v4.1-dspark", opts, device="cpu")
    spec = dict(opts, speculative="dspark", spec_adaptive=False)
    (tokens, status, kinds0), kinds1 = spawn(2, _serve_rank, False, "tiny-v4.1-dspark", spec, device="cpu")
    assert tokens == plain and status["unfinished"] == [0, 0]
    assert plain_kinds["foreseen"] > 0 and kinds0["foreseen"] == kinds1["foreseen"] == 0
    for kinds in (kinds0, kinds1):  # both ranks: the same steps, some static (decode), more eager (verify)
        assert kinds["static"] + kinds["idle_static"] == kinds0["static"] + kinds0["idle_static"] > 0
        assert kinds["eager"] + kinds["idle_eager"] == kinds0["eager"] + kinds0["idle_eager"]
    assert kinds0["eager"] + kinds0["idle_eager"] > plain_kinds["eager"] + plain_kinds["idle_eager"]
