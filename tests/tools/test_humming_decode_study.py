"""tools/humming_decode_study.py's cases on the CPU (the study itself needs Humming on the H200): the synthetic
spreads and the routings a rank4-decode run recorded."""
import json

import humming_decode_study as study
import pytest
import torch

from mini.bench import rank4_decode as rd


def test_synthetic_cases_give_their_rows():
    g = torch.Generator().manual_seed(0)
    fixed = study.case_counts("96x4", 96, 3, g, {})
    assert len(fixed) == 3 and all(int(c.sum()) == 96 and set(c.tolist()) == {0, 4} for c in fixed)
    assert all(int((c > 0).sum()) == 24 for c in fixed)
    uniform = study.case_counts("u96x4", 96, 3, g, {})
    assert all(int(c.sum()) == 384 and all(n % 4 == 0 for n in c.tolist()) for c in uniform)
    assert any(int(c.max()) > 4 for c in uniform)  # drawn with repeats: some expert gets two pairs or more


def test_recorded_routings_replay_the_step(tmp_path):
    """A rank4-decode run on the tiny model records each layer's rows per local expert; the study's step case
    replays them layer by layer, and refuses a run recorded with another number of local experts."""
    import argparse
    p = argparse.ArgumentParser()
    rd.add_args(p)
    args = p.parse_args(["--preset", "tiny-v4.1", "--batch", "3", "--context", "20", "--steps", "1", "--warmup",
                         "1", "--profile-steps", "0", "--device", "cpu", "--dtype", "float32", "--block-tokens", "16"])
    result = rd.run(args)
    path = tmp_path / "rank4.json"
    path.write_text(json.dumps(result))
    recorded = study.step_cases(str(path))
    layers = result["raw"]["b3_c20"]["pairs_per_local_expert"]
    assert list(recorded) == ["step:b3_c20"] and recorded["step:b3_c20"] == list(layers.values())
    assert [sum(1 for n in c if n) for c in layers.values()] == result["raw"]["b3_c20"]["touched_per_layer"]
    experts = len(next(iter(layers.values())))  # tiny-v4.1: 16 experts over EP4
    counts = study.case_counts("step:b3_c20", experts, len(layers) + 1, torch.Generator(), recorded)
    assert [c.tolist() for c in counts] == list(layers.values()) + [list(layers.values())[0]]
    assert study.select_cases(recorded, ["step:b3_c20"]) == recorded
    with pytest.raises(SystemExit, match="not recorded"):
        study.select_cases(recorded, ["step:b3_c20.draft"])
    with pytest.raises(SystemExit, match="local experts"):
        study.case_counts("step:b3_c20", experts + 1, 2, torch.Generator(), recorded)
    path.write_text(json.dumps({"raw": {"b1_c20": {"verify": {"pairs_per_local_expert": {"3": [2, 0]}},
                                                   "draft": {"pairs_per_local_expert": {"0": [1, 0, 3]}}}}}))
    recorded = study.step_cases(str(path))  # a spec-decode run's steps, DSpark's draft MoE with its own experts
    assert recorded == {"step:b1_c20.verify": [[2, 0]], "step:b1_c20.draft": [[1, 0, 3]]}
    assert study.case_experts("step:b1_c20.draft", 96, recorded) == 3 and study.case_experts("u96x4", 96, {}) == 96
    path.write_text(json.dumps({"raw": {"b3_c20": {"step_ms": [1.0]}}}))
    with pytest.raises(SystemExit, match="pairs_per_local_expert"):
        study.step_cases(str(path))
