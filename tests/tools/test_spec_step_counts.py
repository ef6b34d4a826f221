"""The step counter of speculation where drafts fail (tools/spec_step_counts.py) on CPU, small: every step is
counted once as a verify or a plain step, late requests are added, and the JSON has the counts report 017 quotes."""
import json

import spec_step_counts


def test_spec_step_counts_counts_every_step(tmp_path):
    out = tmp_path / "counts.json"
    assert spec_step_counts.main(["--requests", "3", "--late", "2", "--late-after", "6", "--input-len", "9",
                                  "--output-len", "12", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["steps"] == r["verify_steps"] + r["plain_decode_steps"]
    assert r["steps"] >= 6 + 12  # the late requests decode their 12 tokens after step 6 at least
    assert r["verify_steps"] >= 1 and r["drafted_tokens"] >= r["accepted_tokens"] >= 0
    assert r["workload"]["late"] == 2 and r["workload"]["requests"] == 3


def test_variants_run_the_same_workload_each_on_its_own_engine(tmp_path):
    """plain speculates nothing; no-ring-writes drafts as dspark does (only the rings it reads differ); a second run
    on dspark's engine starts from the first's acceptance (drafts failed: only probes), fresh-alpha's afresh (full
    drafts first); every variant's steps by kind add up to its steps."""
    out = tmp_path / "variants.json"
    assert spec_step_counts.main(["--requests", "3", "--input-len", "9", "--output-len", "10", "--repeat", "2",
                                  "--variants", "plain,dspark,no-ring-writes,fresh-alpha", "--json", str(out)]) == 0
    runs = {r["variant"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["plain"]["verify_steps"] == 0 and runs["plain"]["drafted_tokens"] == 0
    assert runs["fresh-alpha"]["verify_steps"] >= 1 and runs["fresh-alpha"]["drafted_tokens"] >= 3 * 5
    assert runs["dspark"]["drafted_tokens"] < runs["fresh-alpha"]["drafted_tokens"]
    assert runs["no-ring-writes"]["verify_steps"] == runs["dspark"]["verify_steps"]
    for r in runs.values():
        assert sum(r["steps_by_kind"].values()) == r["steps"], r
        assert set(r["ms_by_kind"]) == set(r["steps_by_kind"])
