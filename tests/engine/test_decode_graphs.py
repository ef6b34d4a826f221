"""Decode steps through static buffers (the path CUDA graphs capture) give the tokens the eager path gives.

On CPU the static path runs without capture (DecodeGraphs replays eagerly there), so the whole input preparation
(last tokens, positions, padded block tables, batched Engram hashing and lookup, scratch slot and block) is tested
here; the gpu-marked test compares real graph replays with enforce_eager."""
import random

import numpy as np
import pytest
import torch

import mini.engine.model_runner as runner_module
from mini.checkpoint.tiny_tokenizer import build_tiny_tokenizer
from mini.config import preset
from mini.engine import LLM, SamplingParams
from mini.engine.cuda_graphs import buckets
from mini.ops.engram import EngramHasher
from mini.tokenizer import compressed_token_map

# lengths around the window (128) and the ratio-2 groups, a 1-token prompt, a prompt shorter than the n-gram size
LENGTHS = [126, 1, 63, 3, 140]


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def test_hash_last_equals_hash_ids_of_the_last_position():
    cfg = preset("tiny-v4.1")
    hasher = EngramHasher(cfg, compressed_token_map(build_tiny_tokenizer(cfg.vocab_size)))
    rng, k = random.Random(1), hasher.lookback
    # dead tokens (-1, image spans) and histories shorter than the n-gram size
    histories = [[-1 if rng.random() < 0.15 else rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 9))]
                 for _ in range(300)]
    tails = np.full((len(histories), k), -1, dtype=np.int64)
    for b, h in enumerate(histories):
        tails[b, k - len(h[-k:]):] = h[-k:]
    want = torch.cat([hasher.hash_ids(h, len(h) - 1, len(h)) for h in histories])
    assert torch.equal(hasher.hash_last(tails), want)


def test_buckets():
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets(5) == [1, 2, 4, 5] and buckets(1) == [1] and buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def _generate(static: bool, monkeypatch, prompts, max_tokens):
    monkeypatch.setattr(runner_module, "use_cuda_graphs", lambda *a: static)
    llm = LLM("tiny-v4.1", device="cpu", dtype=torch.float32, num_blocks=64, block_tokens=16, max_num_seqs=8)
    llm.engine.step_times = []
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs], llm.engine


def test_static_decode_path_equals_eager_on_cpu(monkeypatch):
    """5 sequences in a bucket of 8 (3 padding rows), 6 decode steps: group closings on alternate steps, the
    126-token prompt wraps its ring, the 1- and 3-token prompts hash with fewer than n-gram-size predecessors."""
    prompts = _prompts(LENGTHS)
    eager, eager_engine = _generate(False, monkeypatch, prompts, 7)
    static, engine = _generate(True, monkeypatch, prompts, 7)
    assert static == eager
    assert eager_engine.runner.graphs is None and not any(t.graph for t in eager_engine.step_times)
    graph_steps = [t for t in engine.step_times if t.graph]
    assert len(graph_steps) == 6 and all(t.decode and t.n_seqs == 5 for t in graph_steps)
    # the padding rows wrote only into the scratch slot / block, past what the block manager hands out
    cache, shape = engine.runner.cache, engine.runner.shape
    assert cache.n_slots == shape.n_slots + 1 and cache.n_blocks == shape.n_blocks + 1


def test_static_steps_take_the_shortest_span_that_holds_them(monkeypatch):
    """Spans from 1,024 (mini.engine.cuda_graphs.spans; 4,096 in use, tiny-v4.1's whole context here): buffers of
    4,096 positions get spans 1,024 and 4,096; short sequences decode at the 1,024 span, a batch with a sequence
    past it at the 4,096 one, and both give the eager tokens."""
    import mini.engine.cuda_graphs as graphs_module
    monkeypatch.setattr(graphs_module, "SPAN_BASE", 1024)
    prompts = _prompts([50, 1100, 7], seed=3)
    runs, spans = {}, []
    for static in (False, True):
        monkeypatch.setattr(runner_module, "use_cuda_graphs", lambda *a, static=static: static)
        llm = LLM("tiny-v4.1", device="cpu", dtype=torch.float32, num_blocks=300, block_tokens=16, max_num_seqs=4)
        graphs = llm.engine.runner.graphs
        if static:
            assert graphs.spans == [1024, 4096]
            replay, positions = graphs.replay, graphs.static.buffers.host_ids[1]

            def spy(n, n_real, *a, **kw):  # (the span prepare kept, the step's longest sequence end)
                spans.append((graphs.span, int(positions[:n_real].max()) + 1))
                return replay(n, n_real, *a, **kw)
            monkeypatch.setattr(graphs, "replay", spy)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        runs[static] = [[o.token_ids for o in llm.generate(p, params)] for p in (prompts[::2], prompts)]
    assert runs[True] == runs[False]
    assert {s for s, _ in spans} == {1024, 4096}, spans
    assert all(s == (1024 if end <= 1024 else 4096) for s, end in spans), spans


def test_a_capture_out_of_memory_says_what_to_lower(monkeypatch):
    """A graph whose capture runs out of GPU memory stops the start-up with the bucket and the options that shrink
    it (the graphs' memory is not in the cache's budget; a 1M span's verify graphs did this, docs/perf/042)."""
    monkeypatch.setattr(runner_module, "use_cuda_graphs", lambda *a: True)
    llm = LLM("tiny-v4.1", device="cpu", dtype=torch.float32, num_blocks=300, block_tokens=16, max_num_seqs=4)
    graphs = llm.engine.runner.graphs
    captured = []

    def capture(n, width, span):  # the longest span's largest bucket fails, as on the GPU
        if span == max(graphs.spans) and n == max(graphs.sizes):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.25 GiB")
        captured.append((n, width, span))
    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(graphs.static, "device", torch.device("cuda"))  # capture_all captures on CUDA only
    with pytest.raises(torch.OutOfMemoryError, match=r"4 sequences x 1 rows over 4096 positions.*--max-model-len"):
        graphs.capture_all()
    assert captured == []  # the largest bucket's longest span goes first


def test_step_times_split_a_step(monkeypatch):
    _, engine = _generate(False, monkeypatch, _prompts([5, 9]), 3)
    t = engine.step_times
    assert [s.decode for s in t] == [False, True, True] and all(s.gpu_s is None for s in t)
    for s in t:
        assert 0 < s.schedule_s + s.prepare_s + s.forward_s + s.sample_s <= s.total_s


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager():
    """bf16, fast backend: real graph replays == enforce_eager, for a full bucket (8) and a padded one (5 in 8)."""
    from mini.ops import set_backend
    set_backend("fast")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for lengths in ([64, 70, 90, 100, 127, 150, 181, 200], [66, 129, 80, 101, 77]):
        prompts = _prompts(lengths, seed=len(lengths))
        runs = {}
        for eager in (True, False):
            llm = LLM("tiny-v4.1", device="cuda", dtype=torch.bfloat16, max_num_seqs=8, block_tokens=128,
                      max_model_len=1024, enforce_eager=eager)
            llm.engine.step_times = []
            runs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
            graph_steps = sum(t.graph for t in llm.engine.step_times)
            assert graph_steps == (0 if eager else 23), graph_steps
            if not eager:
                assert sorted(llm.engine.runner.graphs.graphs) == [(n, 1024) for n in (1, 2, 4, 8)]  # one span
        assert runs[False] == runs[True]
