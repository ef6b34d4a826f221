"""The scaling model's overlap term (tools/ep_model.py `exposed_ms`, issue 18 items 3-4): the timeline of a
layer's exchange in m micro-batches on one collective stream, against cases worked out by hand."""
import pytest

import ep_model
from ep_model import Inputs, exposed_ms, predict


def test_one_part_hides_only_the_gather_under_the_shared_expert():
    assert exposed_ms(0.3, 1.0, 0.5, 4.0, 1) == pytest.approx(1.0)  # gather hidden, scatter after the experts
    assert exposed_ms(0.8, 1.0, 0.5, 4.0, 1) == pytest.approx(0.3 + 1.0)  # the gather outlasts the shared expert


def test_parts_leave_the_last_scatter_exposed_when_compute_dominates():
    for m in (2, 4, 8):
        assert exposed_ms(0.3, 1.0, 0.5, 40.0, m) == pytest.approx(1.0 / m)


def test_nothing_to_hide_under():
    assert exposed_ms(0.3, 1.0, 0.0, 0.0, 4) == pytest.approx(1.3)


def test_the_stream_serializes_the_collectives():
    # experts quick, scatters slow: part 2's scatter waits for part 1's on the stream, not for its experts
    # stream: gathers 0-0.2, 0.2-0.4; experts 1: 0.2-0.7, 2: 0.7-1.2; scatter 1: 0.7-2.7, scatter 2: 2.7-4.7;
    # the layer ends at 4.7 instead of after its 1.0 ms of compute
    assert exposed_ms(0.4, 4.0, 0.0, 1.0, 2) == pytest.approx(3.7)


def test_more_parts_never_wait_longer_at_the_real_shapes():
    for n in (2, 4, 8):
        waits = [predict(Inputs(micro_batches=m, skew_draws=20), n).ring_stall_overlap_ms for m in (1, 2, 4, 8)]
        assert waits == sorted(waits, reverse=True) and waits[-1] > 0
        p = predict(Inputs(micro_batches=2, skew_draws=20), n)
        assert p.ring_stall_overlap_ms <= p.ring_exposed_overlap_ms <= p.ring_comm_ms  # slowdown charged, < serial


def test_the_split_costs_the_experts_tiles():
    """Each part fills its own 128-row tiles: at EP2 (128 rows per local expert) the tile ratio the H200 measurement
    was fitted on (1.355 for 2 parts), and the split loses there and pays only at EP8 (512 rows per expert)."""
    ep2, ep8 = predict(Inputs(skew_draws=20), 2), predict(Inputs(skew_draws=20), 8)
    assert ep2.parts_tile_ratio == pytest.approx(1.355, abs=0.002)
    routed_ep2 = Inputs().rank4_routed_ms / 40 + ep2.routed_ms_delta
    assert ep2.parts_cost_ms == pytest.approx(routed_ep2 * (6.555 / 4.130 - 1), rel=0.01)  # the fitted point
    assert 1.0 < ep8.parts_tile_ratio < ep2.parts_tile_ratio
    assert ep2.step_ring_overlap_ms > ep2.step_ring_ms and ep8.step_ring_overlap_ms < ep8.step_ring_ms
    assert predict(Inputs(micro_batches=1, skew_draws=20), 4).parts_cost_ms == 0


def test_cli_prints_the_overlap_rows(capsys):
    assert ep_model.main(["--ranks", "2", "4", "--micro-batches", "4", "--skew-draws", "20"]) == 0
    text = capsys.readouterr().out
    assert "ring, 4 parts: wait ms/layer" in text and "paid comm + glue + split share, a2a" in text
