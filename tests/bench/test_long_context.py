"""long-context on the tiny model on the CPU (131,072 tokens at real width needs the H200); its cache check:
tests/tools/test_long_context_cache.py."""
import argparse

import pytest

from mini.testing.suites import SuiteError, check_result
from mini.bench import long_context as lc


def _args(extra=()):
    p = argparse.ArgumentParser()
    lc.add_args(p)
    return p.parse_args(["--preset", "tiny-v4.1", "--prompt-tokens", "203", "--chunk", "64", "--device", "cpu",
                         "--dtype", "float32", "--block-tokens", "16"] + list(extra))


def test_suite_runs_on_the_tiny_model():
    result = check_result("long-context", lc.run(_args()))
    m, raw = result["metrics"], result["raw"]
    assert m["chunks"] == 4 and len(raw["chunk_ms"]) == 4 and result["definition"]["layers"] == 8
    assert m["warmup_s"] > 0 and result["definition"]["warmup_chunk"] is True
    assert m["tok_per_s"] == pytest.approx(203 / m["total_s"])
    for k in ("first_chunk_ms", "last_chunk_ms", "median_chunk_ms"):
        assert k in m
    assert "written_over_predicted" not in m  # the cache check is the study's (tools/long_context_cache.py)


def test_bad_sizes_are_refused():
    with pytest.raises(SuiteError, match="must be positive"):
        lc.run(_args(["--chunk", "0"]))
    with pytest.raises(SuiteError, match="exceed the model's 4096"):
        lc.run(_args(["--prompt-tokens", "5000"]))
