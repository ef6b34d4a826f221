"""decode-host on CPU (eager only): the full-batch decode steps are found and split into host phases."""
import pytest

from mini.bench import SUITES, _parser


def _args(*extra):
    return _parser(SUITES["decode-host"]).parse_args(
        ["decode-host", "--batch", "3", "--input-len", "9", "--output-len", "6", "--skip", "1", *extra])


def test_decode_host_on_cpu():
    res = SUITES["decode-host"](_args("--device", "cpu"))
    m = res["metrics"]
    assert res["definition"]["modes"] == "eager" and "graphs_step_ms" not in m and "eager_gpu_ms" not in m
    assert m["eager_steps"] == 6 - 1 - 1  # the first token comes from the prefill step; one skipped
    phases = m["eager_schedule_ms"] + m["eager_prepare_ms"] + m["eager_forward_call_ms"] + m["eager_sample_ms"]
    assert 0 < m["eager_forward_call_ms"] < m["eager_step_ms"] and phases <= 1.2 * m["eager_step_ms"]  # medians of parts


def test_decode_host_rejects_unknown_modes_and_short_runs():
    with pytest.raises(ValueError, match="modes"):
        SUITES["decode-host"](_args("--device", "cpu", "--modes", "fast"))
    with pytest.raises(ValueError, match="output-len"):
        SUITES["decode-host"](_args("--device", "cpu", "--skip", "10"))
