"""Walls around the choice of kernels (docs/design.md, Ops and backends): what runs is decided in mini/ops (each op's
dispatch, mini.ops.backends over mini.switches); the model composes ops and asks none of them which backend runs;
kernels and library adapters sit below the ops and import none of them; mini.switches imports nothing of mini.
Read from the source with `ast` (function-level imports included)."""
import ast
from pathlib import Path

import pytest

MINI = Path(__file__).resolve().parents[2] / "mini"
# what says which backend or mode runs: asked only inside mini/ops (and by the engine / tools that set them)
BACKEND_QUERIES = {"use_fast", "deterministic", "backend", "interpreting_on_cpu"}


def imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every import in `path`, relative ones resolved."""
    package = ".".join(("mini", *path.relative_to(MINI).parent.parts))
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out += [(base, a.name) for a in node.names]
    return out


def files(folder: str) -> list[Path]:
    return sorted((MINI / folder).rglob("*.py"))


@pytest.mark.parametrize("path", files("kernels"), ids=lambda p: p.name)
def test_kernels_import_no_ops_model_or_engine(path):
    bad = [m for m, _ in imports(path) if m.split(".")[:2] in (["mini", "ops"], ["mini", "model"],
                                                                ["mini", "engine"], ["mini", "parallel"])]
    assert not bad, f"{path.name} imports {bad}: kernels sit below the ops (an adapter takes what it needs)"


@pytest.mark.parametrize("path", files("model"), ids=lambda p: p.name)
def test_the_model_asks_no_backend(path):
    """The model composes ops; which kernel runs is each op's dispatch (e.g. the indexer's tie rule is
    mini.ops.indexer.tie_widths, not a backend test in the attention layer)."""
    bad = [f"{m}.{n}" for m, n in imports(path)
           if (m == "mini.ops" and n in BACKEND_QUERIES) or m == "mini.ops.backends" or n == "backends"]
    assert not bad, f"{path.name} asks {bad}"


def test_switches_import_nothing_of_mini():
    assert not [m for m, _ in imports(MINI / "switches.py") if m == "mini" or m.startswith("mini.")]
