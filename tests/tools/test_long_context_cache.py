"""tools/long_context_cache.py: the cache prediction checked by hand, and long-context run with the cache check on
the tiny model on the CPU: the cache holds what the schedule predicts."""
import argparse

import long_context_cache as lcc
import pytest
import torch

from mini.config import preset
from mini.testing.suites import check_result


def _args(extra=()):
    p = argparse.ArgumentParser()
    lcc.add_args(p)
    return p.parse_args(["--preset", "tiny-v4.1", "--prompt-tokens", "203", "--chunk", "64", "--device", "cpu",
                         "--dtype", "float32", "--block-tokens", "16"] + list(extra))


def test_prediction_by_hand_for_v41_flash():
    """KV owners 2, 8, 14 (ratio 2) and 20 (ratio 1), each with index keys: per token 3 x (512 + 128) / 2 + (512 +
    128) elements = 1,600 bf16 = 3,200 bytes; per sequence 40 rings of 128 x 512 and three ratio-2 states."""
    cfg = preset("v4.1-flash")
    assert lcc.per_token_bytes(cfg, 2) == 3200
    N = 131072
    got = lcc.predicted_cache_bytes(cfg, N, 2)
    assert got == {"compressed_kv": (3 * N // 2 + N) * 512 * 2, "index_keys": (3 * N // 2 + N) * 128 * 2,
                   "window": 40 * 128 * 512 * 2, "compressor_state": 3 * 2 * 2 * 512 * 4}
    assert sum(got.values()) / N == pytest.approx(3200 + (40 * 128 * 512 * 2 + 3 * 2 * 2 * 512 * 4) / N)
    # an odd length: the ratio-2 layers hold only complete groups
    assert lcc.predicted_cache_bytes(cfg, 5, 2)["compressed_kv"] == (3 * 2 + 5) * 512 * 2


def test_written_rows_count_what_the_pools_hold():
    from mini.model import KVCache
    cfg = preset("tiny-v4.1")
    cache = KVCache(cfg, 2, 6, 16, "cpu", torch.float32)
    cache.comp_kv[4][1, 3] = 1.0  # one row of block 1
    cache.comp_kv[4][5, 0] = 1.0  # a block the sequence does not own
    cache.window[0][0, :5, 0] = 2.0
    cache.window[0][1, :9, 0] = 2.0  # another slot
    written, rows = lcc.written_cache_bytes(cache, 0, [0, 1, 2])
    assert rows["compressed_kv.4"] == 1 and rows["compressed_kv.2"] == 0 and rows["window.0"] == 5
    assert written["compressed_kv"] == 64 * 4 and written["window"] == 5 * 64 * 4
    assert written["compressor_state"] == 2 * 2 * 64 * 4  # layer 2's open group: kv + score, counted whole


def test_the_cache_holds_what_the_schedule_predicts():
    result = check_result("long-context", lcc.run(_args()))
    m, raw = result["metrics"], result["raw"]
    # tiny-v4.1: owners 2 (ratio 2) and 4 (ratio 1): (64 + 32) / 2 + (64 + 32) = 144 fp32 values per token
    assert m["predicted_marginal_bytes_per_token"] == 576
    assert m["pools_with_unexpected_rows"] == 0 and raw["rows"]["compressed_kv.2"] == 101
    assert m["written_over_predicted"] == 1.0
    assert m["predicted_bytes_per_token"] == pytest.approx((101 + 203) * 64 * 4 / 203 + (101 + 203) * 32 * 4 / 203
                                                           + (8 * 128 * 64 * 4 + 2 * 2 * 64 * 4) / 203)
    for k in ("allocated_bytes_per_token", "full_kv_over_predicted", "written_mb.index_keys", "predicted_mb.window"):
        assert k in m
