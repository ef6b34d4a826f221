"""mini.switches is the one reader of every `MINI_*` environment variable: each name it reads is in docs/design.md's
table of switches and each name there is read; no other module of mini/ reads one from `os.environ` (read from the
source with `ast`); a bad value is refused when the record is built, naming the variable and what it takes."""
import ast
import re
from pathlib import Path

import pytest

from mini import switches

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"^MINI_[A-Z0-9_]+$")


def design_table() -> set[str]:
    """The MINI_* names in the first column of design.md's "## Switches" table."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## Switches", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\| `(MINI_[A-Z0-9_]+)`", section, re.M)}


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
             and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ"))


def environ_keys(tree: ast.AST) -> list[ast.AST]:
    """The key expressions of every read of the environment: os.environ[k], os.environ.get(k, ...), k in os.environ,
    os.getenv(k, ...)."""
    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _is_environ(f.value):
                keys.append(node.args[0])
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name)
                                                                           and f.id == "getenv"):
                keys.append(node.args[0])
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            keys.append(node.left)
    return keys


def mini_reads(path: Path) -> list[str]:
    """Why `path` reads a MINI_* variable from the environment: a key that is a MINI_* string, a module constant
    holding one, or a key computed at run time in a module that names MINI_* variables in its code."""
    tree = ast.parse(path.read_text(), str(path))
    constants = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    names_switch = any(isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
                       and re.search(r"\bMINI_[A-Z0-9_]+", n.value) for n in ast.walk(tree))
    found = []
    for key in environ_keys(tree):
        if isinstance(key, ast.Constant):
            if isinstance(key.value, str) and NAME.match(key.value):
                found.append(key.value)
        elif isinstance(key, ast.Name) and key.id in constants:
            if NAME.match(constants[key.id]):
                found.append(f"{key.id} = {constants[key.id]}")
        elif names_switch:
            found.append(f"a computed name ({ast.unparse(key)}) in a module naming MINI_* variables")
    return found


def test_the_scanner_sees_every_kind_of_read():
    src = ('import os\nX = "MINI_X"\nos.environ["MINI_A"]\nos.environ.get("MINI_B", "1")\nos.getenv("MINI_C")\n'
           '"MINI_D" in os.environ\nos.environ.get(X)\nfor v in ("MINI_E",):\n    os.environ.get(v)\n'
           'os.environ.get("RANK")\n')
    p = ROOT / "tests" / "__scanner_probe__.py"
    try:
        p.write_text(src)
        got = mini_reads(p)
    finally:
        p.unlink()
    assert got[:5] == ["MINI_A", "MINI_B", "MINI_C", "MINI_D", "X = MINI_X"] and "computed" in got[5]
    assert len(got) == 6


def test_only_the_switches_module_reads_mini_variables():
    offenders = {str(p.relative_to(ROOT)): why for p in sorted((ROOT / "mini").rglob("*.py"))
                 if p != ROOT / "mini" / "switches.py" and (why := mini_reads(p))}
    assert not offenders, f"read MINI_* variables through mini.switches, not os.environ: {offenders}"


def test_every_switch_read_is_in_the_design_table_and_every_one_there_is_read():
    read = set(switches.VARIABLES.values())
    assert set(switches.VARIABLES) == {f.name for f in switches.dataclasses.fields(switches.Switches)}
    source = (ROOT / "mini" / "switches.py").read_text()
    assert {m for m in re.findall(r'"(MINI_[A-Z0-9_]+)"', source)} == read, "a name read but not in VARIABLES"
    table = design_table()
    assert read - table == set(), f"read but not in docs/design.md's table of switches: {sorted(read - table)}"
    assert table - read == set(), f"in docs/design.md's table but not read: {sorted(table - read)}"


def test_defaults():
    s = switches.read({})
    assert s == switches.Switches()
    assert (s.backend, s.moe_gemm, s.sparse_attn, s.det_sparse_attn, s.ep_glue, s.ep_overlap,
            s.ep_overlap_min_tokens, s.api_key, s.warmup_trace) == (None, "auto", "auto", "flashmla", "fused", 1, 256,
                                                                     None, None)
    assert str(s) == "defaults"


def test_values_are_read_and_normalised():
    s = switches.read({"MINI_BACKEND": "fast", "MINI_MOE_GEMM": " Humming ", "MINI_SPARSE_ATTN": "triton",
                       "MINI_DET_SPARSE_ATTN": "triton", "MINI_EP_GLUE": "eager", "MINI_EP_OVERLAP": "on",
                       "MINI_EP_OVERLAP_MIN_TOKENS": "8", "MINI_CACHE": "/tmp/c", "MINI_API_KEY": "sEcReT",
                       "MINI_WARMUP_TRACE": "/tmp/t.jsonl", "OTHER": "x"})
    assert (s.backend, s.moe_gemm, s.sparse_attn, s.det_sparse_attn, s.ep_glue, s.ep_overlap,
            s.ep_overlap_min_tokens, str(s.cache_dir), s.api_key, s.warmup_trace) == (
        "fast", "humming", "triton", "triton", "eager", 2, 8, "/tmp/c", "sEcReT", "/tmp/t.jsonl")
    assert switches.read({"MINI_EP_OVERLAP": "4"}).ep_overlap == 4
    assert switches.read({"MINI_EP_OVERLAP": "off"}).ep_overlap == 1
    assert "sEcReT" not in str(s) and "sEcReT" not in repr(s) and s.as_dict()["api_key"] == "set"
    assert "MINI_MOE_GEMM=humming" in str(s)


@pytest.mark.parametrize("name,value,accepted", [
    ("MINI_BACKEND", "gpu", "reference or fast"),
    ("MINI_MOE_GEMM", "cutlass", "auto, humming or triton"),
    ("MINI_SPARSE_ATTN", "fa3", "auto, flashmla or triton"),
    ("MINI_DET_SPARSE_ATTN", "flashml", "flashmla or triton"),
    ("MINI_EP_GLUE", "fast", "fused or eager"),
    ("MINI_EP_OVERLAP", "0", "micro-batches per MoE layer"),
    ("MINI_EP_OVERLAP", "two", "micro-batches per MoE layer"),
    ("MINI_EP_OVERLAP_MIN_TOKENS", "many", "whole number"),
])
def test_a_bad_value_names_the_variable_and_what_it_takes(name, value, accepted):
    with pytest.raises(ValueError) as e:
        switches.read({name: value})
    assert f"{name}={value!r}" in str(e.value) and accepted in str(e.value)


def test_the_record_is_read_once_and_refreshed_on_demand(monkeypatch):
    import os
    os.environ["MINI_EP_GLUE"] = "eager"  # (not monkeypatch.setenv: tests/conftest.py's refreshes the record)
    try:
        switches.refresh()
        assert switches.current().ep_glue == "eager"
        os.environ["MINI_EP_GLUE"] = "fused"
        assert switches.current().ep_glue == "eager", "read once: a later change does not apply by itself"
        switches.refresh()
        assert switches.current().ep_glue == "fused"
        monkeypatch.setenv("MINI_EP_GLUE", "eager")
        assert switches.current().ep_glue == "eager", "tests/conftest.py's monkeypatch refreshes the record"
    finally:
        os.environ.pop("MINI_EP_GLUE", None)
        switches.refresh()


def test_importing_the_ops_reads_no_switch():
    """A bad value is refused when the record is built, not when an op file is imported."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, MINI_DET_SPARSE_ATTN="flashml", MINI_BACKEND="gpu")
    code = ("import mini.ops.attention, mini.ops.moe, mini.parallel.exchange, mini.model.load\n"
            "from mini import switches\n"
            "try:\n    switches.current()\nexcept ValueError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "MINI_BACKEND='gpu'" in r.stdout
