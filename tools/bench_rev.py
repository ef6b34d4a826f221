#!/usr/bin/env python3
"""A/B benchmark of two revisions of mini, interleaved in one job on one machine.

    python tools/bench_rev.py run REV_A REV_B --suite NAME [--repeat N] [--out DIR] [--env-b VAR=VALUE ...]
        [-- SUITE ARGS...]
    python tools/bench_rev.py pack REV_A REV_B [--dir .cache/bench_rev]

`run` checks out each revision into a temporary directory (a detached `git worktree` for anything git names a
commit by: branch, tag, sha, HEAD~1; or the extracted tarball for a file written by `pack`), then runs the suite
A, B, A, B, ... `--repeat` times each. Every run is a fresh process, `python -m mini bench NAME --json F SUITE
ARGS`, started in that tree with PYTHONPATH set to it (the tool checks that the run imported mini from there). It
prints, per metric, the median of each revision, its min..max spread and the ratio B/A of the medians, and marks a
ratio whose distance from 1 is smaller than either revision's own relative spread as noise. With `--out`, the raw
result of every run goes to DIR/runs.jsonl (one JSON object per line, in run order) and the table to
DIR/summary.json: two files, well inside the device tool's limit of 8 files back.

`--env-a` / `--env-b VAR=VALUE` (repeatable) set environment variables for one side's runs only: a switch's A/B at
one revision (`run HEAD HEAD --env-b MINI_MOE_GEMM=triton`), each side in its own checkout as always.

Both revisions must define the same workload: after the first run of each, the suites' `definition` dicts are
compared and the tool refuses (exit 3) when they differ, naming the keys that differ.

On the GPU machine (the `run` device tool), in one call: `.git` does not travel there (only tracked and untracked
files plus carried ignored paths do), so pack both revisions here first; `.cache/` is ignored, so the tarballs travel
only when carried:
    here:   python tools/bench_rev.py pack main perf/my-change            # -> .cache/bench_rev/*.tar.gz
    device: run(command="python tools/bench_rev.py run .cache/bench_rev/main.tar.gz
                 .cache/bench_rev/perf_my-change.tar.gz --suite moe-layer --repeat 3 --out $OUT/ab",
                carry=[".cache/bench_rev"])
The tool itself uses only the standard library and git (git is not needed for tarballs).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

TARBALL_SUFFIXES = (".tar.gz", ".tgz", ".tar")
DEFAULT_PACK_DIR = Path(".cache/bench_rev")


class CompareError(RuntimeError):
    """The comparison cannot go on; `code` is the process exit status."""

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


@dataclass(frozen=True)
class Tree:
    """One revision checked out on disk."""
    label: str   # what the user called it
    commit: str  # full commit id ("unknown" for a tarball without one)
    path: Path


# ---------------------------------------------------------------------------------------------------- checkouts
def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompareError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _is_tarball(rev: str) -> bool:
    return rev.endswith(TARBALL_SUFFIXES) and Path(rev).is_file()


def resolve(repo: Path, rev: str) -> str:
    return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")


@contextlib.contextmanager
def checkout(repo: Path, rev: str, tmp: Path):
    """Yield a Tree of `rev` under `tmp`; a git worktree is removed again on exit."""
    if _is_tarball(rev):
        dest = Path(tempfile.mkdtemp(prefix="tree-", dir=tmp))
        with tarfile.open(rev) as tar:
            commit = tar.pax_headers.get("comment", "unknown")  # git archive stores the commit id here
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:  # Python < 3.11.4
                tar.extractall(dest)
        name = Path(rev).name
        yield Tree(label=name[: -len(next(s for s in TARBALL_SUFFIXES if name.endswith(s)))], commit=commit,
                   path=dest)
        return
    commit = resolve(repo, rev)
    dest = Path(tempfile.mkdtemp(prefix="worktree-", dir=tmp))
    _git(repo, "worktree", "add", "--detach", "--quiet", "--force", str(dest), commit)
    try:
        yield Tree(label=rev, commit=commit, path=dest)
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(dest)], capture_output=True)


# ---------------------------------------------------------------------------------------------------- one run
def run_suite(tree: Tree, suite: str, extra: list[str], json_path: Path, python: str,
              side_env: dict[str, str] | None = None) -> dict:
    env = dict(os.environ) | (side_env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(tree.path), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [python, "-m", "mini", "bench", suite, "--json", str(json_path), *extra]
    # cwd = the tree: `python -m` puts the working directory first on sys.path
    proc = subprocess.run(cmd, cwd=tree.path, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not json_path.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise CompareError(f"{tree.label}: `{' '.join(cmd)}` exited with {proc.returncode}:\n{tail}")
    result = json.loads(json_path.read_text())
    mini_path = Path(result.get("env", {}).get("mini_path", "/nonexistent")).resolve()
    if not mini_path.is_relative_to(tree.path.resolve()):
        raise CompareError(f"{tree.label}: the run imported mini from {mini_path}, not from its tree {tree.path}")
    return result


def definition_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Keys (dotted for nested dicts) whose values differ between two definitions, with both values."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<missing>"), b.get(k, "<missing>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += definition_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k} (A={va!r}, B={vb!r})")
    return out


# ---------------------------------------------------------------------------------------------------- summary
@dataclass(frozen=True)
class Stat:
    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, xs: list[float]) -> "Stat":
        return cls(statistics.median(xs), min(xs), max(xs))

    @property
    def rel_spread(self) -> float:
        return (self.hi - self.lo) / abs(self.median) if self.median else math.inf


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per metric (in the order the suite reports them): each revision's Stat and the ratio B/A of medians."""
    names = list(dict.fromkeys(k for r in runs["A"] + runs["B"] for k in r["metrics"]))
    table = {}
    for name in names:
        row = {}
        for side in ("A", "B"):
            xs = [r["metrics"][name] for r in runs[side] if name in r["metrics"]]
            row[side] = Stat.of(xs) if xs else None
        a, b = row["A"], row["B"]
        row["ratio"] = b.median / a.median if a and b and a.median else None
        row["noise"] = row["ratio"] is None or abs(row["ratio"] - 1) <= max(a.rel_spread, b.rel_spread)
        table[name] = row
    return table


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"


def format_table(suite: str, trees: dict[str, Tree], order: list[str], table: dict[str, dict]) -> str:
    lines = [f"suite {suite}: runs interleaved {' '.join(order)}"]
    lines += [f"  {side} = {t.label} ({t.commit[:12]})" for side, t in trees.items()]
    rows = [("metric", "A median", "A min..max", "B median", "B min..max", "B/A", "")]
    for name, row in table.items():
        cells = [name]
        for side in ("A", "B"):
            s = row[side]
            cells += [_fmt(s.median), f"{_fmt(s.lo)}..{_fmt(s.hi)}"] if s else ["-", "-"]
        cells += [f"{row['ratio']:.3f}" if row["ratio"] is not None else "-", "noise" if row["noise"] else ""]
        rows.append(tuple(cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                      enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- commands
def compare(repo: Path, rev_a: str, rev_b: str, suite: str, repeat: int, extra: list[str], out: Path | None,
            python: str, env: dict[str, dict[str, str]] | None = None) -> dict:
    """`env`: per side ("A", "B"), environment variables set for its runs only."""
    if repeat < 1:
        raise CompareError("--repeat must be at least 1", 2)
    env = {"A": {}, "B": {}} | (env or {})
    with tempfile.TemporaryDirectory(prefix="bench_rev-") as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        trees = {"A": stack.enter_context(checkout(repo, rev_a, tmp)),
                 "B": stack.enter_context(checkout(repo, rev_b, tmp))}
        runs: dict[str, list[dict]] = {"A": [], "B": []}
        order: list[str] = []
        log = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            log = stack.enter_context(open(out / "runs.jsonl", "w"))
        for i in range(repeat):
            for side, tree in trees.items():
                result = run_suite(tree, suite, extra, tmp / f"{side}{i}.json", python, env[side])
                runs[side].append(result)
                order.append(side)
                print(f"[{len(order)}/{2 * repeat}] {side} {tree.label}: " +
                      " ".join(f"{k}={_fmt(v)}" for k, v in result["metrics"].items()), flush=True)
                if log:
                    log.write(json.dumps({"run": len(order), "side": side, "label": tree.label,
                                          "commit": tree.commit, "result": result}) + "\n")
                    log.flush()
                if len(order) == 2:
                    diff = definition_diff(runs["A"][0]["definition"], runs["B"][0]["definition"])
                    if diff:
                        raise CompareError(f"refusing to compare {suite}: the two revisions define different "
                                           f"workloads; differing definition keys: {'; '.join(diff)}", 3)
                elif runs[side][-1]["definition"] != runs[side][0]["definition"]:
                    raise CompareError(f"{tree.label}: the suite's definition changed between runs", 3)
        table = summarize(runs)
        print(format_table(suite, trees, order, table))
        print(f"  definition: {json.dumps(runs['A'][0]['definition'], sort_keys=True)}")
        summary = {"suite": suite, "definition": runs["A"][0]["definition"], "order": order, "repeat": repeat,
                   "revisions": {s: {"label": t.label, "commit": t.commit, "env": env[s]} for s, t in trees.items()},
                   "env": runs["A"][0].get("env", {}),
                   "metrics": {k: {"A": vars(r["A"]) if r["A"] else None, "B": vars(r["B"]) if r["B"] else None,
                                   "ratio": r["ratio"], "noise": r["noise"]} for k, r in table.items()}}
        if out is not None:
            (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary


# the official-reference checkpoints (~37 MB): no benchmark reads them, and with them two tarballs and the tree pass
# the device call's 64 MiB
PACK_EXCLUDES = (":(exclude)tests/fixtures",)


def pack(repo: Path, revs: list[str], dest: Path) -> list[Path]:
    """`git archive` each revision, less PACK_EXCLUDES, into dest/<rev with / as _>.tar.gz (the commit id travels
    in the tar header)."""
    dest.mkdir(parents=True, exist_ok=True)
    paths = []
    for rev in revs:
        commit = resolve(repo, rev)
        path = (dest / (re.sub(r"[^A-Za-z0-9._-]", "_", rev) + ".tar.gz")).resolve()
        _git(repo, "archive", "--format=tar.gz", "-o", str(path), commit, "--", ".", *PACK_EXCLUDES)
        paths.append(path)
        print(f"{rev} ({commit[:12]}) -> {path}")
    return paths


def _env_pairs(items: list[str]) -> dict[str, str]:
    """VAR=VALUE strings -> a dict; a malformed one is refused with its text."""
    pairs = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise CompareError(f"--env-a / --env-b take VAR=VALUE, got {item!r}", 2)
        pairs[name] = value
    return pairs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_rev.py", description=__doc__.split("\n\n")[0],
                                epilog="Suite options go after `--`.")
    p.add_argument("--repo", type=Path, default=None, help="git repository (default: the one around the cwd)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="A/B two revisions (git revisions or tarballs from `pack`)")
    r.add_argument("rev_a")
    r.add_argument("rev_b")
    r.add_argument("--suite", required=True)
    r.add_argument("--repeat", type=int, default=3, help="runs per revision (default 3)")
    r.add_argument("--out", type=Path, help="write runs.jsonl and summary.json here")
    r.add_argument("--python", default=sys.executable, help="interpreter for the suite runs")
    for side in ("a", "b"):
        r.add_argument(f"--env-{side}", action="append", default=[], metavar="VAR=VALUE",
                       help=f"an environment variable for {side.upper()}'s runs only (repeatable)")
    k = sub.add_parser("pack", help="git archive revisions into tarballs that `run` accepts")
    k.add_argument("revs", nargs="+")
    k.add_argument("--dir", type=Path, help=f"where to write them (default: REPO/{DEFAULT_PACK_DIR})")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = _parser().parse_args(argv)
    try:
        needs_git = args.cmd == "pack" or not all(_is_tarball(r) for r in (args.rev_a, args.rev_b))
        repo = args.repo or (Path(_git(Path.cwd(), "rev-parse", "--show-toplevel")) if needs_git else Path.cwd())
        if args.cmd == "pack":
            paths = pack(repo, args.revs, args.dir or repo / DEFAULT_PACK_DIR)
            rel = [os.path.relpath(p, repo) for p in paths]
            print(f"device call: carry [{os.path.dirname(rel[0])!r}], command: python tools/bench_rev.py run "
                  f"{' '.join(rel)} --suite NAME --out $OUT/ab")
        else:
            compare(repo, args.rev_a, args.rev_b, args.suite, args.repeat, extra, args.out, args.python,
                    {"A": _env_pairs(args.env_a), "B": _env_pairs(args.env_b)})
    except CompareError as e:
        print(f"bench_rev: {e}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
