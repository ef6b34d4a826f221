"""tools/looped_rows_study.py: the gathered passes at every grid give the same bits (the study's own check), and
its cases are the shapes it names."""
import looped_rows_study as study
import pytest
import torch

from mini.kernels import device_info


def test_cases_hold_a_ranks_share_of_the_capacity():
    for name, (tokens, local) in study.CASES.items():
        ep = 8 if "ep8" in name else 4
        assert local * ep == tokens * study.TOPK, name
    assert study.CASES["verify_b64x6_ep8"][0] * study.TOPK == 18_432  # docs/perf/037's verify capacity


@pytest.mark.gpu
def test_every_grid_gives_the_same_bits_gpu(monkeypatch):
    monkeypatch.setattr(study, "PER_SM", (10 ** 6, 16, 0))  # 0: one program along the rows takes every tile
    out = study.run_case("small", 96, 77)
    timed = {k: v for k, v in out.items() if isinstance(v, dict)}
    assert len(timed) == 6 and all(v["bit_equal"] and v["us"] > 0 for v in timed.values()), timed
    assert device_info.LOOPED_PROGRAMS_PER_SM == 16  # the default is back
