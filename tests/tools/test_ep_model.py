"""The EP scaling model (tools/ep_model.py): its byte counts match the exchange's wire and report 004's figures,
its probabilities match enumeration, and the CLI prints and writes the table."""
import itertools
import json
import math
import random

import pytest

import ep_model
from ep_model import Inputs, expected_tiles, p_no_expert_on_rank, pairs_on_rank_pmf, predict


def test_ring_bytes_at_ep2_are_report_004s():
    """Report 004: 21.8 MB all-gather of 5,328-byte rows and an fp32 reduce-scatter sending 84 MB per layer."""
    p = predict(Inputs(), 2)
    assert p.ring_all_gather_mb == pytest.approx(4096 * 5328 / 1e6) and round(p.ring_all_gather_mb, 1) == 21.8
    assert round(p.ring_reduce_scatter_mb) == 84
    assert p.ring_comm_ms == pytest.approx(Inputs().ep2_comm_ms_per_layer)  # calibrated on it
    assert predict(Inputs(), 4).ring_comm_ms == pytest.approx(3 * p.ring_comm_ms)  # (N - 1) T rows per rank


@pytest.mark.parametrize("E,held,k", [(8, 2, 3), (12, 4, 2), (9, 3, 1)])
def test_rank_hit_probabilities_match_enumeration(E, held, k):
    subsets = list(itertools.combinations(range(E), k))
    count = [sum(1 for s in subsets if sum(e < held for e in s) == j) for j in range(k + 1)]
    assert pairs_on_rank_pmf(E, held, k) == pytest.approx([c / len(subsets) for c in count])
    assert p_no_expert_on_rank(E, held, k) == pytest.approx(count[0] / len(subsets))


def test_expected_tiles_matches_sampling():
    rng = random.Random(1)
    lam, tile = 40.0, 16

    def poisson():  # Knuth's method
        L, n, p = math.exp(-lam), 0, 1.0
        while True:
            p *= rng.random()
            if p <= L:
                return n
            n += 1
    draws = [math.ceil(poisson() / tile) for _ in range(20000)]
    assert expected_tiles(lam, tile) == pytest.approx(sum(draws) / len(draws), rel=0.02)


def test_all_to_all_never_moves_more_rows_than_the_ring():
    for n in (2, 4, 8):
        p = predict(Inputs(), n)
        assert p.a2a_remote_ranks_per_token <= min(n - 1, Inputs().topk) + 1e-9
        assert p.a2a_dispatch_mb <= p.ring_all_gather_mb
        assert min(p.a2a_combine_fp32_mb, p.a2a_combine_bf16_pairs_mb) <= p.ring_reduce_scatter_mb
        assert p.busiest_load >= 1.0


def test_cli_prints_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert ep_model.main(["--ranks", "2", "4", "--json", str(out), "--skew-draws", "50"]) == 0
    text = capsys.readouterr().out
    assert "EP2" in text and "EP4" in text and "ring communication" in text
    r = json.loads(out.read_text())
    assert [p["ranks"] for p in r["predictions"]] == [2, 4] and r["inputs"]["skew_draws"] == 50
