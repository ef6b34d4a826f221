"""Warm-up before serving (mini.engine.warmup): it runs the full-budget prefill, a burst of max_num_seqs requests
and decode at shrinking batch sizes, leaves the engine empty with fresh counters, and serving afterwards gives the
outputs of an engine that never warmed up."""
import httpx
import torch

from server_apps import MODEL, fake_app
from mini.engine import build_engine
from mini.engine.warmup import plan, warm_up
from mini.testing.background_server import BackgroundServer

TINY = dict(device="cpu", dtype=torch.float32, num_blocks=64, block_tokens=16, max_num_seqs=4,
            max_num_batched_tokens=64)


def test_warm_up_runs_the_budget_and_a_burst_then_leaves_the_engine_empty():
    engine = build_engine("tiny-v4.1", **TINY)
    engine.step_times = []  # each step's StepTimes: batch size, pure decode or not
    tokens = []
    schedule = engine.scheduler.schedule

    def counted(*a, **kw):
        plan = schedule(*a, **kw)
        tokens.append(plan.num_tokens)
        return plan
    engine.scheduler.schedule = counted
    lengths = []
    add = engine.add_request

    def recorded(request_id, prompt, params):
        lengths.append(len(prompt))
        return add(request_id, prompt, params)
    engine.add_request = recorded
    assert warm_up(engine) > 0
    assert lengths[:5] == [128, 1, 2, 4, 8]  # 2 budgets, then powers of two for max_num_seqs prompts
    assert lengths == [r.length for part in plan(64, 4, 16, engine.max_model_len).values() for g in part for r in g]
    assert not engine.requests and engine.blocks.usage == 0.0 and not engine.has_work()
    assert engine.stats.steps == 0 and engine.stats.prefill_tokens == 0  # counters reset
    assert engine.blocks.stats.queries == 0 and engine.blocks.stats.hits == 0
    cold = build_engine("tiny-v4.1", **TINY)
    assert engine._rng.getrandbits(62) == cold._rng.getrandbits(62)  # unseeded requests draw the same seeds
    assert max(tokens) == 64  # a step at the full token budget
    times = engine.step_times
    assert max(t.n_seqs for t in times) == 4  # a full batch
    decode_sizes = {t.n_seqs for t in times if t.decode}
    assert len(decode_sizes) >= 3  # decode at shrinking batch sizes
    assert any(not t.decode and t.n_seqs > 1 for t in times)  # several prompts (or prefill + decode) in a step


def test_a_warmed_server_answers_like_a_cold_one():
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    texts = []
    for warmup in (False, True):
        app = fake_app(warmup=warmup)
        engine = app.state.server.llm.engine
        assert (getattr(engine, "warmup_s", None) is not None) == warmup
        with BackgroundServer(app) as url:
            texts.append(httpx.post(url + "/v1/completions", json=body, timeout=None).json()["choices"][0]["text"])
            metrics = httpx.get(url + "/metrics").text
        assert "mini_prefill_tokens_total 4" in metrics.replace(".0", "")  # the warm-up requests are not counted
    assert texts[0] == texts[1]
