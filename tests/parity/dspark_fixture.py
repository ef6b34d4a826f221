"""The f4 fixture (tests/fixtures/v41_reference/f4, README there, section "f4"): the drafts DeepSeek's own DSpark
forward (`Transformer.forward_spec`) made along a greedy decode, and what mini's draft module makes from the same
inputs.

Two ways (rel-MAE = mean |a - b| / std(the fixture's draft logits) ~ 1.0; rows: drafts, each [block, V]):
* **fed**: the rings seeded from the recorded prompt features (`dspark_prefill_main_hidden`), each draft after
  writing the recorded step features (`dspark_main_hidden[j]`), anchored on `dspark_anchor_ids[j]`: the draft
  forward alone;
* **end to end**: `mini logits --dspark` fed `greedy_ids[:N+1]`: mini's own prefill and decode produce the
  features. Its scale: the fixture's drafts from the replay prefill's features (`dspark_replay_*`), which move by
  rel-MAE 0.21 (f4) / 0.15 (short).

One draft of f4 (draft 2) sits on an exact double rounding tie of the official arithmetic (docs/fidelity.md, f4):
`fed_silu_rounded` repeats the fed drafts with the SwiGLU's SiLU rounded once from fp64 (`silu_rounded_once`),
one fp32 ulp at that value, which resolves the tie the way the fixture did.

Run as a script for the figures: `python3 tests/parity/dspark_fixture.py [--json out.json]` (MKL_CBWR=AVX2,STRICT
for the reference's sums, as official_fixture.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "v41_reference" / "f4"
CASES = ("reference", "reference_short")


def fixture(case: str) -> dict:
    with np.load(ROOT / f"{case}.npz") as z:
        return {k: z[k] for k in z.files if k != "meta_json"}


def agreement(ours: np.ndarray, ref: np.ndarray, scale: float) -> dict:
    """rel-MAE, top-1 agreement of each position, largest |diff| and each draft's largest |diff|."""
    diff = np.abs(ours.astype(np.float64) - ref)
    return {"rel_mae": float(diff.mean() / scale), "top1": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
            "max_abs": float(diff.max()), "rows": [float(f"{x:.3g}") for x in diff.reshape(len(diff), -1).max(-1)]}


@contextlib.contextmanager
def silu_rounded_once():
    """F.silu computed in fp64, then rounded once to the input's dtype (correctly rounded, but within an fp64 ulp of
    a midpoint), where torch's fp32 x / (1 + exp(-x)) is up to ~1 ulp off (f4 draft 2's tie: at g = 0.404296875
    torch gives 0x1.f0915ep-3, the exact 0.2424647566... rounds to 0x1.f0915cp-3)."""
    silu = torch.nn.functional.silu
    with mock.patch.object(torch.nn.functional, "silu", lambda x: silu(x.double()).to(x.dtype)):
        yield


def fed_drafts(model, cfg, ref: dict) -> dict:
    """mini's drafts from the recorded features: {'logits', 'ids', 'confidence', 'base', 'hidden', 'main_x'}."""
    from mini.model.dspark import DSparkRings, main_x, propose, write_rings
    w, S = model.dspark, len(ref["prompt_ids"])
    rings = DSparkRings(cfg, 1, "cpu", model.dtype)
    prompt = torch.from_numpy(ref["dspark_prefill_main_hidden"]).to(model.dtype)
    write_rings(w, cfg, prompt, torch.arange(S), torch.zeros(S, dtype=torch.long), rings)
    out = {k: [] for k in ("logits", "ids", "confidence", "base", "hidden")}
    out["main_x"] = main_x(w, cfg, prompt).float().numpy()
    for j, p in enumerate(ref["dspark_start_pos"].tolist()):
        step = torch.from_numpy(ref["dspark_main_hidden"][j:j + 1]).to(model.dtype)
        write_rings(w, cfg, step, torch.tensor([p]), torch.zeros(1, dtype=torch.long), rings)
        d = propose(w, cfg, model.embed, model.head, rings, torch.tensor([int(ref["dspark_anchor_ids"][j])]),
                    torch.tensor([p]), torch.tensor([0]))
        for k, v in (("logits", d.logits), ("ids", d.ids), ("confidence", d.confidence),
                     ("base", d.base_logits), ("hidden", d.hidden)):
            out[k].append(v[0].float().numpy())
    return {k: np.stack(v) if isinstance(v, list) else v for k, v in out.items()}


def mini_features(model, cfg, ref: dict) -> tuple[np.ndarray, np.ndarray]:
    """`Model.target_features` of mini's prefill of the prompt [S, 3·D] and of its decode steps fed greedy_ids[:N]
    [N, 3·D]: what the fixture records as dspark_prefill_main_hidden / dspark_main_hidden."""
    import dataclasses

    from mini.model import Batch, KVCache, SeqChunk
    ids, n = [int(t) for t in ref["prompt_ids"]], len(ref["dspark_start_pos"])
    cache = KVCache(cfg, n_slots=1, n_blocks=2, block_tokens=128, device="cpu", dtype=model.dtype)
    with torch.inference_mode():
        batch = Batch.build([SeqChunk(tokens=ids, start=0, slot=0, blocks=[0, 1])], cfg, "cpu", hasher=model.hasher)
        model.forward(dataclasses.replace(batch, logit_rows=torch.arange(len(ids))), cache)
        prompt, steps = model.target_features.float().numpy(), []
        for tok in ref["greedy_ids"][:n].tolist():
            ids.append(int(tok))
            batch = Batch.build([SeqChunk(tokens=ids, start=len(ids) - 1, slot=0, blocks=[0, 1])], cfg, "cpu",
                                hasher=model.hasher)
            model.forward(batch, cache)
            steps.append(model.target_features[0].float().numpy())
    return prompt, np.stack(steps)


def end_to_end(case: str, ref: dict) -> dict:
    """`mini logits --dspark` on the fixture's prompt, fed greedy_ids[:N+1] (in this process)."""
    from mini.cli import main
    n = len(ref["dspark_start_pos"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{case}.npz"
        rc = main(["logits", "--model", str(ROOT), "--ids", ",".join(map(str, ref["prompt_ids"].tolist())),
                   "--force-tokens", ",".join(map(str, ref["greedy_ids"][:n + 1].tolist())), "--dspark",
                   "--device", "cpu", "--dtype", "bfloat16", "--out", str(out)])
        assert rc == 0
        with np.load(out) as z:
            return {k: z[k] for k in z.files}


def measure(model=None) -> list[dict]:
    from mini.model import load_model
    model, cfg = model or load_model(ROOT, dtype=torch.bfloat16)[:2]
    rows = []
    for case in CASES:
        ref = fixture(case)
        scale = float(ref["dspark_logits"].std())
        fed = fed_drafts(model, cfg, ref)
        with silu_rounded_once():
            fed_rounded = fed_drafts(model, cfg, ref)
        e2e = end_to_end(case, ref)
        prompt_features, step_features = mini_features(model, cfg, ref)
        rows.append({
            "case": case, "drafts": len(ref["dspark_start_pos"]),
            "replay_noise": agreement(ref["dspark_replay_logits"], ref["dspark_logits"], scale),
            "fed": agreement(fed["logits"], ref["dspark_logits"], scale),
            "fed_ids_equal": bool((fed["ids"] == ref["dspark_draft_ids"]).all()),
            "fed_confidence_max_abs": float(np.abs(fed["confidence"] - ref["dspark_confidence"]).max()),
            "fed_base_max_abs": float(np.abs(fed["base"] - ref["dspark_base_logits"]).max()),
            "fed_silu_rounded": agreement(fed_rounded["logits"], ref["dspark_logits"], scale),
            "fed_silu_rounded_ids_equal": bool((fed_rounded["ids"] == ref["dspark_draft_ids"]).all()),
            "fed_silu_rounded_confidence_max_abs": float(np.abs(fed_rounded["confidence"]
                                                                - ref["dspark_confidence"]).max()),
            "fed_main_x_max_abs": float(np.abs(fed["main_x"] - ref["dspark_prefill_main_x"]).max()),
            "e2e": agreement(e2e["dspark_logits"], ref["dspark_logits"], scale),
            "e2e_ids_equal": bool((e2e["dspark_draft_ids"] == ref["dspark_draft_ids"]).all()),
            "e2e_confidence_max_abs": float(np.abs(e2e["dspark_confidence"] - ref["dspark_confidence"]).max()),
            "e2e_decode_max_abs": float(np.abs(e2e["decode"] - ref["decode_logits"]).max()),
            "features_prompt_max_abs": float(np.abs(prompt_features - ref["dspark_prefill_main_hidden"]).max()),
            "features_decode_max_abs": float(np.abs(step_features - ref["dspark_main_hidden"]).max()),
        })
    return rows


def measure_in_subprocess(timeout: float = 600) -> list[dict]:
    """`measure` on the fixture machine's BLAS paths (official_fixture.REFERENCE_BLAS: set before torch loads)."""
    from official_fixture import REFERENCE_BLAS  # beside this file, as report() imports it
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        proc = subprocess.run([sys.executable, __file__, "--json", str(out)], capture_output=True, text=True,
                              env={**os.environ, **REFERENCE_BLAS}, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as the reference ran
    from official_fixture import report  # beside this file (the script's own folder, or tests/parity under pytest)
    report(measure(), args.json)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's `mini`, installed or not
    raise SystemExit(main())
