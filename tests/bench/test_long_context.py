"""long-context on the tiny model on the CPU (131,072 tokens at real width needs the H200), and its cache
prediction checked by hand."""
import argparse

import pytest
import torch

from mini.testing.suites import SuiteError, check_result
from mini.bench import long_context as lc
from mini.config import preset


def _args(extra=()):
    p = argparse.ArgumentParser()
    lc.add_args(p)
    return p.parse_args(["--preset", "tiny-v4.1", "--prompt-tokens", "203", "--chunk", "64", "--device", "cpu",
                         "--dtype", "float32", "--block-tokens", "16"] + list(extra))


def test_prediction_by_hand_for_v41_flash():
    """KV owners 2, 8, 14 (ratio 2) and 20 (ratio 1), each with index keys: per token 3 x (512 + 128) / 2 + (512 +
    128) elements = 1,600 bf16 = 3,200 bytes; per sequence 40 rings of 128 x 512 and three ratio-2 states."""
    cfg = preset("v4.1-flash")
    assert lc.per_token_bytes(cfg, 2) == 3200
    N = 131072
    got = lc.predicted_cache_bytes(cfg, N, 2)
    assert got == {"compressed_kv": (3 * N // 2 + N) * 512 * 2, "index_keys": (3 * N // 2 + N) * 128 * 2,
                   "window": 40 * 128 * 512 * 2, "compressor_state": 3 * 2 * 2 * 512 * 4}
    assert sum(got.values()) / N == pytest.approx(3200 + (40 * 128 * 512 * 2 + 3 * 2 * 2 * 512 * 4) / N)
    # an odd length: the ratio-2 layers hold only complete groups
    assert lc.predicted_cache_bytes(cfg, 5, 2)["compressed_kv"] == (3 * 2 + 5) * 512 * 2


def test_written_rows_count_what_the_pools_hold():
    from mini.model import KVCache
    cfg = preset("tiny-v4.1")
    cache = KVCache(cfg, 2, 6, 16, "cpu", torch.float32)
    cache.comp_kv[4][1, 3] = 1.0  # one row of block 1
    cache.comp_kv[4][5, 0] = 1.0  # a block the sequence does not own
    cache.window[0][0, :5, 0] = 2.0
    cache.window[0][1, :9, 0] = 2.0  # another slot
    written, rows = lc.written_cache_bytes(cache, 0, [0, 1, 2])
    assert rows["compressed_kv.4"] == 1 and rows["compressed_kv.2"] == 0 and rows["window.0"] == 5
    assert written["compressed_kv"] == 64 * 4 and written["window"] == 5 * 64 * 4
    assert written["compressor_state"] == 2 * 2 * 64 * 4  # layer 2's open group: kv + score, counted whole


def test_suite_runs_on_the_tiny_model_and_the_cache_holds_what_the_schedule_predicts():
    result = check_result("long-context", lc.run(_args()))
    m, raw = result["metrics"], result["raw"]
    assert m["chunks"] == 4 and len(raw["chunk_ms"]) == 4 and result["definition"]["layers"] == 8
    assert m["warmup_s"] > 0 and result["definition"]["warmup_chunk"] is True
    # tiny-v4.1: owners 2 (ratio 2) and 4 (ratio 1): (64 + 32) / 2 + (64 + 32) = 144 fp32 values per token
    assert m["predicted_marginal_bytes_per_token"] == 576
    assert m["pools_with_unexpected_rows"] == 0 and raw["rows"]["compressed_kv.2"] == 101
    assert m["written_over_predicted"] == 1.0
    assert m["predicted_bytes_per_token"] == pytest.approx((101 + 203) * 64 * 4 / 203 + (101 + 203) * 32 * 4 / 203
                                                           + (8 * 128 * 64 * 4 + 2 * 2 * 64 * 4) / 203)
    assert m["tok_per_s"] == pytest.approx(203 / m["total_s"])
    for k in ("first_chunk_ms", "last_chunk_ms", "median_chunk_ms", "allocated_bytes_per_token",
              "full_kv_over_predicted", "written_mb.index_keys", "predicted_mb.window"):
        assert k in m


def test_bad_sizes_are_refused():
    with pytest.raises(SuiteError, match="must be positive"):
        lc.run(_args(["--chunk", "0"]))
    with pytest.raises(SuiteError, match="exceed the model's 4096"):
        lc.run(_args(["--prompt-tokens", "5000"]))
