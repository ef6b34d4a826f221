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
