"""tools/route_combine_study.py: every launch shape it times gives the same plan and the same bits (the study's own
check), and its cases are the steps it names."""
import pytest
import route_combine_study as study


def test_cases_are_the_steps_they_name():
    tokens, ep = study.CASES["verify_b64x6_ep8"]
    assert (tokens * study.TOPK, ep) == (18_432, 8)  # docs/perf/038's verify step: 18,432 pairs at EP8
    assert study.CASES["decode_b64_ep4"] == (256, 4) and None in study.PLAN_BLOCKS
    assert (None, 4) in study.COMBINE_SHAPES  # the default shape is among those timed


@pytest.mark.gpu
def test_every_launch_shape_gives_the_same_plan_and_bits_gpu():
    out = study.run_case("small", 700, 8, dim=1030)
    plans = {k: v for k, v in out.items() if k.startswith("plan.")}
    combines = {k: v for k, v in out.items() if k.startswith("combine.")}
    assert len(plans) == len(study.PLAN_BLOCKS) and all(v["same_plan"] and v["us"] > 0 for v in plans.values())
    assert len(combines) == len(study.COMBINE_SHAPES) and all(v["bit_equal"] for v in combines.values()), combines
