"""Speculative verify steps on the static path (mini/engine/cuda_graphs.py: one graph per bucket of n sequences x
width 1 + k rows): the engine's output equals plain decode's bit for bit, tokens and logprobs (CPU, fp32, the kernels'
deterministic mode, where DecodeGraphs.replay runs the static step eagerly: the whole input preparation, the
padding of short drafts and of sequences, the real rows' logits, the kept draft rows and `commit_drafts` are the
graph's). The drafters are mini.testing's oracle with test_speculative's plan (every accept length 0..K, the
118-token prompt crosses the ring's wrap at 128, blocks of 16 and the ratio-2 groups), cut to draft lengths that
differ within a step, and DSpark (whose drafts read the target features a static step leaves: they must be the
eager step's). gpu-marked: real graph replays of verify steps equal the eager engine."""
import pytest
import torch
from test_speculative import GREEDY, K, OPTS, PLAN, PROMPTS, _same

import mini.engine.model_runner as runner_module
from mini.engine import LLM
from mini.testing.oracle_drafter import OracleDrafter

LENGTHS = [5, 2, 0, 4, 1, 3, 5, 0]  # the oracle's drafts cut to these lengths in turn: a step mixes them


class CutDrafter(OracleDrafter):
    """The oracle, each draft cut to the next of LENGTHS (0: none: that sequence's chunk is a plain decode row)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cuts = 0

    def propose(self, cache, commits):
        drafts = []
        for d in super().propose(cache, commits):
            if d:
                d = d[:LENGTHS[self.cuts % len(LENGTHS)]]
                self.cuts += 1
            drafts.append(d)
        return drafts


class Recorder:
    """Wraps a drafter and records each draft it proposes (with the cache end it was made at): on the host
    (`propose`) and on its static draft step (the drafts it reads back; a step where no sequence wants one reads
    none, so only those that want one are recorded)."""

    def __init__(self, drafter):
        self.drafter, self.max_draft, self.min_confidence, self.drafts = drafter, drafter.max_draft, 0.0, []

    def record(self, commits, out):
        self.drafts += [(c.end, list(d)) for c, d in zip(commits, out) if c.anchor is not None and c.max_draft]
        return out

    def propose(self, cache, commits):
        return self.record(commits, self.drafter.propose(cache, commits))

    def static_draft(self, static, cache):
        step = self.drafter.static_draft(static, cache)
        if step is not None:
            drafts = step.drafts
            step.drafts = lambda commits: self.record(commits, drafts(commits))
        return step


def _draft_buckets(graphs) -> list[tuple[int, int]]:
    """The buckets (n, width) of each static draft step the graphs run from now on."""
    buckets, draft = [], graphs.draft

    def counted(n, width, commits):
        buckets.append((n, width))
        return draft(n, width, commits)

    graphs.draft = counted
    return buckets


def _dspark_llm(monkeypatch=None, **opts):
    """An LLM of tiny-v4.1-dspark speculating with its DSpark drafter wrapped in a Recorder (the static path when
    `monkeypatch` is given); returns it and the recorder."""
    from mini.model.load import load_model
    if monkeypatch is not None:
        monkeypatch.setattr(runner_module, "use_cuda_graphs", lambda *a: True)
    model, config, tokenizer = load_model("tiny-v4.1-dspark", device=opts["device"], dtype=opts["dtype"])
    recorder = Recorder(model.drafter)
    return LLM(model, config=config, tokenizer=tokenizer, drafter=recorder, **opts), recorder


@pytest.fixture(scope="module")
def plain(kernels_deterministic):
    return LLM("tiny-v4.1", **OPTS, num_blocks=64, max_num_seqs=4).generate(PROMPTS, GREEDY)


def _static_engine(monkeypatch, model="tiny-v4.1", **opts):
    """An LLM whose decode and verify steps take the static path (the CUDA-graph buffers; on the CPU no capture)."""
    monkeypatch.setattr(runner_module, "use_cuda_graphs", lambda *a: True)
    llm = LLM(model, **{**OPTS, "num_blocks": 64, "max_num_seqs": 4, **opts})
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    widths = []
    replay = graphs.replay

    def counted(n, n_real, width=1):
        widths.append((n, n_real, width))
        return replay(n, n_real, width)

    graphs.replay = counted
    return llm, widths


@pytest.mark.parametrize("cut", [False, True], ids=["full-drafts", "mixed-lengths"])
def test_static_verify_steps_equal_plain_decode_bitwise(plain, monkeypatch, cut):
    """Greedy speculation (K = 5) with every verify step on the static path == plain decode, bit for bit, the
    verify steps' widths up to 1 + K. Full drafts: the three sequences verify together in a bucket of 4 (a padding
    sequence). Mixed lengths: the 118-token prompt is prefilled in chunks (a budget of 24) beside the others' eager
    verify chunks, then the sequences verify alone and together with drafts of different lengths (padding rows
    inside a sequence)."""
    futures = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    drafter = (CutDrafter if cut else OracleDrafter)(futures, PLAN, 512)
    # the acceptance rule off: every draft as long as the plan's, whatever its misses (the widths up to 1 + K)
    llm, replays = _static_engine(monkeypatch, drafter=drafter, spec_tokens=K, spec_adaptive=False,
                                  **({"max_num_batched_tokens": 24} if cut else {}))
    assert llm.engine.runner.graphs.widths == list(range(1, K + 2))
    _same(llm.generate(PROMPTS, GREEDY), plain)
    verify = [r for r in replays if r[2] > 1]
    assert verify and max(r[2] for r in verify) == 1 + K, replays
    if cut:
        assert drafter.cuts > 10
    else:
        lengths = llm.engine.stats.spec.accept_lengths
        assert len(lengths) == K + 1 and all(n > 0 for n in lengths), lengths  # every accept length 0..K happened
        assert any(n > n_real for n, n_real, _ in verify), replays  # padding sequences


def test_static_verify_under_preemption_and_after_a_prefix_hit(plain, monkeypatch):
    """On the static path: two sequences in 2 blocks of 16 (the second is preempted as its verify chunks grow it
    and recomputed), and a prompt that restores a prefix-cache snapshot (rings, compressor state) before verifying,
    both == plain decode bit for bit."""
    futures = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    llm, replays = _static_engine(monkeypatch, drafter=OracleDrafter(futures, PLAN, 512), spec_tokens=K,
                                  num_blocks=2, enable_prefix_caching=False)
    _same(llm.generate(PROMPTS[:2], GREEDY), plain[:2])
    assert llm.engine.stats.preemptions > 0 and any(w > 1 for _, _, w in replays)
    prompts = [PROMPTS[2][:16] + PROMPTS[0], PROMPTS[2][:16] + PROMPTS[1][:2]]
    ref = LLM("tiny-v4.1", **OPTS, num_blocks=64, enable_prefix_caching=False).generate(prompts, GREEDY)
    drafter = OracleDrafter({tuple(p): o.token_ids for p, o in zip(prompts, ref)}, PLAN, 512)
    llm, replays = _static_engine(monkeypatch, drafter=drafter, spec_tokens=K, max_num_seqs=1,
                                  snapshot_prompt_end=True)
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 16] and any(w > 1 for _, _, w in replays)
    _same(outs, ref)


def test_dspark_on_the_static_path_drafts_what_the_eager_path_drafts(kernels_deterministic, monkeypatch):
    """tiny-v4.1-dspark: DSpark's drafts read the target features of each step's committed rows; on the static
    path (padded rows, the features kept in the buffers and handed back in row order) they are the eager path's,
    draft for draft, and the output is plain decode's. Full drafts every step (no acceptance rule: the random draft
    module's drafts fail, and the rule would soon stop them, leaving nothing to compare)."""
    opts = dict(OPTS, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=24)
    plain = LLM("tiny-v4.1-dspark", **opts).generate(PROMPTS, GREEDY)
    eager, rec_eager = _dspark_llm(**opts, spec_adaptive=False)
    _same(eager.generate(PROMPTS, GREEDY), plain)
    static, rec_static = _dspark_llm(monkeypatch, **opts, spec_adaptive=False)
    buckets = _draft_buckets(static.engine.runner.graphs)
    _same(static.generate(PROMPTS, GREEDY), plain)
    assert any(w > 1 for _, w in buckets)  # drafts after verify steps came from the static draft step
    assert rec_static.drafts == rec_eager.drafts and any(d for _, d in rec_eager.drafts)


@pytest.mark.gpu
@pytest.mark.gpu_alone  # 3 engines, 18 graph captures: beside 7 other workers its capture was invalidated
def test_verify_graphs_on_cuda_equal_eager_gpu(kernels_deterministic):
    """bf16, fast backend, the kernels' deterministic mode (a row's result does not depend on its step's rows):
    speculation (the oracle, K = 5, draft lengths that differ within a step) with verify steps replaying CUDA graphs
    gives plain decode's tokens and logprobs (plain decode on graphs), and so does the same engine with
    enforce_eager; every (bucket, width) was captured and verify graphs were replayed."""
    from mini.ops import set_backend
    set_backend("fast")
    opts = dict(device="cuda", dtype=torch.bfloat16, max_num_seqs=4, block_tokens=128, max_model_len=1024)
    plain = LLM("tiny-v4.1", **opts).generate(PROMPTS, GREEDY)
    futures = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    graphs_llm = LLM("tiny-v4.1", **opts, drafter=CutDrafter(futures, PLAN, 512), spec_tokens=K)
    graphs = graphs_llm.engine.runner.graphs
    assert sorted(graphs.graphs) == [(1, 1024), (2, 1024), (4, 1024)]  # decode steps, as without speculation
    assert sorted(graphs.verify_graphs) == [(n, w, 1024) for n in (1, 2, 4) for w in range(2, K + 2)]
    replays = []
    replay = graphs.replay

    def counted(n, n_real, width=1):
        replays.append(width)
        return replay(n, n_real, width)

    graphs.replay = counted
    _same(graphs_llm.generate(PROMPTS, GREEDY), plain)
    assert any(w > 1 for w in replays)
    eager = LLM("tiny-v4.1", **opts, drafter=CutDrafter(futures, PLAN, 512), spec_tokens=K, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    _same(eager.generate(PROMPTS, GREEDY), plain)


class _Static:
    """Just the sizes DecodeGraphs reads of a model's static buffers."""
    max_seqs, max_rows, max_len, device = 256, 1 + K, 4096, torch.device("cpu")


def test_verify_buckets_follow_the_row_budget():
    """With a verify-row budget R, bucket n is captured at the widths the fewest sequences it takes can reach
    (R // (the bucket below + 1), at most 1 + K), so graphs and the shared logits stay bounded; a step wider than
    its bucket's graphs does not fit (it runs eagerly)."""
    from mini.engine.cuda_graphs import DecodeGraphs
    graphs = DecodeGraphs(None, None, _Static(), verify_rows=384)
    top = {n: max(graphs.bucket_widths(n)) for n in graphs.sizes}
    assert top[1] == top[64] == 1 + K and top[80] == 5 and top[96] == 4 and top[128] == 3 and top[192] == 2
    assert top[208] == top[256] == 1
    verify = [(n, w) for n in graphs.sizes for w in graphs.bucket_widths(n) if w > 1]
    assert len(verify) == 55 and max(n * w for n, w in verify) == 400
    assert len([w for n in graphs.sizes for w in DecodeGraphs(None, None, _Static()).bucket_widths(n) if w > 1]) == 100

    class Chunk:  # a ScheduledChunk as fits reads it
        def __init__(self, drafts):
            self.length, self.drafts, self.samples = 1 + drafts, drafts, True

    assert graphs.fits([Chunk(5)] * 64) and graphs.width([Chunk(5)] + [Chunk(0)] * 63) == 1 + K
    assert graphs.width([Chunk(2)] * 3) == 3 and graphs.width([Chunk(0)] * 3) == 1
    assert graphs.fits([Chunk(4)] * 70) and not graphs.fits([Chunk(5)] * 70)  # bucket 80: widths up to 5
    assert graphs.fits([Chunk(0)] * 256) and not graphs.fits([Chunk(1)] * 200)
    prefill = Chunk(0)
    prefill.length = 7  # a chunk of 7 prompt tokens: not a verify chunk
    assert not graphs.fits([Chunk(1), prefill])
