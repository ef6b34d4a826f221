"""DSpark's draft step over fixed buffers (mini.model.dspark_drafter.StaticDSparkDraft; mini/engine/cuda_graphs.py
captures it per bucket after the steps' graphs): equal to the eager drafter (DSparkDrafter.propose) bit for bit,
drafts, confidences and every ring row, on the CPU in fp32 under the kernels' deterministic mode, where the static
step runs eagerly (the whole input preparation, the mask over accepted counts, the scratch slot's rows and the
padding sequences are the graphs'). A decode step's ring write, part of the decode step's own forward: the rings it
leaves equal those of the separate draft step's write, and plain steps on the static path run no draft step.
gpu-marked: the engine with the draft step on CUDA graphs == enforce_eager == plain decode, tokens and logprobs,
the draft graphs replayed; plain steps on CUDA graphs replay no draft graph."""
import pytest
import torch
from test_speculative import GREEDY, K, OPTS, PLAN, PROMPTS, _same
from test_verify_graphs import CutDrafter, _draft_buckets, _dspark_llm

import mini.engine.model_runner as runner_module
from mini.engine import LLM, SamplingParams
from mini.engine.cuda_graphs import DecodeGraphs
from mini.model.dspark import propose
from mini.model.dspark_drafter import wants_draft
from mini.model.load import load_model
from mini.step import Commit, DecodeRows
from mini.testing.oracle_drafter import OracleDrafter

SLOTS = 6  # sequence slots of the unit test's cache; slot SLOTS is the scratch slot
W = 128  # tiny-v4.1-dspark's window (the rings' length)


@pytest.fixture(scope="module")
def model(kernels_deterministic):
    return load_model("tiny-v4.1-dspark", device="cpu", dtype=torch.float32)[0]


# per real sequence of a static step: (slot, its first row's position, drafts, accepted, max_draft)
CASES = {
    # a verify step of width 1 + K in a bucket of 4 (one padding sequence): accept lengths 5, 0, 2; the first
    # sequence's rows cross the ring's wrap at 128, the third has padding rows after its 3 drafts
    "verify": (4, 1 + K, [(2, 125, 5, 5, K), (0, 7, 5, 0, K), (4, 300, 3, 2, K)], 0.0),
    # accept lengths 1, 3, 4; a sequence that wants no draft (finished: max_draft 0); the confidence cut on
    "verify-cut": (4, 1 + K, [(5, 60, 4, 1, K), (1, 250, 3, 3, 2), (3, 126, 5, 4, 0)], 0.5),
    # a decode step (width 1) of 2 sequences in a bucket of 4
    "decode": (4, 1, [(1, 127, 0, 0, K), (5, 40, 0, 0, 2)], 0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_static_draft_step_equals_the_eager_drafter_bitwise(model, case):
    """The static step's rows, the accepted ones written to their sequences' rings and the others to the scratch
    slot, then drafts for the whole bucket: its drafts and confidences equal the eager drafter's (which takes the
    committed rows alone, in chunk order) and so does every ring row of every sequence slot; committed rows did
    change their ring entries and rejected ones did not."""
    n, width, seqs, min_confidence = CASES[case]
    cfg, g = model.config, torch.Generator().manual_seed(0)
    eager_cache = model.new_cache(SLOTS + 1, 8, 16, "cpu", torch.float32)
    for ring in eager_cache.draft.rings:
        ring.copy_(torch.randn(ring.shape, generator=g))
    static_cache = model.new_cache(SLOTS + 1, 8, 16, "cpu", torch.float32)
    for ring, eager_ring in zip(static_cache.draft.rings, eager_cache.draft.rings):
        ring.copy_(eager_ring)
    before = [r.clone() for r in eager_cache.draft.rings]
    static = model.static_decode(4, 1024, 16, pad_slot=SLOTS, pad_block=8, device="cpu", dtype=torch.float32,
                                 max_rows=1 + K)
    features = torch.randn(4 * (1 + K), len(cfg.dspark_target_layers) * cfg.dim, generator=g)
    static.buffers.kept["target_features"] = features  # as a static step's forward leaves them (row b·width + i)
    commits = [Commit(rows=1 + a, length=1 + d, slot=s, end=p + 1 + a, anchor=11 + 37 * b, max_draft=m,
                      history=lambda: []) for b, (s, p, d, a, m) in enumerate(seqs)]

    eager, static_drafter = model.drafter, model.drafter
    eager.min_confidence = static_drafter.min_confidence = min_confidence
    model.target_features = torch.cat([features[b * width:b * width + 1 + d] for b, (_, _, d, _, _) in
                                       enumerate(seqs)])  # the eager step's rows: each chunk's 1 + d, in order
    want_eager = eager.propose(eager_cache, commits)
    want = [b for b, c in enumerate(commits) if wants_draft(c)]
    t = torch.tensor
    reference = propose(model.dspark, cfg, model.embed, model.head, eager_cache.draft,
                        t([commits[b].anchor for b in want]), t([commits[b].end - 1 for b in want]),
                        t([commits[b].slot for b in want]))  # the eager drafter's own draft, for its confidences

    step = static_drafter.static_draft(static, static_cache)
    step.fill(n, commits)
    step.write(n, width)
    step.propose(n)
    assert step.drafts(commits) == want_eager and any(want_eager)
    assert torch.equal(step.ids[want], reference.ids) and torch.equal(step.confidence[want], reference.confidence)
    for ring, eager_ring, old in zip(static_cache.draft.rings, eager_cache.draft.rings, before):
        assert torch.equal(ring[:SLOTS], eager_ring[:SLOTS])
        for s, p, d, a, _ in seqs:
            for i in range(width):
                assert torch.equal(ring[s, (p + i) % W], old[s, (p + i) % W]) == (i > a), (s, p + i)


def test_decode_step_writes_the_rings_the_draft_step_wrote(model):
    """A static decode step of a speculating engine's graphs (`DecodeGraphs` with DSpark's static draft step; on
    the CPU the step runs eagerly, as captured) writes its rows into DSpark's rings within its own forward
    (`StaticDSparkDraft.write_decode`): every ring row of every slot, the scratch slot's included, equals what the
    same step without a drafter followed by the separate draft step's write (`fill`, `write(n, 1)`) leaves, bit
    for bit; the real rows did land in their slots. The draft step after it then runs nothing."""
    n, seqs = 4, [(1, 130), (5, 40), (3, 127)]  # (slot, position): across the ring's wrap, a padding sequence
    blocks, first = [], 0
    for _, p in seqs:
        blocks.append(list(range(first, first + p // 16 + 1)))
        first += len(blocks[-1])
    g = torch.Generator().manual_seed(1)
    caches = [model.new_cache(SLOTS + 1, first + 1, 16, "cpu", torch.float32) for _ in range(2)]
    for rings in zip(*(c.draft.rings for c in caches)):
        start = torch.randn(rings[0].shape, generator=g)
        for ring in rings:
            ring.copy_(start)
    before = [r.clone() for r in caches[0].draft.rings]
    static = model.static_decode(n, 1024, 16, pad_slot=SLOTS, pad_block=first, device="cpu", dtype=torch.float32,
                                 max_rows=1 + K)
    rows = DecodeRows([p for _, p in seqs], [s for s, _ in seqs], blocks,
                      lambda b, start, end: [(7 * b + i) % 300 + 1 for i in range(start, end)])
    commits = [Commit(rows=1, length=1, slot=s, end=p + 1, anchor=None, max_draft=0, history=lambda: [])
               for s, p in seqs]

    folded = DecodeGraphs(model, caches[0], static, drafter=model.drafter)
    static.fill(n, rows)
    folded.replay(n, len(seqs))
    assert folded.draft(n, 1, commits) == [[]] * len(seqs) and folded.draft_steps == 0
    features = static.buffers.kept["target_features"][:n].clone()

    separate = DecodeGraphs(model, caches[1], static)  # no drafter: the decode step's forward alone
    assert separate.draft_step is None
    static.fill(n, rows)
    separate.replay(n, len(seqs))
    assert torch.equal(static.buffers.kept["target_features"][:n], features)
    step = model.drafter.static_draft(static, caches[1])
    step.fill(n, commits)
    step.write(n, 1)

    for ring, want, old in zip(caches[0].draft.rings, caches[1].draft.rings, before):
        assert torch.equal(ring, want)
        for s, p in seqs:
            assert not torch.equal(ring[s, p % W], old[s, p % W])


# three sequences under a load rule of 5 rows: while all three decode nobody drafts (plain steps), then the last
# one drafts 4 tokens a step
PLAIN_PROMPTS = [PROMPTS[0], [9, 8, 7, 6, 5], PROMPTS[1]]
PLAIN_PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (10, 12, 20)]
PLAIN_SPEC = dict(spec_max_rows=5, spec_adaptive=False, spec_tokens=4)


def _watch_plain_steps(llm) -> list:
    """From now on, per plain step of `llm` (`Speculation.plain_step`): its step's graph bucket (None: eager) and
    whether a draft step ran in it (a `fill`, a static draft step or a draft graph's replay)."""
    spec, runner, graphs = llm.engine.spec, llm.engine.runner, llm.engine.runner.graphs
    fills, seen, plain_step, fill = [0], [], spec.plain_step, graphs.draft_step.fill

    def counted_fill(*args):
        fills[0] += 1
        return fill(*args)

    def watched(plan):
        before = (fills[0], graphs.draft_steps, graphs.draft_replays)
        plain_step(plan)
        seen.append((runner.last_static, (fills[0], graphs.draft_steps, graphs.draft_replays) != before))

    graphs.draft_step.fill, spec.plain_step = counted_fill, watched
    return seen


def test_plain_steps_on_the_static_path_run_no_draft_step(kernels_deterministic, monkeypatch):
    """tiny-v4.1-dspark speculating with DSpark on the static path (PLAIN_*): the plain steps take their rows into
    DSpark's rings through the decode step's own forward (`write_decode`), with no fill and no draft step, and no
    decode step writes through the draft step (`write(n, 1)`); the rings equal the eager engine's after every
    step (whose drafter writes them after each step, `propose`), DSpark's drafts once one sequence is left equal
    the eager engine's, and the outputs are plain decode's."""
    opts = dict(OPTS, num_blocks=32, max_num_seqs=4, overlap=False)
    plain = LLM("tiny-v4.1-dspark", **opts).generate(PLAIN_PROMPTS, PLAIN_PARAMS)
    eager, rec_eager = _dspark_llm(**opts, **PLAIN_SPEC)
    static, rec_static = _dspark_llm(monkeypatch, **opts, **PLAIN_SPEC)
    step, writes = static.engine.runner.graphs.draft_step, []
    for name in ("write", "write_decode"):
        def spied(*args, name=name, f=getattr(step, name)):
            writes.append((name, *args))
            return f(*args)
        setattr(step, name, spied)
    seen = _watch_plain_steps(static)
    _same(_lockstep(eager, static, PLAIN_PROMPTS, PLAIN_PARAMS), plain)
    assert rec_static.drafts == rec_eager.drafts and any(d for _, d in rec_eager.drafts)
    on_static = [ran for bucket, ran in seen if bucket is not None]
    assert len(on_static) >= 8 and not any(on_static), seen
    assert not [w for w in writes if w[0] == "write" and w[2] == 1], writes
    assert sum(w[0] == "write_decode" for w in writes) >= len(on_static)
    assert any(w[0] == "write" for w in writes)  # the verify steps' writes stay the draft step's


class DSparkUnderOracle:
    """A drafter whose ring writes and drafts are DSpark's (recorded: `dspark_drafts`) but whose proposals are an
    oracle's (`oracle`), so every accept length 0..K, drafts of different lengths and steps without drafts (width
    1) happen while DSpark's state follows the committed rows: eager through `propose`, on the static path
    through DSpark's static draft step."""

    def __init__(self, dspark, oracle, min_confidence: float = 0.5):
        self.dspark, self.oracle, self.dspark_drafts = dspark, oracle, []
        self.max_draft, self.min_confidence = K, 0.0
        dspark.min_confidence = min_confidence  # its drafts are cut (and recorded) as the engine would cut them

    def record(self, commits, drafts) -> None:
        self.dspark_drafts += [(c.end, d) for c, d in zip(commits, drafts) if wants_draft(c)]

    def propose(self, cache, commits):
        self.record(commits, self.dspark.propose(cache, commits))
        return self.oracle.propose(cache, commits)

    def static_draft(self, static, cache):
        step = self.dspark.static_draft(static, cache)
        drafts = step.drafts

        def oracle_drafts(commits):  # (read only where a sequence wants a draft, as the eager path proposes)
            self.record(commits, drafts(commits))
            return self.oracle.propose(cache, commits)

        step.drafts = oracle_drafts
        return step


def _engine(oracle, monkeypatch=None, **opts):
    """tiny-v4.1-dspark speculating with DSpark under `oracle` (the static path when `monkeypatch` is given)."""
    if monkeypatch is not None:
        monkeypatch.setattr(runner_module, "use_cuda_graphs", lambda *a: True)
    model, config, tokenizer = load_model("tiny-v4.1-dspark", device=opts["device"], dtype=opts["dtype"])
    drafter = DSparkUnderOracle(model.drafter, oracle)
    return LLM(model, config=config, tokenizer=tokenizer, drafter=drafter, spec_tokens=K, **opts), drafter


def _lockstep(eager: LLM, static: LLM, prompts, params) -> list:
    """Both engines step by step over the same requests (`params`: for all, or a list: one per prompt); after
    every step DSpark's rings of every sequence slot are equal bit for bit. Returns the static engine's outputs in
    prompt order."""
    for i, p in enumerate(prompts):
        eager.engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
        static.engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    final, steps = {}, 0
    while eager.engine.has_work():
        eager.engine.step()
        final |= {o.request_id: o for o in static.engine.step() if o.finished}
        steps += 1
        for e, s in zip(eager.engine.runner.cache.draft.rings, static.engine.runner.cache.draft.rings):
            assert torch.equal(e, s[:e.shape[0]]), f"DSpark's rings differ after step {steps}"
    assert not static.engine.has_work()
    return [final[str(i)] for i in range(len(prompts))]


HIT_PROMPTS = [PROMPTS[2][:16] + PROMPTS[0], PROMPTS[2][:16] + PROMPTS[1][:2]]
SCENARIOS = {  # prompts, drafter (cut or not), engine options
    # every accept length (full drafts: the cost model's rule would shorten them by its measured STEP_COSTS); a
    # padding sequence in the bucket of 4
    "together": (PROMPTS, OracleDrafter, {"spec_adaptive": False}),
    "mixed": (PROMPTS, CutDrafter, {"max_num_batched_tokens": 24}),  # with prefill chunks and eager steps
    "alone": (PROMPTS, CutDrafter, {"max_num_seqs": 1}),  # steps without a draft: width 1
    "preempted": (PROMPTS[:2], OracleDrafter, {"num_blocks": 2, "enable_prefix_caching": False}),
    "prefix-hit": (HIT_PROMPTS, OracleDrafter, {"max_num_seqs": 1, "snapshot_prompt_end": True}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_engine_static_draft_steps_equal_the_eager_drafter(kernels_deterministic, monkeypatch, scenario):
    """The engine on the static path (decode and verify steps, and DSpark's draft step after them, over the
    graphs' buffers) against the eager engine, step by step: DSpark's rings equal after every step, its drafts
    equal, and the outputs are plain decode's; under preemption (recomputed rings) and after a prefix-cache hit
    (a snapshot's rings) too."""
    prompts, oracle, extra = SCENARIOS[scenario]
    opts = dict(OPTS, num_blocks=64, max_num_seqs=4) | extra
    plain = LLM("tiny-v4.1-dspark", **dict(opts, num_blocks=64)).generate(prompts, GREEDY)
    futures = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    eager, eager_drafter = _engine(oracle(futures, PLAN, 512), **opts)
    static, static_drafter = _engine(oracle(futures, PLAN, 512), monkeypatch, **opts)
    buckets = _draft_buckets(static.engine.runner.graphs)
    outs = _lockstep(eager, static, prompts, GREEDY)
    _same(outs, plain)
    assert static_drafter.dspark_drafts == eager_drafter.dspark_drafts and static_drafter.dspark_drafts
    assert any(w > 1 for _, w in buckets), buckets
    lengths = static.engine.stats.spec.accept_lengths
    if scenario == "together":
        assert all(lengths) and any(n > 3 for n, _ in buckets), (lengths, buckets)  # every accept length; padding
    if scenario == "alone":
        assert any(w == 1 for _, w in buckets), buckets
    if scenario == "preempted":
        assert static.engine.stats.preemptions > 0
    if scenario == "prefix-hit":
        assert [o.num_cached_tokens for o in outs] == [0, 16]


@pytest.mark.gpu
def test_draft_graphs_on_cuda_equal_eager_and_plain_decode_gpu(kernels_deterministic):
    """bf16, fast backend, the kernels' deterministic mode: DSpark speculating with its draft step on CUDA graphs
    (captured beside the verify graphs: a write per (bucket, width), a draft per bucket) gives plain decode's tokens
    and logprobs, and so does the same engine with enforce_eager; the draft graphs were replayed and DSpark drafted
    the same drafts on both. Then DSpark under the oracle (every accept length 0..K, draft lengths that differ
    within a step), graphs against enforce_eager step by step: its rings equal after every step."""
    from mini.ops import set_backend
    set_backend("fast")
    opts = dict(device="cuda", dtype=torch.bfloat16, max_num_seqs=4, block_tokens=128, max_model_len=1024)
    plain = LLM("tiny-v4.1-dspark", **opts).generate(PROMPTS, GREEDY)
    # overlap off, as the eager engine's: overlapped steps foresee who drafts before the step in flight is read
    # back (a sequence it ends still counts), so near a sequence's end the two engines' drafts may differ
    graphs_llm, on_graphs = _dspark_llm(**opts, overlap=False)
    graphs = graphs_llm.engine.runner.graphs
    assert sorted(graphs.write_graphs) == [(n, w) for n in (1, 2, 4) for w in range(2, K + 2)]  # (decode: its own)
    assert sorted(graphs.propose_graphs) == [1, 2, 4]
    _same(graphs_llm.generate(PROMPTS, GREEDY), plain)
    assert graphs.draft_replays > 0 and graphs.draft_steps > 0
    eager_llm, eager = _dspark_llm(**opts, enforce_eager=True)
    assert eager_llm.engine.runner.graphs is None
    _same(eager_llm.generate(PROMPTS, GREEDY), plain)
    assert on_graphs.drafts == eager.drafts and any(d for _, d in eager.drafts)
    overlapped, _ = _dspark_llm(**opts)  # the default on graphs: steps without drafts overlap
    _same(overlapped.generate(PROMPTS, GREEDY), plain)
    assert overlapped.engine.stats.overlapped_steps > 0 and overlapped.engine.stats.spec.plain_steps > 0

    futures = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    eager_llm, eager = _engine(CutDrafter(futures, PLAN, 512), **opts, enforce_eager=True)
    graphs_llm, on_graphs = _engine(CutDrafter(futures, PLAN, 512), **opts, overlap=False)  # (as above)
    replays = graphs_llm.engine.runner.graphs.draft_replays
    _same(_lockstep(eager_llm, graphs_llm, PROMPTS, GREEDY), plain)
    assert on_graphs.dspark_drafts == eager.dspark_drafts
    assert graphs_llm.engine.runner.graphs.draft_replays > replays


@pytest.mark.gpu
def test_plain_steps_on_cuda_graphs_replay_no_draft_graph_gpu(kernels_deterministic):
    """bf16, fast backend, the kernels' deterministic mode, the plain steps' workload (PLAIN_*) on CUDA graphs: the
    decode graphs write DSpark's rings themselves, so its rings equal enforce_eager's after every step, its
    drafts too, and the outputs are plain decode's, while the plain steps replay decode graphs and no draft graph
    (no fill, no static draft step); overlapped (the default on graphs) the same holds but for the rings'
    lockstep, which overlap shifts."""
    from mini.ops import set_backend
    set_backend("fast")
    opts = dict(device="cuda", dtype=torch.bfloat16, max_num_seqs=4, block_tokens=128, max_model_len=1024)
    plain = LLM("tiny-v4.1-dspark", **opts).generate(PLAIN_PROMPTS, PLAIN_PARAMS)
    eager_llm, eager = _dspark_llm(**opts, **PLAIN_SPEC, enforce_eager=True)
    graphs_llm, on_graphs = _dspark_llm(**opts, **PLAIN_SPEC, overlap=False)
    assert not [b for b in graphs_llm.engine.runner.graphs.write_graphs if b[1] == 1]
    seen = _watch_plain_steps(graphs_llm)
    _same(_lockstep(eager_llm, graphs_llm, PLAIN_PROMPTS, PLAIN_PARAMS), plain)
    assert on_graphs.drafts == eager.drafts and any(d for _, d in eager.drafts)
    on_static = [ran for bucket, ran in seen if bucket is not None]
    assert len(on_static) >= 8 and not any(on_static), seen
    assert graphs_llm.engine.runner.graphs.draft_replays > 0  # (after the verify steps)

    overlapped, _ = _dspark_llm(**opts, **PLAIN_SPEC)
    seen = _watch_plain_steps(overlapped)
    _same(overlapped.generate(PLAIN_PROMPTS, PLAIN_PARAMS), plain)
    on_static = [ran for bucket, ran in seen if bucket is not None]
    assert overlapped.engine.stats.overlapped_steps > 0 and len(on_static) >= 8 and not any(on_static), seen
