"""tools/rank4_modes.py: several rank4 workloads on one build, on the tiny model on the CPU."""
import argparse
import json

import pytest
import rank4_modes

from mini.bench import rank4
from mini.testing.suites import SuiteError, check_result

TINY = ["--preset", "tiny-v4.1", "--tokens", "24", "--seqs", "2", "--steps", "2", "--warmup", "1",
        "--device", "cpu", "--dtype", "float32", "--block-tokens", "16"]


def _args(extra=()):
    p = argparse.ArgumentParser()
    rank4.add_args(p)
    return p.parse_args(TINY + list(extra))


def test_workloads_on_one_build(tmp_path):
    """tools/rank4_modes.py --modes: three workloads on one build, one rank4 result each, defined as the
    separate runs define them; `configure` switches the Engram tables (device tables drawn at their row count,
    the host tables kept) and the routing."""
    assert rank4_modes.main(TINY + ["--modes", "uniform,realistic,uniform_host", "--host-engram-rows", "500",
                                "--out", str(tmp_path)]) == 0
    for name in ("uniform", "realistic", "uniform_host"):
        res = check_result("rank4", json.loads((tmp_path / f"rank4_{name}.json").read_text()))
        alone = rank4.definition(_args(rank4_modes.SAME_BUILD_MODES[name]
                                         + (["--engram-rows", "500"] if name != "uniform" else [])))
        assert res["definition"] == alone and res["raw"]["same_build"] == ["uniform", "realistic", "uniform_host"]
        assert ("engram_gb" in res["metrics"]) == (name != "uniform") and len(res["raw"]["step_ms"]) == 2
    r = rank4.build_rank(_args(["--engram", "host", "--engram-rows", "500"]))
    weights = [b.engram for b in r.model.blocks if b.engram is not None]
    # the build hands the prefetcher the host tables, not the model's stand-ins (on a GPU these are on the device
    # and the prefetcher refuses them: the H200 run at 56388c4 failed so)
    host_tables = r.tables["host"][1]
    assert all(w.embed is v and w.embed_scale is sc for w, (v, sc) in zip(r.host_prefetcher.tables, host_tables))
    rank4.configure(r, _args(["--engram-rows", "300", "--routing", "skewed"]))
    assert [w.embed.shape[0] for w in weights] == [300, 300] and r.model.engram_on_device and r.prefetcher is None
    assert r.exchange.routing == "skewed" and r.batch.engram.form == "ids"
    rank4.configure(r, _args(["--engram", "host", "--engram-rows", "500"]))
    assert [w.embed.shape[0] for w in weights] == [500, 500] and not r.model.engram_on_device
    assert r.exchange.routing == "uniform" and r.batch.engram.form == "pending"
    with pytest.raises(SuiteError, match="no host Engram tables of 600 rows"):
        rank4.configure(r, _args(["--engram", "host", "--engram-rows", "600"]))
    r.host_prefetcher.close()
    with pytest.raises(SystemExit):  # argparse's error: an unknown workload
        rank4_modes.main(TINY + ["--modes", "uniform,fast", "--out", str(tmp_path)])
