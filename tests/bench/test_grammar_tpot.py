"""The grammar-cost benchmark's plumbing on CPU (tiny-v4.1, a small batch): both kinds of round run, the schema
rounds spend host time on masks, and the JSON has the metrics phase_grammar reads."""
import json

from mini.bench import grammar_tpot


def test_grammar_tpot_runs_and_writes_json(tmp_path):
    out = tmp_path / "grammar.json"
    assert grammar_tpot.main(["--batch", "2", "--input-len", "6", "--output-len", "6", "--skip", "1", "--rounds", "1",
                              "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert result["suite"] == "grammar-tpot" and result["definition"]["batch"] == 2
    assert m["plain_tpot_ms"] > 0 and m["schema_tpot_ms"] > 0 and m["schema_grammar_host_ms"] > 0
    assert m["slowdown"] == m["schema_tpot_ms"] / m["plain_tpot_ms"] - 1
