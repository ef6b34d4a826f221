"""The suite registry (mini/testing/suites.py) behind `mini bench` and `mini check`: lazy loading, clear errors,
result shape, JSON output."""
import importlib.util
import json
import math
import sys

import pytest

import mini.bench as bench
import mini.check as check
from mini.testing.suites import Suite, SuiteError, check_result, environment, get_suite


def test_registered_suites_point_at_their_modules():
    assert {n: s.module for n, s in bench.SUITES.items()} == {
        "tiny-cpu": "mini.bench.tiny_cpu", "moe-layer": "mini.bench.moe_layer", "rank4": "mini.bench.rank4",
        "tiny-goodput": "mini.bench.serve", "ep-exchange": "mini.bench.ep_exchange", "kernels": "mini.bench.kernels",
        "ep-prefill": "mini.bench.ep_prefill",
        "ep-exact": "mini.check.ep_exact", "decode-host": "mini.bench.decode_host",
        "rank4-decode": "mini.bench.rank4_decode", "long-context": "mini.bench.long_context",
        "spec-decode": "mini.bench.spec_decode"}
    assert {n: s.module for n, s in check.CHECKS.items()} == {
        "fastpath": "mini.check.fastpath", "ep-exact": "mini.check.ep_exact"}
    for registry in (bench.SUITES, check.CHECKS):
        assert all(name == s.name for name, s in registry.items())
        for s in registry.values():  # every registered module exists in this revision
            assert importlib.util.find_spec(s.module) is not None, s.module


def test_unknown_and_missing_suites_give_clear_errors(capsys):
    with pytest.raises(SuiteError, match="unknown suite 'nope'.*tiny-cpu"):
        get_suite("nope", bench.SUITES)
    with pytest.raises(SuiteError, match="lives in mini.bench._not_written, which this revision does not have"):
        Suite("later", "mini.bench._not_written", "").load()
    assert bench.main(["nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err


def test_a_suite_that_fails_to_import_shows_the_real_error(tmp_path, monkeypatch):
    (tmp_path / "suite_with_missing_dep.py").write_text("import mini_no_such_dependency\n")
    (tmp_path / "suite_without_run.py").write_text("def add_args(p):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="mini_no_such_dependency"):
        Suite("x", "suite_with_missing_dep", "").load()
    with pytest.raises(SuiteError, match="has no run"):
        Suite("y", "suite_without_run", "").load()


GOOD = {"suite": "s", "definition": {"n": 3, "model": {"dtype": "fp32"}, "sizes": [1, 2]},
        "metrics": {"tok_per_s": 12.5, "steps": 4}}


@pytest.mark.parametrize("bad, why", [
    ({**GOOD, "suite": "other"}, "labelled 'other'"),
    ({k: v for k, v in GOOD.items() if k != "definition"}, "must return a dict"),
    ({**GOOD, "definition": {"dev": object()}}, "plain JSON values"),
    ({**GOOD, "definition": {"x": math.nan}}, "plain JSON values"),
    ({**GOOD, "metrics": {}}, "non-empty"),
    ({**GOOD, "metrics": {"a": math.inf, "b": 1.0}}, r"\['a'\]"),
    ({**GOOD, "metrics": {"ok": True}}, r"\['ok'\]"),
    ({**GOOD, "metrics": {"s": "fast"}}, r"\['s'\]"),
])
def test_check_result_rejects_malformed_results(bad, why):
    assert check_result("s", GOOD) is GOOD
    with pytest.raises(SuiteError, match=why):
        check_result("s", bad)


def test_main_runs_a_suite_with_its_own_args_and_writes_json(tmp_path, monkeypatch, capsys):
    (tmp_path / "suite_echo.py").write_text(
        "def add_args(p):\n    p.add_argument('--n', type=int, default=2)\n"
        "def run(args):\n"
        "    return {'suite': 'echo', 'definition': {'n': args.n}, 'metrics': {'twice': 2.0 * args.n}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(bench.SUITES, "echo", Suite("echo", "suite_echo", "test suite"))
    out = tmp_path / "sub" / "r.json"
    assert bench.main(["echo", "--n", "7", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["definition"] == {"n": 7} and result["metrics"] == {"twice": 14.0}
    assert result["env"]["mini_path"].endswith("mini") and result["env"]["python"] == sys.version.split()[0]
    assert "twice 14" in capsys.readouterr().out
    assert bench.SUITES["echo"](type("A", (), {"n": 3})())["metrics"]["twice"] == 6.0  # SUITES[name](args)
    with pytest.raises(SystemExit):
        bench.main(["echo", "--unknown-flag"])


def test_results_record_the_backends(monkeypatch):
    """Every result's environment names the backends the ops ran on (mini.ops.backends), once mini.ops is loaded."""
    import mini.ops
    from mini.ops import backends
    monkeypatch.setattr(backends, "_libraries", {"moe_gemm": "triton", "sparse_attn": "triton"})
    monkeypatch.setattr(mini.ops, "_backend", "reference")
    env = environment()
    assert env["backends"] == {"ops": "reference", "moe_gemm": "triton", "sparse_attn": "triton",
                               "deterministic": mini.ops.deterministic()}
