"""The background-loop engine: concurrent callers, aborts, and recovery from a failed step."""
import asyncio

import pytest

from fake_model import fake_llm
from mini.engine import SamplingParams
from mini.engine.async_engine import AsyncLLM

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


async def _collect(llm, prompt, rid, params=GREEDY):
    return [o async for o in llm.generate(prompt, params, rid)]


def test_concurrent_generate_matches_offline():
    prompts = ["alpha", "beta gamma", "delta"]
    want = [fake_llm().generate([p], GREEDY)[0].token_ids for p in prompts]
    llm = AsyncLLM(fake_llm().engine)

    async def main():
        return await asyncio.gather(*(_collect(llm, p, f"r{i}") for i, p in enumerate(prompts)))
    try:
        outs = asyncio.run(main())
    finally:
        llm.shutdown()
    assert [o[-1].token_ids for o in outs] == want
    assert all(o[-1].finished and not any(x.finished for x in o[:-1]) for o in outs)
    # streamed deltas add up to the final text
    assert all("".join(x.new_text for x in o) == o[-1].text for o in outs)


def test_cancelled_caller_aborts_its_request():
    finals = []
    llm = AsyncLLM(fake_llm().engine, on_output=lambda o: finals.append(o) if o.finished else None)

    async def main():
        gen = llm.generate("x" * 10, SamplingParams(max_tokens=200, ignore_eos=True, temperature=0), "long")
        await gen.__anext__()
        await gen.aclose()  # what a disconnect does to the server's iterator
        for _ in range(200):
            if not llm.engine.requests:
                break
            await asyncio.sleep(0.01)
    try:
        asyncio.run(main())
        assert not llm.engine.requests and llm.engine.blocks.usage == 0.0
        assert [o.finish_reason for o in finals] == ["abort"] and len(finals[0].token_ids) < 200
    finally:
        llm.shutdown()


def test_failed_step_fails_its_requests_and_the_loop_goes_on():
    engine = fake_llm().engine
    model = engine.runner.model
    real_forward, calls = model.forward, []

    def flaky(batch, cache):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_forward(batch, cache)
    model.forward = flaky
    llm = AsyncLLM(engine)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            asyncio.run(_collect(llm, "first", "a"))
        again = asyncio.run(_collect(llm, "first", "b"))
    finally:
        llm.shutdown()
    assert again[-1].token_ids == fake_llm().generate(["first"], GREEDY)[0].token_ids
    assert engine.blocks.usage == 0.0


def test_validation_errors_come_back_to_the_caller():
    llm = AsyncLLM(fake_llm(num_blocks=4).engine)
    try:
        with pytest.raises(ValueError, match="context"):
            asyncio.run(_collect(llm, "y" * 40, "c"))
        with pytest.raises(ValueError, match="empty"):
            asyncio.run(_collect(llm, [], "d"))
    finally:
        llm.shutdown()


def test_the_loop_runs_any_driver():
    """AsyncLLM's engine thread only runs its driver (mini.parallel.serve.DPDriver is the other one): commands
    reach it in order, Failed items raise in the caller, outputs stream, and shutdown gives it one last stop step."""
    from mini.engine.async_engine import Abort, Add, Failed
    from mini.engine.llm import RequestOutput

    class Echo:
        poll_s = 0.05

        def __init__(self):
            self.seen, self.stopped, self.started, self.pending = [], False, False, []

        def start(self):
            self.started = True

        def idle(self):
            return not self.pending

        def step(self, commands, stop):
            self.seen += commands
            self.stopped |= stop
            out, self.pending = self.pending, []
            for c in commands:
                if isinstance(c, Add) and c.request_id == "bad":
                    out.append(Failed("bad", ValueError("refused by the driver")))
                elif isinstance(c, Add):  # two outputs: one now, the last at the next step
                    out.append(RequestOutput(c.request_id, c.prompt_ids, [7], "", [7], "", False))
                    self.pending.append(RequestOutput(c.request_id, c.prompt_ids, [7, 8], "", [8], "", True))
            return out

    driver = Echo()
    llm = AsyncLLM(fake_llm().engine, driver=driver)
    try:
        outs = asyncio.run(_collect(llm, [5, 6], "ok"))
        with pytest.raises(ValueError, match="refused by the driver"):
            asyncio.run(_collect(llm, [5], "bad"))
    finally:
        llm.shutdown()
    assert [o.new_token_ids for o in outs] == [[7], [8]] and outs[-1].finished
    assert driver.started and driver.stopped and not llm._thread.is_alive()
    # a finished request needs no abort; the failed one's caller sends one (it cannot know the driver dropped it)
    assert [(type(c), c.request_id) for c in driver.seen] == [(Add, "ok"), (Add, "bad"), (Abort, "bad")]
