"""The grammar-cost benchmark's plumbing (tools/grammar_tpot.py) on CPU (tiny-v4.1, a small batch, overlapped
steps): the three kinds of round run, the schema rounds spend host time on masks (filled on the worker thread in
`schema`, on the engine's thread in `schema_sync`), and the JSON has the metrics phase_grammar reads."""
import json

import grammar_tpot


def test_grammar_tpot_runs_and_writes_json(tmp_path):
    out = tmp_path / "grammar.json"
    assert grammar_tpot.main(["--batch", "2", "--input-len", "6", "--output-len", "8", "--skip", "2", "--rounds", "1",
                              "--device", "cpu", "--overlap", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert result["suite"] == "grammar-tpot" and result["definition"]["batch"] == 2
    assert result["definition"]["overlap"] is True
    assert m["plain_tpot_ms"] > 0 and m["schema_tpot_ms"] > 0 and m["schema_sync_tpot_ms"] > 0
    for kind in ("plain", "schema", "schema_sync"):
        assert m[f"{kind}_tpot_p90_ms"] >= m[f"{kind}_tpot_ms"]
        assert all(m[f"{kind}_{phase}_ms"] > 0 for phase in ("schedule", "prepare", "forward", "sample"))
    for kind in ("schema", "schema_sync"):
        assert m[f"{kind}_grammar_fill_ms"] > 0 and m[f"{kind}_grammar_exposed_ms"] > 0
        assert m[f"{kind}_grammar_host_ms"] >= m[f"{kind}_grammar_fill_ms"]
    assert m["schema_grammar_background"] == 1.0 and m["schema_sync_grammar_background"] == 0.0
    assert "plain_grammar_fill_ms" not in m
    assert m["slowdown"] == m["schema_tpot_ms"] / m["plain_tpot_ms"] - 1
    assert m["slowdown_sync"] == m["schema_sync_tpot_ms"] / m["plain_tpot_ms"] - 1
