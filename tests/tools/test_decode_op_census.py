"""tools/decode_op_census.py's counting on CPU (the fast backend under Triton's interpreter): Triton launches and
aten ops by call site, per caller, and the launches replayed alone; the whole census of a step on the GPU."""
import decode_op_census as census
import pytest
import torch

import mini.ops
from mini.ops.norm import rms_norm


def test_counts_launches_and_ops_by_site_and_replays_the_launches():
    x, w = torch.randn(3, 64).bfloat16(), (torch.rand(64) + 0.5).bfloat16()
    counts, launches = census.Census(), []
    mini.ops.set_backend("fast", interpret_on_cpu=True)
    try:
        with census.counting_launches(counts, launches), counts:
            y = rms_norm(x, w, 1e-6)  # the fast path: one Triton launch
            mini.ops.set_backend("reference")
            rms_norm(x, w, 1e-6)  # the torch form: its aten ops, each at its line in mini/ops/norm.py
    finally:
        mini.ops.set_backend("reference")
    triton = [(name, site, n) for (kind, name, site), n in counts.sites.items() if kind == "triton"]
    assert len(triton) == 1 and triton[0][0] == "_rms_norm_kernel" and triton[0][2] == 1
    assert triton[0][1].startswith("kernels/rms_norm.py:") and triton[0][1].endswith("<- ops/norm.py:" +
                                                                                       triton[0][1].split(":")[-1])
    aten = {name for (kind, name, site), n in counts.sites.items() if kind == "aten" and site.startswith("ops/norm")}
    assert {"rsqrt", "mul"} <= aten and "empty_like" not in aten  # allocations launch nothing
    assert counts.total() == counts.total("triton") + counts.total("aten") and counts.total("triton") == 1
    callers = dict((c, (n, us)) for c, n, us in census.by_caller(counts, {"_rms_norm_kernel": 2.5}))
    norm = [c for c in callers if c.startswith("ops/norm.py:")]
    assert sum(callers[c][0] for c in norm) == counts.total() and sum(callers[c][1] for c in norm) == 2.5
    assert [name for name, _ in launches] == ["_rms_norm_kernel"]
    y.fill_(float("nan"))
    alone = census.alone_us(launches, cuda=False, repeats=2)  # replays write y again
    assert set(alone) == {"_rms_norm_kernel"} and alone["_rms_norm_kernel"][1] == 1 and alone["_rms_norm_kernel"][0] > 0
    assert not torch.isnan(y).any()  # the replay launched the kernel on the step's own tensors


@pytest.mark.gpu
def test_step_census_at_a_small_preset_gpu(tmp_path):
    import json
    out = tmp_path / "census.json"
    assert census.main(["--preset", "tiny-v4.1-dspark", "--shapes", "2x200", "--widths", "3,1", "--ep", "2",
                        "--engram-rows", "4096", "--alone", "--top", "5", "--json", str(out)]) == 0
    steps = json.loads(out.read_text())["steps"]
    assert set(steps) == {"b2_c200_w3", "b2_c200_w1"}
    for s in steps.values():
        assert s["census_triton"] > 0 and s["graph_kernels"] >= s["census_triton"] and s["graph_step_ms"] > 0
        assert all(a > 0 for _, _, a, _ in s["in_step_vs_alone"])
