"""Overlapped decode steps (LLMEngine with overlap=True) give exactly the plain engine's outputs.

On CPU the fake model runs eagerly, so each overlapped step reads the previous step's ids back before its inputs
are built (the Engram / eager path), but everything else is the real overlap logic: one step of lag, sequences
planned while their last token is in flight, the extra token of a finished sequence discarded, its cache returned
only once the step that still computes it is read back. The device-fed path (tokens written into the static decode
buffers on the device) runs on CPU with tiny-v4's static decode step (no Engram) at the end."""
import random

import pytest
import torch

import mini.engine.llm as llm_module
import mini.engine.model_runner as runner_module
from fake_model import FakeConfig, FakeModel, fake_llm, scripted_llm
from mini.engine import LLM, SamplingParams
from mini.step import TokenFeed

EOS = FakeConfig().eos_id


class EosProneModel(FakeModel):
    """The fake model with EOS made likely, so that requests end by EOS at many different steps."""

    def forward(self, batch, cache):
        logits = super().forward(batch, cache)
        logits[:, EOS] += 6.0
        return logits


def _prompts(n, seed=0, shared=""):
    rng = random.Random(seed)
    return [shared + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 30))) for _ in range(n)]


def _run(overlap: bool, prompts, params, make=fake_llm, arrivals=None, aborts=(), **opts):
    """Step the engine by hand. `arrivals`: {step index: [prompt indices]} added before that step (default: all at
    0); `aborts`: (step index, prompt index) pairs. Returns the final outputs, the streamed pieces and the LLM."""
    llm = make(overlap=overlap, **opts)
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    arrivals = arrivals or {0: list(range(len(prompts)))}
    final, streamed, step = {}, {}, 0
    while step <= max(arrivals) or engine.has_work():
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", prompts[i], params[i])
        for s, i in aborts:
            if s == step:
                engine.abort(f"r{i}")
        for o in engine.step():
            ids, text = streamed.setdefault(o.request_id, ([], []))
            ids += o.new_token_ids
            text.append(o.new_text)
            if o.finished:
                final[o.request_id] = o
        step += 1
    return [final[f"r{i}"] for i in range(len(prompts))], streamed, llm


def _view(o):
    lps = [(t.token_id, round(t.logprob, 5), sorted(t.top)) for t in o.logprobs]
    return o.token_ids, o.text, o.finish_reason, o.stop_reason, lps


def _check_same(prompts, params, **kw):
    plain, _, plain_llm = _run(False, prompts, params, **kw)
    over, streamed, llm = _run(True, prompts, params, **kw)
    assert [_view(o) for o in over] == [_view(o) for o in plain]
    for o in over:  # what was streamed is exactly the final output: a discarded token is never emitted
        ids, text = streamed[o.request_id]
        assert ids == o.token_ids and "".join(text) == o.text
    engine = llm.engine
    assert engine.overlap and not plain_llm.engine.overlap and engine._inflight is None
    n_blocks = engine.blocks.n_blocks
    assert engine.blocks.n_free_blocks == n_blocks and len(engine.blocks.free_slots) == engine.blocks.n_seq_slots
    return plain, over, plain_llm, llm


def _eos_llm(**opts):
    return fake_llm(EosProneModel, **opts)


def test_greedy_eos_and_max_tokens_at_different_steps():
    prompts = _prompts(12, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=3 + i % 7) for i in range(12)]
    plain, over, plain_llm, llm = _check_same(prompts, params, make=_eos_llm)
    reasons = {o.finish_reason for o in plain}
    assert reasons == {"stop", "length"}, reasons
    assert len({len(o.token_ids) for o in plain}) >= 4  # finishes spread over many steps
    # sequences ended by EOS were computed one more step (discarded); length limits are known in advance
    assert sum(map(len, llm.engine.runner.model.calls)) > sum(map(len, plain_llm.engine.runner.model.calls))


def test_length_limits_cost_no_extra_step():
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    _, _, plain_llm, llm = _check_same(prompts, params)
    assert llm.engine.runner.model.calls == plain_llm.engine.runner.model.calls


def test_outputs_lag_one_step_behind_the_launch():
    llm = fake_llm(overlap=True)
    engine = llm.engine
    engine.add_request("a", "hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    first = engine.step()  # the prefill step is not overlapped: its token comes back at once
    assert [len(o.token_ids) for o in first] == [1]
    assert engine.step() == [] and engine._inflight is not None  # decode 1 in flight
    assert [len(o.token_ids) for o in engine.step()] == [2]  # decode 2 launched, decode 1 read back


def test_seeded_sampling_with_logprobs():
    prompts = _prompts(10, seed=3)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50 if i % 2 else -1, max_tokens=4 + i % 5,
                             seed=100 + i, logprobs=2 if i % 3 else None) for i in range(10)]
    _check_same(prompts, params, make=_eos_llm)


def test_penalties_run_without_overlap_and_match():
    prompts = _prompts(5, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=1.5 if i == 2 else 0)
              for i in range(5)]
    _check_same(prompts, params)


def test_stop_strings_at_different_steps():
    """The scripted output is the same text for every request, shifted by the prompt length: the stop string ends
    each request at a different step; one request never meets it and ends by length."""
    prompts = [list(range(10, 10 + n)) for n in (5, 7, 8, 10, 13)]
    params = [SamplingParams(temperature=0, max_tokens=30 if i < 4 else 3, ignore_eos=True, stop=["ld!"],
                             include_stop_str_in_output=i % 2 == 1) for i in range(5)]
    plain, *_ = _check_same(prompts, params, make=lambda **o: scripted_llm("hello world! ", 8, **o))
    assert [o.finish_reason for o in plain] == ["stop"] * 4 + ["length"]
    assert len({len(o.token_ids) for o in plain[:4]}) == 4


def test_preemption_while_tokens_are_in_flight():
    prompts = _prompts(8, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _, _, plain_llm, llm = _check_same(prompts, params, num_blocks=14, max_num_seqs=8)
    assert plain_llm.engine.stats.preemptions > 0 and llm.engine.stats.preemptions > 0


def test_prefix_caching_and_requests_arriving_mid_run():
    prompts = _prompts(9, seed=6, shared="the quick brown fox jumps ")
    params = SamplingParams(temperature=0, max_tokens=10)
    arrivals = {0: [0, 1, 2], 3: [3, 4], 4: [5], 9: [6, 7, 8]}
    _, over, _, llm = _check_same(prompts, params, make=_eos_llm, arrivals=arrivals, max_num_seqs=4)
    assert llm.engine.blocks.stats.hits > 0 and any(o.num_cached_tokens for o in over)


def test_aborts_leave_the_others_identical_and_free_the_cache():
    prompts = _prompts(6, seed=7)
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    full, _, _ = _run(False, prompts, params)
    aborts = [(4, 1), (6, 3), (7, 3)]
    plain, _, _ = _run(False, prompts, params, aborts=aborts)
    over, streamed, llm = _run(True, prompts, params, aborts=aborts)
    for i in range(6):
        if i in (1, 3):  # the aborted keep a prefix of their tokens (up to one fewer than the plain engine's)
            assert over[i].finish_reason == plain[i].finish_reason == "abort"
            assert over[i].token_ids == full[i].token_ids[:len(over[i].token_ids)]
            assert len(plain[i].token_ids) - 1 <= len(over[i].token_ids) <= len(plain[i].token_ids)
            assert streamed[f"r{i}"][0] == over[i].token_ids
        else:
            assert _view(over[i]) == _view(plain[i]) == _view(full[i])
    blocks = llm.engine.blocks
    assert blocks.n_free_blocks == blocks.n_blocks and len(blocks.free_slots) == blocks.n_seq_slots


class _LateCopy:
    """Stands in for the CUDA event after the device-to-host copy of the sampled ids: until it is waited for,
    the host copy holds garbage, as pinned memory does while the copy is in flight."""

    def __init__(self, out, host):
        self.out, self.host = out, host

    def synchronize(self):
        for src, dst in zip(vars(self.out).values(), vars(self.host).values()):
            if src is not None:
                dst.copy_(src)


def test_host_reads_sampled_ids_only_after_waiting(monkeypatch):
    """Run the CUDA read-back protocol on CPU: any read of the host ids before the wait would see garbage."""
    from mini.engine.sampler import SampleOutput

    def late_copy(out):
        host = SampleOutput(*(None if t is None else torch.full_like(t, 7) for t in vars(out).values()))
        return host, _LateCopy(out, host)

    prompts = _prompts(10, seed=11)
    params = [SamplingParams(temperature=0.5 * (i % 2), seed=i, max_tokens=4 + i % 6, logprobs=1 if i % 3 else None)
              for i in range(10)]
    plain, _, _ = _run(False, prompts, params, make=_eos_llm)
    monkeypatch.setattr(llm_module, "_copy_to_host", late_copy)
    for overlap in (False, True):
        outs, _, _ = _run(overlap, prompts, params, make=_eos_llm)
        assert [_view(o) for o in outs] == [_view(o) for o in plain]


def test_cache_of_a_finished_sequence_is_held_until_its_last_step_is_read_back():
    """Every release happens when no launched-but-unread step still computes the sequence; and the deferred path
    (a sequence that ended while its next step was already launched) is taken."""
    llm = _eos_llm(overlap=True)
    engine = llm.engine
    released, deferred = [], []
    release, remove = engine.blocks.release, engine.scheduler.remove

    def checked_release(seq):
        step = engine._inflight
        assert step is None or step.kept is not None or all(s is not seq for s in step.seqs)
        released.append(seq)
        release(seq)

    def spied_remove(seq, release=True):
        if not release:
            deferred.append(seq)
        remove(seq, release)

    engine.blocks.release, engine.scheduler.remove = checked_release, spied_remove
    outs = llm.generate(_prompts(12, seed=8), SamplingParams(temperature=0, max_tokens=12))
    assert deferred and all(any(r is s for r in released) for s in deferred)
    assert any(o.finish_reason == "stop" for o in outs)


def test_decode_buffers_take_fed_tokens_on_the_device():
    from mini.model import DecodeBuffers
    bufs = DecodeBuffers(max_seqs=8, max_len=64, block_tokens=16, pad_slot=9, pad_block=30, device="cpu")
    sampled = torch.tensor([41, 42, 43, 44])  # the previous step's ids, one per row of that step
    bufs.fill(6, [5, 0, 7, 0], [3, 17, 9, 1], [0, 1, 2, 3], [[1], [2, 4], [3], [5]], feed=(sampled, [-1, 3, -1, 0]))
    assert bufs.batch(6).input_ids.tolist() == [5, 44, 7, 41, 0, 0]
    bufs.fill(4, [8, 6], [4, 2], [0, 1], [[1], [2]])  # no feed: the bucket's source rows are cleared
    assert bufs.batch(4).input_ids.tolist() == [8, 6, 0, 0] and bufs.ids[3, :4].tolist() == [-1] * 4
    with pytest.raises(ValueError, match="source rows"):
        bufs.fill(2, [8, 6], [4, 2], [0, 1], [[1], [2]], feed=(sampled, [1]))


def _tiny_llm(model, engram_tables, device="cpu", dtype=torch.float32, **opts):
    """LLM of a tiny preset; engram_tables "host" keeps its Engram tables on the host (the rows are looked up
    there), "device" lets them go to the device (hashed and looked up inside the step; on CPU only the path
    differs)."""
    from mini.model import load_model
    m, cfg, tok = load_model(model, device=device, dtype=dtype,
                             engram_device_bytes=0 if engram_tables == "host" else 1 << 30)
    return LLM(m, config=cfg, tokenizer=tok, device=device, dtype=dtype, **opts)


def _count_fetches_in_run(monkeypatch) -> list:
    """Spy on ModelRunner.run: the returned list gets an entry for each fetch of the step in flight made while the
    runner prepares a step, i.e. before that step is launched."""
    from mini.engine.model_runner import ModelRunner
    early, run = [], ModelRunner.run

    def spied_run(self, chunks, feed=None):
        if feed is not None:
            fetch = feed.fetch
            feed = TokenFeed(feed.ids, feed.rows, lambda: early.append(1) or fetch())
        return run(self, chunks, feed)

    monkeypatch.setattr(ModelRunner, "run", spied_run)
    return early


@pytest.mark.parametrize("model,block_tokens,engram_tables", [("tiny-v4", 128, None), ("tiny-v4.1", 16, "host"),
                                                              ("tiny-v4.1", 16, "device")])
def test_device_fed_tokens_on_the_static_decode_path(monkeypatch, model, block_tokens, engram_tables):
    """Through the static decode buffers the in-flight ids are gathered into the next step's token row on the
    device; tokens equal the eager plain engine's. No read-back of the step in flight before the next launch
    (tiny-v4; tiny-v4.1 with its tables on the device: hashed on the device), except with the Engram tables on the
    host (read back for the lookup, after the other inputs are copied)."""
    from mini.model import DecodeBuffers
    fed, fill = [], DecodeBuffers.fill

    def spied_fill(self, n, tokens, positions, slots, blocks, engram_rows=None, feed=None, **kw):
        fed.append(feed is not None and any(r >= 0 for r in feed[1]))
        return fill(self, n, tokens, positions, slots, blocks, engram_rows, feed, **kw)

    monkeypatch.setattr(DecodeBuffers, "fill", spied_fill)
    early_fetches = _count_fetches_in_run(monkeypatch)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 1, 40, 17)]
    params = [SamplingParams(temperature=0.7 if i % 2 else 0, seed=i, max_tokens=5 + i, ignore_eos=True)
              for i in range(4)]
    runs = {}
    for static, overlap in ((False, False), (True, True)):
        monkeypatch.setattr(runner_module, "use_cuda_graphs", lambda *a, s=static: s)
        early_fetches.clear()
        llm = _tiny_llm(model, engram_tables, num_blocks=8 * 128 // block_tokens, block_tokens=block_tokens,
                        max_num_seqs=4, max_model_len=256, overlap=overlap)
        engine = llm.engine
        assert (engine.runner.graphs is not None) == static and engine.overlap == overlap
        if static and engram_tables is not None:
            assert bool(engine.runner.graphs.static.buffers.n_prefix) == (engram_tables == "device")
        runs[overlap] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs[True] == runs[False]
    assert sum(fed) >= 5  # decode steps fed from the device
    if engram_tables == "host":
        assert len(early_fetches) >= 5  # each fed step waited for the one in flight before its Engram lookup
    else:
        assert early_fetches == []  # no fed step waited for the step in flight before its launch


@pytest.mark.gpu
@pytest.mark.parametrize("model,engram_tables", [("tiny-v4.1", "device"), ("tiny-v4.1", "host"), ("tiny-v4", None)])
def test_cuda_graphs_with_overlap_equal_eager(monkeypatch, model, engram_tables):
    """bf16, fast backend, V4.1 with its Engram tables on the device (hashed and looked up inside the graph, no
    read-back before a launch) or on the host (ids read back before each lookup), and V4 (ids fed on the device):
    graph replays with overlapped steps give the eager tokens (greedy rows) and exactly the tokens of graph replays
    without overlap (every row: same graphs, same batches, so bit-equal logits; seeded rows too). With the tables
    on the device the tokens also equal, every row, those of graphs with host-side rows (the same table rows,
    dequantized exactly either way)."""
    from mini.ops import set_backend
    set_backend("fast")
    rng = random.Random(10)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (64, 70, 90, 100, 127, 150, 181)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=10 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]
    early_fetches = _count_fetches_in_run(monkeypatch)
    modes = [("eager", engram_tables, {"enforce_eager": True}), ("graphs", engram_tables, {"overlap": False}),
             ("overlap", engram_tables, {})]
    if engram_tables == "device":
        modes.append(("host graphs", "host", {"overlap": False}))
    runs = {}
    for mode, tables, opts in modes:
        early_fetches.clear()
        llm = _tiny_llm(model, tables, device="cuda", dtype=torch.bfloat16, max_num_seqs=8, block_tokens=128,
                        max_model_len=1024, **opts)
        assert llm.engine.overlap == (mode == "overlap")
        if mode != "eager" and tables is not None:
            assert bool(llm.engine.runner.graphs.static.buffers.n_prefix) == (tables == "device")
        llm.engine.step_times = []
        runs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        assert [len(t) for t in runs[mode]] == [p.max_tokens for p in params]
        assert mode == "eager" or sum(t.graph for t in llm.engine.step_times) >= 20
        if mode == "overlap":
            assert (len(early_fetches) >= 10) if tables == "host" else early_fetches == []
    assert runs["overlap"] == runs["graphs"]
    assert runs["overlap"][1::2] == runs["eager"][1::2]
    if engram_tables == "device":
        assert runs["graphs"] == runs["host graphs"]
