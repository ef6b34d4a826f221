"""decode-host on CPU (eager and eager+overlap): the full-batch decode steps are found and split into host phases;
on the GPU (gpu-marked) every mode reports its host share."""
import pytest

from mini.bench import SUITES
from mini.testing.suites import parser


def _args(*extra):
    return parser(SUITES["decode-host"], SUITES, "mini bench").parse_args(
        ["decode-host", "--batch", "3", "--input-len", "9", "--output-len", "6", "--skip", "1", *extra])


@pytest.mark.parametrize("mode", ["eager", "eager+overlap"])
def test_decode_host_on_cpu(mode):
    res = SUITES["decode-host"](_args("--device", "cpu", "--modes", f"{mode},graphs+overlap"))
    m = res["metrics"]
    assert res["definition"]["modes"] == mode and not any(k.startswith("graphs") for k in m)
    assert f"{mode}_gpu_ms" not in m and f"{mode}_host_share" not in m
    # the first token comes from the prefill step; one skipped; overlap computes no step past max_tokens
    assert m[f"{mode}_steps"] == 6 - 1 - 1
    phases = sum(m[f"{mode}_{p}_ms"] for p in ("schedule", "prepare", "forward_call", "sample"))
    assert 0 < m[f"{mode}_forward_call_ms"] < m[f"{mode}_step_ms"] and phases <= 1.2 * m[f"{mode}_step_ms"]


def test_decode_host_rejects_unknown_modes_and_short_runs():
    with pytest.raises(ValueError, match="modes"):
        SUITES["decode-host"](_args("--device", "cpu", "--modes", "fast"))
    with pytest.raises(ValueError, match="CUDA"):
        SUITES["decode-host"](_args("--device", "cpu", "--modes", "graphs"))
    with pytest.raises(ValueError, match="output-len"):
        SUITES["decode-host"](_args("--device", "cpu", "--skip", "10"))


def test_a_failing_mode_keeps_the_others(monkeypatch):
    import mini.bench.decode_host as dh
    measure = dh._measure

    def broken(model, config, tokenizer, args, device, mode):
        if mode == "eager+overlap":
            raise RuntimeError("boom")
        return measure(model, config, tokenizer, args, device, mode)

    monkeypatch.setattr(dh, "_measure", broken)
    res = SUITES["decode-host"](_args("--device", "cpu", "--modes", "eager+overlap,eager"))
    assert res["failed_modes"] == {"eager+overlap": "RuntimeError: boom"}
    assert res["metrics"]["eager_steps"] == 4 and not any(k.startswith("eager+overlap") for k in res["metrics"])
    with pytest.raises(RuntimeError, match="boom"):  # a mode run alone raises
        SUITES["decode-host"](_args("--device", "cpu", "--modes", "eager+overlap"))


@pytest.mark.gpu
def test_decode_host_reports_every_mode_on_the_gpu():
    from mini.ops import set_backend
    set_backend("fast")
    res = SUITES["decode-host"](_args("--batch", "8", "--input-len", "40", "--output-len", "12", "--skip", "2",
                                      "--max-model-len", "1024"))
    m = res["metrics"]
    assert res["definition"]["modes"] == "eager,graphs,graphs+overlap" and "failed_modes" not in res
    for mode in ("eager", "graphs", "graphs+overlap"):
        assert m[f"{mode}_steps"] == 12 - 1 - 2
        # overlapped: the call that launches a step ends while it runs, so its wall time can be under its GPU span
        assert m[f"{mode}_gpu_ms"] > 0 and abs(m[f"{mode}_host_share"]) < 1
        assert m[f"{mode}_period_ms"] > 0 and abs(m[f"{mode}_gpu_idle_share"]) < 1
    assert m["graphs_gpu_ms"] < m["graphs_step_ms"]


def test_det_modes_and_rounds_on_cpu(monkeypatch):
    """`+det` runs a mode with the deterministic mode on and switches it off after; `--rounds` interleaves the
    mode list and reports medians."""
    import mini.bench.decode_host as dh
    import mini.ops
    seen, run_batch = [], dh._run_batch

    def spy(engine, config, args, graphs, overlap, mode):
        seen.append((mode, mini.ops.deterministic(), engine.scheduler.config.chunk_tokens > 0))
        return run_batch(engine, config, args, graphs, overlap, mode)

    monkeypatch.setattr(dh, "_run_batch", spy)
    res = SUITES["decode-host"](_args("--device", "cpu", "--modes", "eager,eager+det", "--rounds", "2"))
    assert seen == [("eager", False, False), ("eager+det", True, True)] * 2 and not mini.ops.deterministic()
    assert res["definition"]["rounds"] == 2 and res["metrics"]["eager+det_steps"] == 4
    with pytest.raises(ValueError, match="rounds"):
        SUITES["decode-host"](_args("--device", "cpu", "--rounds", "0"))
