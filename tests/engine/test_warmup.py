"""The warm-up's trace (mini.engine.warmup_trace, MINI_WARMUP_TRACE): what the warm-up ran and what each burst of
serving after it still compiled, stepped and allocated, summarized per burst as the goodput benchmark reports it."""
import time

import pytest
import torch
import triton

from fake_model import FakeConfig, FakeModel, FakeTokenizer
from mini.engine import build_engine
from mini.engine import warmup_trace
from mini.engine.sequence import SamplingParams
from mini.engine.warmup import warm_up


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
    engine.trace.close()
    assert (rt.jit_cache_hook, rt.jit_post_compile_hook) == hooks


def _burst(engine, n: int, tag: str) -> tuple[float, float]:
    start = time.time()
    for i in range(n):
        engine.add_request(f"{tag}-{i}", [20 + i, 21, 22, 23, 24, 25], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_work():
        engine.step()
    return start, time.time()


def test_trace_splits_warm_up_and_bursts(traced):
    engine, path = traced
    bursts = [_burst(engine, 5, "a"), _burst(engine, 3, "b")]
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
