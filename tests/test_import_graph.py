"""The import graph of `mini/` is a DAG, between modules and between its top-level parts (packages and modules
directly under mini/: config, formats, checkpoint, ops, kernels, model, engine, args, server, parallel, bench, cli,
...). Imports are read from the source with `ast`, wherever they are written: a function-level (lazy) import is an
edge like a module-level one, since it runs whenever that function does. Only imports under `if TYPE_CHECKING:`
are left out (they never run)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mini"


def module_name(path: Path) -> str:
    parts = ("mini", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(path: Path, known: dict[str, Path], type_checking: bool = False) -> set[str]:
    """mini modules that `path` imports (module or function level; `type_checking`: under `if TYPE_CHECKING:`
    too); `from pkg import name` counts as an import of pkg.name when that is a module, else of pkg."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in (ast.walk(tree) if type_checking else _runtime_nodes(tree)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import mini.x.y.attr`-like: the longest known prefix
                t = t.rpartition(".")[0]
            if t.startswith("mini.") and t != name:
                out.add(t)
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node, except the bodies of `if TYPE_CHECKING:` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(path, known) for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(edges):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(edges[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


def part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_finder_sees_cycles_and_every_kind_of_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    g = graph()
    assert "mini.server.app" in g["mini.cli"] or "mini.server" in g["mini.cli"]  # a function-level import
    assert "mini.engine.llm" in g["mini.engine"]  # from a package's own __init__
    assert "mini.config" in g["mini.args"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n")
    assert [n.names[0].name for n in _runtime_nodes(tree) if isinstance(n, ast.Import)] == ["b"]


def test_modules_form_a_dag():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_top_level_parts_form_a_dag():
    parts: dict[str, set[str]] = {}
    for module, targets in graph().items():
        parts.setdefault(part(module), set()).update(part(t) for t in targets if part(t) != part(module))
    cycle = find_cycle(parts)
    assert cycle is None, "import cycle between parts of mini: " + " -> ".join(cycle)


@pytest.mark.parametrize("entry", ["mini.server", "mini.engine", "mini.parallel", "mini.args"])
def test_nothing_below_the_cli_imports_it(entry):
    g = graph()
    below = {m for m in g if m == entry or m.startswith(entry + ".")}
    assert not any("mini.cli" in g[m] for m in below)


PRODUCT = ("mini.engine", "mini.server", "mini.model", "mini.ops", "mini.kernels", "mini.parallel")


def _within(module: str, part_name: str) -> bool:
    return module == part_name or module.startswith(part_name + ".")


def _reaches(g: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for t in g.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_check_does_not_import_bench():
    """`mini check` shares the suite registry with `mini bench` through mini.testing, never through bench."""
    g = graph()
    bad = {m: sorted(t for t in _reaches(g, m) if _within(t, "mini.bench")) for m in g if _within(m, "mini.check")}
    assert not any(bad.values()), {m: t for m, t in bad.items() if t}


@pytest.mark.parametrize("product", PRODUCT)
def test_the_product_imports_no_measurement(product):
    """Measurement (mini.bench) and its support (mini.testing) sit above the product: nothing the engine, server,
    model, ops, kernels or parallel run imports them, directly or through another module."""
    g = graph()
    bad = {m: sorted(t for t in _reaches(g, m) if _within(t, "mini.bench") or _within(t, "mini.testing"))
           for m in g if _within(m, product)}
    assert not any(bad.values()), {m: t for m, t in bad.items() if t}


# ---------------------------------------------------------------------------------------------------- walls
MODEL_FACTORY = "mini.model.load"  # load_model: the one entry point of the model package the engine may call
MODEL_WORDS = ("engram", "hasher", "mhc", "hc_mult", "compressor", "indexer", "sinkhorn")


def test_the_engine_imports_only_the_contract_of_the_model():
    """mini/engine/ steps any mini.step.StepModel: of the model package it imports only the factory, never its
    batches, buffers, layouts or caches (those are the model's, behind the contract)."""
    g = graph()
    bad = {m: sorted(t for t in g[m] if _within(t, "mini.model") and t != MODEL_FACTORY)
           for m in g if _within(m, "mini.engine")}
    assert not any(bad.values()), {m: t for m, t in bad.items() if t}
    assert any("mini.step" in g[m] for m in g if _within(m, "mini.engine"))


def test_the_engine_names_no_model_concept():
    """What a model computes inside (V4.1's Engram, mHC, compressor, indexer) stays behind the contract: no name,
    comment or docstring in mini/engine/ speaks of it."""
    hits = []
    for path in sorted((ROOT / "engine").glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            hits += [f"{path.name}:{i}: {w}" for w in MODEL_WORDS if w in line.lower()]
    assert not hits, hits


def test_the_contract_imports_nothing_of_mini():
    """mini.step sits below both sides: importing it pulls in neither the engine nor the model."""
    assert graph()["mini.step"] == set()


def test_parallel_does_not_import_kernels():
    """mini/parallel/ reaches kernels only through mini.ops (one dispatch per op), never directly."""
    g = graph()
    bad = {m: sorted(t for t in g[m] if _within(t, "mini.kernels")) for m in g if _within(m, "mini.parallel")}
    assert not any(bad.values()), {m: t for m, t in bad.items() if t}


def test_batch_and_layout_form_no_circle():
    """A layout is derived from a batch (mini.model.layout reads it through its own LayoutInput protocol); the batch
    builds its layouts. One direction only, type-checking imports included."""
    known = modules()
    assert "mini.model.layout" in imported(known["mini.model.batch"], known, type_checking=True)
    assert "mini.model.batch" not in imported(known["mini.model.layout"], known, type_checking=True)


BENCH_SHARE = 0.10  # issue 26: the measurement wing may not outgrow a tenth of the package again


def _lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def test_bench_stays_a_tenth_of_the_package():
    """mini/bench/ holds the suites (register + run); what they share with checks, tests and tools lives in
    mini/testing/, studies in tools/. Counted as `wc -l` counts: every line of every .py file."""
    bench, total = _lines((ROOT / "bench").rglob("*.py")), _lines(ROOT.rglob("*.py"))
    assert bench <= BENCH_SHARE * total, f"mini/bench is {bench} of {total} lines ({bench / total:.1%})"
