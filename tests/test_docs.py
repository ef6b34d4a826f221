"""The docs describe today's tree: every file a current doc names exists, every relative link resolves, and every
`MINI_*` switch a doc names is read by the code. The numbered performance reports (docs/perf/NNN_*.md) are history
and are not checked; their template has placeholders."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILE = re.compile(r"[\w./-]+\.(?:py|sh|md|json|txt|toml)\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SWITCH = re.compile(r"\bMINI_[A-Z0-9_]+\b")
FOLDER = re.compile(r"(?<![\w/.-])(?:mini|tests|docs|scripts|tools)/(?:[\w.-]+/)*")


def current_docs() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "perf" / "README.md"]
    return [p for p in docs if p.exists()]


def tracked_files() -> list[str]:
    """The tree's files as git sees them (ignored output left out); every file where there is no git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return [f for f in out.splitlines() if (ROOT / f).exists()]
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]


def code_names() -> set[str]:
    """MINI_* names read by the package, or by the scripts that set up and run it (scripts/test.sh's environment)."""
    found = set()
    for p in [*(ROOT / "mini").rglob("*.py"), *(ROOT / "scripts").rglob("*.sh"), ROOT / ".ci" / "run"]:
        found |= set(SWITCH.findall(p.read_text()))
    return found


OUTSIDE = {"inference/model.py"}  # the official reference code, which the docs cite but the repo does not hold
OUTPUT = re.compile(r"(?:--[\w-]+[ =]|> ?|\b[0-9a-f]{7,40}:)\S+")  # a command's output file, a path in git history


def spans(text: str) -> list[str]:
    """Fenced code blocks and inline code spans."""
    fenced = re.findall(r"```.*?```", text, flags=re.S)
    return fenced + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", " ", text, flags=re.S))


def named_files(text: str) -> set[str]:
    """Paths in backticks, without a test id (`file.py::test`), skipping patterns and placeholders."""
    names = set()
    for span in spans(text):
        for m in FILE.findall(OUTPUT.sub(" ", span.split("::")[0])):
            bare_output = "/" not in m and m.endswith((".json", ".txt"))  # what a command writes, e.g. rank4.json
            if not any(c in m for c in "*{}$") and "NNN" not in m and m not in OUTSIDE and not bare_output:
                names.add(m.lstrip("./"))
    return names


@pytest.mark.parametrize("doc", [d for d in current_docs() if d.parent.name != "perf"],  # perf/README maps gone
                         ids=lambda p: str(p.relative_to(ROOT)))                      # scripts to today's
def test_named_files_exist(doc):
    files = tracked_files()
    missing = sorted(n for n in named_files(doc.read_text())
                     if not any(f == n or f.endswith("/" + n) for f in files))
    assert not missing, f"{doc.relative_to(ROOT)} names files that are not in the tree: {missing}"


@pytest.mark.parametrize("doc", current_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_folders_exist(doc):
    named = {m for span in spans(doc.read_text()) for m in FOLDER.findall(OUTPUT.sub(" ", span)) if "NNN" not in m}
    missing = sorted(d for d in named if not (ROOT / d).is_dir())
    assert not missing, f"{doc.relative_to(ROOT)} names folders that are not in the tree: {missing}"


@pytest.mark.parametrize("doc", current_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    bad = [t for t in LINK.findall(doc.read_text()) if "://" not in t and not (doc.parent / t).exists()]
    assert not bad, f"{doc.relative_to(ROOT)} links to missing paths: {bad}"


@pytest.mark.parametrize("doc", current_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_switch_named_is_read_by_the_code(doc):
    unread = sorted(set(SWITCH.findall(doc.read_text())) - code_names())
    assert not unread, f"{doc.relative_to(ROOT)} names switches no code in mini/ reads: {unread}"


def test_the_checks_can_fail():
    assert named_files("see `mini/ops/nonexistent_op.py::test_x` and `a/*.py`") == {"mini/ops/nonexistent_op.py"}
    assert named_files("`mini bench x --json out.json > log.txt; git show 4816eaa:docs/a.json`") == set()
    assert named_files("```\nmini/a.py  x\n```\nand `b.py`, `c.py`") == {"mini/a.py", "b.py", "c.py"}
    assert named_files("`rank4.json` and `docs/perf/raw/x.json`") == {"docs/perf/raw/x.json"}
    assert "MINI_DTYPE" not in code_names()  # the switch the design notes once named
    assert FOLDER.findall("`mini/dist/` and `tests/parallel/x.py` and `a/mini/b/`") == ["mini/dist/", "tests/parallel/"]
    assert LINK.findall("[x](model.md#sizes) [y](https://e.org)") == ["model.md", "https://e.org"]


def test_the_op_table_names_functions_that_exist():
    """design.md "One op, visible": each `file.py`: `name`, ... cell names functions or classes of that file."""
    table = (ROOT / "docs" / "design.md").read_text().split("## One op, visible", 1)[1].split("\n## ", 1)[0]
    cells = re.findall(r"`(mini/[\w/]+\.py)`: ((?:`\w+`[^`|;]*)+)", table)
    assert len(cells) >= 10, "the table lost its reference column"
    missing = []
    for path, names in cells:
        source = (ROOT / path).read_text()
        for name in re.findall(r"`(\w+)`", names):
            if not re.search(rf"^\s*(?:def|class) {name}\b|^{name} = ", source, flags=re.M):
                missing.append(f"{path}: {name}")
    assert not missing, f"design.md's op table names what its files do not define: {missing}"
