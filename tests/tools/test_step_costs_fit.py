"""tools/step_costs_fit.py: the speculation cost model refit from spec-decode's JSON."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("step_costs_fit", ROOT / "tools" / "step_costs_fit.py")
step_costs_fit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_costs_fit)


def _result(k, **by_b):
    metrics = {"setup_s": 30.0}
    for b, (decode, draft, verify) in by_b.items():
        at = f"{b}_c4096."
        metrics.update({at + "decode_ms": decode, at + "draft_ms": draft, at + "verify_ms": verify,
                        at + "verify_over_decode": verify / decode})
    return {"definition": {"spec_tokens": k}, "metrics": metrics}


def test_fit_reads_draft_and_row_costs_in_decode_steps():
    """draft = draft / decode; a verify step = one decode step + k rows. B sorted, across files; a B without a
    verify time (a run cut by its cap) is left out."""
    cut = {"definition": {"spec_tokens": 5}, "metrics": {"b16_c4096.decode_ms": 20.0, "b16_c4096.draft_ms": 3.0}}
    got = step_costs_fit.fit([_result(5, b64=(30.0, 6.0, 60.0)), _result(4, b1=(10.0, 1.5, 13.0)), cut])
    assert got == ((1, 0.15, 0.075), (64, 0.2, 0.2))


def test_fit_on_a_stored_measurement_and_the_thresholds():
    """Report 026's H200 run (B = 1 and 64): both B fitted; the acceptance at which each draft length starts paying
    rises with the length and with B, under the fitted costs as under the current ones."""
    import json
    res = json.loads((ROOT / "docs/perf/raw/026/spec_decode_b1_b64_f6811de.json").read_text())
    costs = step_costs_fit.fit([res])
    assert [c[0] for c in costs] == [1, 64] and all(0 < c[1] < 1 and 0 < c[2] < 1 for c in costs)
    t1, t64 = step_costs_fit.thresholds(costs, 1), step_costs_fit.thresholds(costs, 64)
    assert t1 == sorted(t1) and t64 == sorted(t64) and all(a <= b for a, b in zip(t1, t64))


def test_main_refuses_files_without_a_measured_batch(tmp_path):
    f = tmp_path / "empty.json"
    f.write_text('{"definition": {"spec_tokens": 5}, "metrics": {"setup_s": 1.0}}')
    with pytest.raises(SystemExit, match="no B with"):
        step_costs_fit.main([str(f)])
