"""tools/ep_prefill_overlap.py: ep-prefill's micro-batch A/B on 2 gloo ranks at tiny size."""
import argparse

import pytest

import ep_prefill_overlap
from mini.testing.suites import check_result


def _prefill_args(*extra: str):
    p = argparse.ArgumentParser()
    ep_prefill_overlap.add_args(p)
    p.add_argument("--json", default=None)
    return p.parse_args(["--preset", "tiny-v4.1", "--device", "cpu", "--dtype", "float32", "--engram-rows", "97",
                         "--block-tokens", "16", *extra])


def test_ep_prefill_overlap_ab_reports_each_setting_and_equal_logits(monkeypatch):
    """`--overlap 1,2` on 2 gloo ranks (every V4.1 layer kind): each setting's step and stages, the
    exposed share, and logits equal bit for bit between the settings (and the control: one setting twice)."""
    monkeypatch.setenv("MINI_EP_OVERLAP_MIN_TOKENS", "1")  # read by the spawned ranks: split 37 tokens too
    args = _prefill_args("--nproc", "2", "--tokens", "37", "--seqs", "2", "--steps", "2", "--warmup", "1",
                         "--profile-steps", "1", "--overlap", "1,2")
    result = check_result("ep-prefill", ep_prefill_overlap.run(args))
    m, d = result["metrics"], result["definition"]
    assert d["micro_batches"] == [1, 2]
    assert m["logits_repeat_identical"] == 1
    for s in (1, 2):
        assert m[f"overlap{s}.logits_identical"] == 1
        assert m[f"overlap{s}.mean_step_ms"] > 0 and m[f"overlap{s}.stage.communication_ms"] > 0
        share = m[f"overlap{s}.stage.exposed_fraction"]
        want = (m[f"overlap{s}.stage.communication_ms"] + m[f"overlap{s}.stage.exchange_glue_ms"]) \
            / m[f"overlap{s}.stage.step_ms"]
        assert 0 < share < 1 and share == pytest.approx(want)
    assert m["mean_step_ms"] == m["overlap1.mean_step_ms"]  # the top level is the first setting's
    assert set(result["raw"]["step_ms_by_overlap"]) == {"1", "2"}


def test_ep_prefill_refuses_a_bad_overlap_list():
    for bad in ("0", "1,x", ""):
        with pytest.raises(SystemExit):
            _prefill_args("--overlap", bad)
