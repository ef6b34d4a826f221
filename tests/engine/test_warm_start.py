"""Warm at start (mini.engine.warmup): what the warm-up runs (its plan), that served bursts of varied shapes need no
Triton kernel specialization the warm-up did not compile (found on the CPU, tests/engine/specializations.py), and
its trace (mini.engine.warmup_trace, MINI_WARMUP_TRACE): what the warm-up ran and what each burst of serving
after it still compiled, stepped and allocated, summarized per burst as the goodput benchmark reports it."""
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import triton

from fake_model import FakeConfig, FakeModel, FakeTokenizer
from mini.engine import build_engine
from mini.engine import warmup_trace
from mini.engine.sequence import SamplingParams
from mini.engine.warmup import plan, warm_up


def _engine(**kw):
    cfg = FakeConfig(vocab_size=512)
    opts = dict(num_blocks=256, block_tokens=4, device="cpu", dtype=torch.float32, max_num_seqs=8,
                max_num_batched_tokens=32)
    return build_engine(FakeModel(cfg), config=cfg, tokenizer=FakeTokenizer(), **{**opts, **kw})


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """An engine warmed up with MINI_WARMUP_TRACE set; its trace is closed (Triton's hooks given back) after."""
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(warmup_trace.TRACE_ENV, str(path))
    rt = triton.knobs.runtime
    hooks = rt.jit_cache_hook, rt.jit_post_compile_hook
    engine = _engine()
    warm_up(engine)
    yield engine, path
    hook = engine.trace._gc
    engine.trace.close()
    assert hook not in gc.callbacks
    assert (rt.jit_cache_hook, rt.jit_post_compile_hook) == hooks


def _burst(engine, n: int, tag: str, collect: bool = False) -> tuple[float, float]:
    start = time.time()
    if collect:
        gc.collect()  # a full collection while serving is traced
    for i in range(n):
        # as mini.engine.async_engine calls it: the images positional (a traced engine must take every argument)
        engine.add_request(f"{tag}-{i}", [20 + i, 21, 22, 23, 24, 25], SamplingParams(max_tokens=3, ignore_eos=True),
                           None)
    while engine.has_work():
        engine.step()
    return start, time.time()


def test_trace_splits_warm_up_and_bursts(traced):
    engine, path = traced
    bursts = [_burst(engine, 5, "a", collect=True), _burst(engine, 3, "b")]
    events = warmup_trace.read(str(path))
    assert [e["ev"] for e in events].count("warmup_done") == 1
    d = warmup_trace.summarize(events, bursts)
    assert d["warmup"]["steps"] > 0 and d["warmup"]["adds"] > 0
    first, second = d["bursts"]
    assert (first["adds"], second["adds"]) == (5, 3)
    assert first["steps"] >= 3 and second["steps"] >= 3  # a prefill, then two decode steps at least
    assert first["compiles"] == 0 and first["captures"] == 0  # the fake model compiles nothing
    assert first["engine_ttft_p50_s"] is not None and first["engine_ttft_p50_s"] >= 0
    assert 0 <= first["first_add_after_s"] <= first["last_add_after_s"]
    shapes = first["slowest_steps"]
    assert shapes and all(s["seqs"] >= 1 and s["tokens"] >= s["seqs"] for s in shapes)
    assert d["outside_bursts"]["steps"] == 0
    assert first["gc_full"] >= 1 and first["gc_s"] > 0 and second["gc_full"] == 0
    # every step of a burst is traced with the shape of its batch
    steps = [e for e in events if e["ev"] == "step" and e["phase"] == "serve"]
    assert sum(e["first_tokens"] for e in steps) == 8
    assert max(e["seqs"] for e in steps) == 5 and all(e["graph"] is False for e in steps)


def test_triton_compiles_are_counted_per_step_and_hooks_chain(traced):
    engine, path = traced
    rt = triton.knobs.runtime
    seen = []
    # a hook set before ours keeps being called; ours only counts (a truthy result would skip the compile)
    trace = engine.trace
    trace.close()
    rt.jit_cache_hook = lambda **kw: seen.append("miss")
    rt.jit_post_compile_hook = lambda **kw: seen.append("done")
    trace = warmup_trace.WarmupTrace(str(path))
    assert trace.install_triton()

    class Fn:
        name = "fake_kernel"
    assert rt.jit_cache_hook(key=1, repr="fake_kernel[...](T: i32)", fn=Fn(), compile={}, is_manual_warmup=False,
                             already_compiled=False) is None
    rt.jit_post_compile_hook(key=1, repr="fake_kernel[...](T: i32)", fn=Fn(), compile={}, is_manual_warmup=False,
                             already_compiled=False)
    assert seen == ["miss", "done"] and trace.compiles == 1
    trace.close()
    rt.jit_cache_hook = rt.jit_post_compile_hook = None
    compiles = [e for e in warmup_trace.read(str(path)) if e["ev"] == "compile"]
    assert [(c["kernel"], c["key"]) for c in compiles] == [("fake_kernel", "fake_kernel[...](T: i32)")]
    part = warmup_trace.summarize(warmup_trace.read(str(path)), [])["warmup"]
    assert part["compiles"] == 0  # the compile above was emitted in phase "start", not the warm-up


# ---------------------------------------------------------------------- what the warm-up runs
def test_plan_covers_the_budget_every_length_class_and_trickling_arrivals():
    parts = plan(2048, 64, 128, 4096)
    first = parts["budget+powers"][0]
    assert first[0].length == 4096 - 9 and len(first) == 65  # two budgets (capped by the context), then a burst
    assert {r.length for r in first[1:]} == {2 ** k for k in range(11)}
    assert any(r.sampled for r in first) and not all(r.sampled for r in first)
    alone = {name: p for name, p in parts.items() if name.startswith("alone-")}
    # one prompt by itself, for lengths equal to 1 more than, or a multiple of, each power of two <= the budget
    assert sorted(int(n.split("-")[1]) for n in alone) == [2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129,
                                                           256, 257, 512, 513, 1024, 1025, 2048]
    assert all(len(p) == 1 and len(p[0]) == 1 for p in alone.values())
    arrivals = [len(g) for g in parts["trickle"]]
    assert arrivals[:6] == [1, 1, 2, 3, 5, 8] and sum(arrivals) == 64
    # every trickled request still decodes when the last ones arrive, so steps mix decodes and prefills
    assert min(r.max_tokens for g in parts["trickle"] for r in g) > len(arrivals)
    assert {r.length for g in parts["trickle"] for r in g} == {128, 65}
    small = plan(64, 4, 16, 40)  # a context shorter than the budget caps every prompt and its output
    assert max(r.length for p in small.values() for g in p for r in g) == 40 - 9
    assert all(r.length + r.max_tokens <= 40 for p in small.values() for g in p for r in g)
    assert all(r.length + r.max_tokens <= 20 for p in plan(64, 64, 16, 20).values() for g in p for r in g)


# ---------------------------------------------------------------------- kernel specializations (no GPU)
def test_spec_key_classes_follow_triton():
    from triton.runtime.interpreter import InterpretedFunction

    from specializations import spec_key

    def kernel(x_ptr, n, m, BLOCK: "tl.constexpr"):
        pass
    f = InterpretedFunction(kernel, do_not_specialize=["m"])
    x = torch.zeros(64, dtype=torch.int8)

    def key(*args, **kw):
        return dict(spec_key(f, args, kw)[2])
    assert key(x, 1, 1, BLOCK=64) == {"x_ptr": "*torch.int8D", "n": "i321", "m": "i32", "BLOCK": "64"}
    assert key(x[1:], 32, 32, BLOCK=64)["x_ptr"] == "*torch.int8"  # a view off the 16-byte alignment
    assert key(x, 32, 7, BLOCK=64)["n"] == "i32D" and key(x, 33, 7, BLOCK=64)["n"] == "i32"
    assert key(x, 2 ** 40, 7, BLOCK=64)["n"] == "i64D"
    assert spec_key(f, (x, 1, 1), dict(BLOCK=64, num_warps=8))[1] == (("num_warps", 8),)


def _coverage(*argv) -> dict:
    script = Path(__file__).with_name("specializations.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("scale", ["small", "server-defaults"])
def test_served_bursts_need_no_kernel_the_warm_up_did_not_compile(scale):
    """The Triton specializations of served bursts (the goodput benchmark's as its requests come in, skewed
    lengths, random ones) are among those of the warm-up's steps: at a budget, batch and block size of their own
    (most classes do not depend on the scale), and at the server's defaults (budget 2048, 64 sequences,
    128-token blocks), where a kernel that picks a constexpr from the step's size against a fixed threshold
    meets sizes the small scale never reaches (the indexer's tiles per program did: docs/perf/034). There also the
    builds that follow a step's size through V4.1-Flash's own width, which tiny-v4.1's never reaches (`--real-width`:
    mHC's split-K tiles at D = 5,120, the routing plan over 384 experts; the goodput burst's 256-token steps missed
    four mHC builds before the warm-up ran 256- and 512-token steps alone). The warm-up's first part alone (the
    warm-up as it was) leaves the goodput burst kernels to compile, e.g. sparse attention with a block-table stride
    of 1."""
    args = (("--budget", "512", "--max-seqs", "16", "--block-tokens", "32", "--num-blocks", "600", "--random", "3")
            if scale == "small" else
            ("--budget", "2048", "--max-seqs", "64", "--block-tokens", "128", "--num-blocks", "2048", "--random", "2",
             "--real-width"))
    r = _coverage(*args)
    assert r["warmup_keys"] > 40 and len(r["bursts"]) == (7 if scale == "small" else 6)
    for tag, b in r["bursts"].items():
        assert b["keys"] > 20, tag
        assert b["missing"] == [], f"{tag}: kernels the warm-up did not compile: {b['missing']}"
    assert "'_sparse_mla_kernel'" in r["bursts"]["goodput-trickle"]["missing_after_first_parts"]
    if scale == "server-defaults":
        real = r["real_width"]
        assert real["warmup_keys"] > 40 and {"_mhc_partial_kernel", "_mhc_finish_kernel", "_plan_one_kernel",
                                              "_count_kernel", "_place_kernel"} <= set(real["warmup_kernels"])
        for tag, missing in real["bursts"].items():
            assert missing == [], f"{tag}: V4.1-width builds the warm-up did not compile: {missing}"


def test_freeze_heap_takes_start_up_objects_out_of_full_collections():
    """In a process of its own (freezing is for good): after freeze_heap, the objects alive at start-up are frozen
    and a full collection walks only those made after."""
    code = """
import gc
from mini.engine.warmup import freeze_heap
start_up = [[i] for i in range(200_000)]  # lists: objects the collector tracks
assert freeze_heap() >= 0
frozen = gc.get_freeze_count()
assert frozen >= 200_000, frozen
later = [[i] for i in range(1_000)]
gc.collect()
walked = len(gc.get_objects(generation=2))
assert 1_000 <= walked < 20_000, walked
print("ok", frozen, walked)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


@pytest.mark.gpu
def test_bursts_after_the_warm_up_compile_nothing_gpu(tmp_path, monkeypatch):
    """On the GPU, with the server's defaults (budget 2048, 64 sequences, 128-token blocks, CUDA graphs): after
    the warm-up, the bursts of the CPU coverage check (the goodput burst as it may arrive, skewed and random
    lengths) compile no Triton kernel (counted by the trace's hooks)."""
    import mini.ops
    from specializations import bursts, serve_burst
    monkeypatch.setenv(warmup_trace.TRACE_ENV, str(tmp_path / "trace.jsonl"))
    with mini.ops.using_backend("fast"):
        engine = build_engine("tiny-v4.1", device="cuda", dtype=torch.bfloat16, num_blocks=2048)
        assert engine.runner.graphs is not None
        warm_up(engine)
        trace = engine.trace
        try:
            compiled = {}
            for i, (tag, (lengths, outputs, arrivals)) in enumerate(
                    bursts(2048, 64, 128, engine.max_model_len, 2).items()):
                before = trace.compiles
                serve_burst(engine, tag, lengths, outputs, arrivals, seed=i)
                compiled[tag] = trace.compiles - before
        finally:
            trace.close()
    keys = [e["key"][:200] for e in warmup_trace.read(str(tmp_path / "trace.jsonl"))
            if e["ev"] == "compile" and e["phase"] == "serve"]
    assert not any(compiled.values()), f"compiled after the warm-up: {compiled}: {keys}"


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget,max_seqs", [(2048, 64), (512, 16), (8192, 256)])
def test_warm_up_decodes_at_every_graph_bucket(budget, max_seqs, overlap):
    """Every CUDA-graph bucket gets a pure-decode step of its batch size during the warm-up (its first replay)."""
    from mini.engine.cuda_graphs import buckets, is_decode_step
    engine = _engine(num_blocks=4096, block_tokens=128, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                     overlap=overlap)
    sizes, schedule = set(), engine.scheduler.schedule

    def scheduled(*a, **kw):
        plan = schedule(*a, **kw)
        if plan.chunks and is_decode_step(plan.chunks):
            sizes.add(len(plan.chunks))
        return plan
    engine.scheduler.schedule = scheduled
    warm_up(engine, parts=["decode-buckets"])
    assert set(buckets(max_seqs)) <= sizes
    assert not engine.has_work()
