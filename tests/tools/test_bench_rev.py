"""tools/bench_rev.py end to end: real commits in a throw-away git repository holding mini's real CLI and bench
registry plus a stand-in `tiny-cpu` suite whose numbers and log line are fixed per commit."""
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_rev.py"
_spec = importlib.util.spec_from_file_location("bench_rev", TOOL)
bench_rev = sys.modules.setdefault("bench_rev", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bench_rev)

# the stand-in suite: each commit sets TAG, SPEED and SIZE; every run appends TAG to the --log file; TINY_CPU_FACTOR
# in the environment multiplies its speed (a switch)
SUITE_SRC = '''
import os

TAG, SPEED, SIZE = {tag!r}, {speed!r}, {size!r}


def add_args(p):
    p.add_argument("--log", required=True)
    p.add_argument("--size", type=int, default=SIZE)


def run(args):
    with open(args.log, "a") as f:
        f.write(TAG + "\\n")
    return {{"suite": "tiny-cpu", "definition": {{"size": args.size, "model": {{"name": "stub"}}}},
            "metrics": {{"tok_per_s": SPEED * float(os.environ.get("TINY_CPU_FACTOR", "1")), "step_ms": 1000.0 / SPEED}}}}
'''


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _commit(repo, tag, speed, size=8):
    (repo / "mini/bench/tiny_cpu.py").write_text(SUITE_SRC.format(tag=tag, speed=speed, size=size))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"suite {tag}")
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    """A git repo with mini's real entry points and registry; commits A (100 tok/s), B (250 tok/s, branch `fast`),
    C (like B but a different workload size, branch `other-size`)."""
    repo = tmp_path / "repo"
    for rel in ("mini/__init__.py", "mini/__main__.py", "mini/cli.py", "mini/args.py", "mini/bench/__init__.py",
                "mini/testing/__init__.py", "mini/testing/suites.py"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, repo / rel)
    _git(tmp_path, "init", "-q", "-b", "main", str(repo))
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    shas = {"A": _commit(repo, "A", 100.0)}
    shas["B"] = _commit(repo, "B", 250.0)
    _git(repo, "branch", "fast")
    shas["C"] = _commit(repo, "C", 250.0, size=9)
    _git(repo, "branch", "other-size")
    (repo / "mini/bench/tiny_cpu.py").write_text("raise SystemExit('the uncommitted tree must never run')\n")
    return repo, shas


def _tool(cwd, *args):
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True, text=True)


def test_run_interleaves_and_reports_medians_and_ratio(repo, tmp_path):
    repo, shas = repo
    log, out = tmp_path / "order.log", tmp_path / "out"
    proc = _tool(repo, "run", shas["A"][:10], "fast", "--suite", "tiny-cpu", "--repeat", "3", "--out", str(out),
                 "--", "--log", str(log))
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().split() == ["A", "B"] * 3  # A, B, A, B ... and each run used its own revision's code
    row = next(line.split() for line in proc.stdout.splitlines() if line.strip().startswith("tok_per_s"))
    assert row == ["tok_per_s", "100", "100..100", "250", "250..250", "2.500"]
    assert f"B = fast ({shas['B'][:12]})" in proc.stdout
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["side"] for r in runs] == ["A", "B"] * 3
    assert [r["commit"] for r in runs[:2]] == [shas["A"], shas["B"]]
    assert all(r["result"]["suite"] == "tiny-cpu" for r in runs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["tok_per_s"]["ratio"] == pytest.approx(2.5)
    assert summary["metrics"]["step_ms"]["ratio"] == pytest.approx(0.4)
    assert summary["metrics"]["tok_per_s"]["noise"] is False
    assert summary["definition"] == {"size": 8, "model": {"name": "stub"}}
    assert _git(repo, "worktree", "list").count("\n") == 0  # the temporary worktrees are gone


def test_refuses_different_definitions(repo, tmp_path):
    repo, shas = repo
    log = tmp_path / "order.log"
    proc = _tool(repo, "run", "fast", "other-size", "--suite", "tiny-cpu", "--repeat", "4", "--", "--log", str(log))
    assert proc.returncode == 3
    assert "refusing to compare" in proc.stderr and "size (A=8, B=9)" in proc.stderr
    assert "model" not in proc.stderr.split("keys:")[1]  # only the differing key is named
    assert log.read_text().split() == ["B", "C"]  # stopped after the first pair
    # suite arguments go to both sides alike, so overriding the size makes the two comparable
    proc = _tool(repo, "run", "fast", "other-size", "--suite", "tiny-cpu", "--repeat", "1", "--", "--log", str(log),
                 "--size", "8")
    assert proc.returncode == 0, proc.stderr


def test_pack_then_run_tarballs_without_git(repo, tmp_path):
    repo, shas = repo
    pack_dir, log = tmp_path / "packs", tmp_path / "order.log"
    proc = _tool(repo, "pack", "main~2", "fast", "--dir", str(pack_dir))
    assert proc.returncode == 0, proc.stderr
    tars = sorted(pack_dir.iterdir())
    assert [t.name for t in tars] == ["fast.tar.gz", "main_2.tar.gz"]
    elsewhere = tmp_path / "no-git-here"
    elsewhere.mkdir()
    proc = _tool(elsewhere, "run", str(tars[1]), str(tars[0]), "--suite", "tiny-cpu", "--repeat", "2",
                 "--", "--log", str(log))
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().split() == ["A", "B", "A", "B"]
    assert f"A = main_2 ({shas['A'][:12]})" in proc.stdout  # the commit id travels inside the tarball
    assert "2.500" in proc.stdout


def test_a_switch_ab_at_one_revision(repo, tmp_path):
    """--env-b: the same revision on both sides, a variable set for B's runs only."""
    repo, _ = repo
    log, out = tmp_path / "order.log", tmp_path / "out"
    proc = _tool(repo, "run", "fast", "fast", "--suite", "tiny-cpu", "--repeat", "2", "--env-b", "TINY_CPU_FACTOR=2",
                 "--out", str(out), "--", "--log", str(log))
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().split() == ["B"] * 4  # both sides ran commit B's code
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["tok_per_s"]["ratio"] == pytest.approx(2.0)
    assert summary["metrics"]["step_ms"]["ratio"] == pytest.approx(1.0)
    assert summary["revisions"]["A"]["env"] == {} and summary["revisions"]["B"]["env"] == {"TINY_CPU_FACTOR": "2"}
    proc = _tool(repo, "run", "fast", "fast", "--suite", "tiny-cpu", "--env-b", "TINY_CPU_FACTOR", "--", "--log",
                 str(log))
    assert proc.returncode == 2 and "VAR=VALUE" in proc.stderr and "'TINY_CPU_FACTOR'" in proc.stderr


def test_failing_run_is_reported_with_its_output(repo, tmp_path):
    repo, _ = repo
    proc = _tool(repo, "run", "main~2", "fast", "--suite", "tiny-cpu", "--repeat", "1")  # no --log: suite errors
    assert proc.returncode == 1
    assert "main~2" in proc.stderr and "--log" in proc.stderr
    proc = _tool(repo, "run", "main~2", "no-such-branch", "--suite", "tiny-cpu")
    assert proc.returncode == 1 and "no-such-branch" in proc.stderr


def test_summarize_marks_differences_inside_the_spread_as_noise():
    def res(**m):
        return {"metrics": m}
    runs = {"A": [res(x=100.0, y=10.0), res(x=110.0, y=10.0), res(x=90.0, y=10.0)],
            "B": [res(x=104.0, y=20.0), res(x=103.0, y=20.0), res(x=105.0, y=21.0)]}
    table = bench_rev.summarize(runs)
    assert table["x"]["A"] == bench_rev.Stat(100.0, 90.0, 110.0)
    assert table["x"]["ratio"] == pytest.approx(1.04) and table["x"]["noise"]  # A alone spreads 20%
    assert table["y"]["ratio"] == pytest.approx(2.0) and not table["y"]["noise"]


def test_definition_diff_names_nested_keys():
    a = {"batch": 4, "model": {"name": "tiny", "dtype": "fp32"}, "only_a": 1}
    b = {"batch": 4, "model": {"name": "tiny", "dtype": "bf16"}}
    assert bench_rev.definition_diff(a, b) == ["model.dtype (A='fp32', B='bf16')", "only_a (A=1, B='<missing>')"]
    assert bench_rev.definition_diff(a, dict(a)) == []


@pytest.mark.slow
def test_real_tiny_cpu_suite_on_two_commits_of_a_copy_of_this_repo(tmp_path):
    """The real suite and CLI: this repo's tracked files committed twice in a scratch repo, then A/B."""
    repo, out = tmp_path / "mini-copy", tmp_path / "out"
    files = _git(ROOT, "ls-files", "mini").splitlines()
    for rel in files:
        if (ROOT / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, repo / rel)
    _git(tmp_path, "init", "-q", "-b", "main", str(repo))
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "copy")
    with open(repo / "mini/bench/tiny_cpu.py", "a") as f:
        f.write("# a change that does not touch the workload\n")
    _git(repo, "commit", "-q", "-am", "comment")
    proc = _tool(repo, "run", "HEAD~1", "HEAD", "--suite", "tiny-cpu", "--repeat", "1", "--out", str(out), "--",
                 "--batch", "2", "--prompt-len", "16", "--decode-tokens", "3", "--iters", "1", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    for metric in ("prefill_tok_per_s", "decode_tok_per_s", "prefill_ms", "decode_step_ms"):
        row = next(line.split() for line in proc.stdout.splitlines() if line.strip().startswith(metric))
        assert len(row) >= 6 and float(row[1]) > 0 and float(row[3]) > 0 and float(row[5]) > 0, row
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["side"] for r in runs] == ["A", "B"]
    assert runs[0]["result"]["definition"] == runs[1]["result"]["definition"] == {
        "model": "tiny-v4.1", "device": "cpu", "dtype": "float32", "batch": 2, "prompt_len": 16,
        "decode_tokens": 3, "iters": 1, "threads": 1}
    assert all(Path(r["result"]["env"]["mini_path"]).parent != ROOT for r in runs)  # ran the copies, not this tree
