"""The official-reference fixtures (tests/fixtures/v41_reference, README there): small V4.1 checkpoints in the
released layout with the logits DeepSeek's own V4.1 inference code computed on them, and what mini computes on
the same inputs.

Measures, all relative to the reference's prefill logits (rel-MAE = mean |a - b| / std(reference prefill)):
* prefill: one prefill of `prompt_ids` vs `prefill_logits`;
* decode: a prefill, then decode steps fed `greedy_ids[:8]` (forced, not greedy) vs `replay_logits` (one prefill
  of prompt + those tokens: what decode equals by definition, spec §3);
* the reference's own noise: its `prefix_logits` vs its `prefill_logits` (the same positions computed from other
  prompt shapes), the scale against which mini's deviation is judged.

Run as a script for the table: `python3 tests/parity/official_fixture.py [--backend fast --device cuda]`.
"""
from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "v41_reference"
NAMES = ("f0", "f1", "f2")
DECODE_STEPS = 8
# The fixture machine's BLAS paths, for the bit-level checks' subprocesses (set before torch loads): MKL's AVX2 path
# for fp32 GEMMs, oneDNN's AVX-512 one for bf16 matmuls (f3's vision tower; its AVX-512 and AVX-512-BF16 kernels
# give the fixtures' bits, its AMX tiles and its AVX2 path other sums: on an AMX Xeon without the cap 6 f3 tests
# failed by a bf16 ulp on the second image's ViT output), one thread.
REFERENCE_BLAS = {"MKL_CBWR": "AVX2,STRICT", "OMP_NUM_THREADS": "1", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


@dataclasses.dataclass(frozen=True)
class Agreement:
    rel_mae: float  # mean |a - b| / std(reference prefill logits)
    top1: float  # share of rows whose argmax agrees
    max_abs: float  # largest |a - b|

    def row(self) -> dict:
        return {"rel_mae": round(self.rel_mae, 4), "top1": round(self.top1, 4), "max_abs": float(f"{self.max_abs:.3g}")}


def compare(ours: np.ndarray, ref: np.ndarray, scale: float) -> Agreement:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape:
        raise ValueError(f"logit shapes differ: {ours.shape} vs {ref.shape}")
    diff = np.abs(ours - ref)
    return Agreement(float(diff.mean() / scale), float((ours.argmax(-1) == ref.argmax(-1)).mean()),
                     float(diff.max()))


@lru_cache(maxsize=None)
def reference(name: str) -> dict:
    with np.load(FIXTURES / name / "reference.npz") as z:
        out = {k: z[k] for k in z.files}
    out["meta"] = json.loads(str(out.pop("meta_json")))
    return out


def scale_of(name: str) -> float:
    return float(reference(name)["prefill_logits"].astype(np.float64).std())


def own_noise(name: str) -> Agreement:
    """The reference against itself: prefix prefills vs the single prefill (0 on f0)."""
    ref = reference(name)
    return compare(ref["prefix_logits"], ref["prefill_logits"], scale_of(name))


def decode_noise(name: str) -> Agreement:
    """The reference's decode steps vs its replay prefill: what decode vs replay moves by in the reference itself."""
    ref = reference(name)
    return compare(ref["decode_logits"], ref["replay_logits"], scale_of(name))


def load(name: str, device="cpu", dtype=torch.bfloat16):
    from mini.model import load_model
    model, cfg, _ = load_model(FIXTURES / name, device=device, dtype=dtype)
    return model, cfg


def run_logits(model, cfg, ids: list[int], forced: list[int], device="cpu", dtype=torch.bfloat16
               ) -> tuple[np.ndarray, np.ndarray]:
    """(prefill logits [len(ids), V], decode logits [len(forced), V]): one prefill of `ids`, then one decode step
    per forced token (step i is fed forced[i] and returns the logits at its position)."""
    from mini.model import Batch, KVCache, SeqChunk
    total, block_tokens = len(ids) + len(forced), 128
    cache = KVCache(cfg, n_slots=1, n_blocks=(total + block_tokens - 1) // block_tokens, block_tokens=block_tokens,
                    device=device, dtype=dtype)
    blocks = list(range(cache.n_blocks))
    with torch.inference_mode():
        batch = Batch.build([SeqChunk(tokens=list(ids), start=0, slot=0, blocks=blocks)], cfg, device,
                            hasher=model.hasher)
        batch = dataclasses.replace(batch, logit_rows=torch.arange(len(ids), device=batch.input_ids.device))
        prefill = model.forward(batch, cache).float().cpu().numpy()
        history, rows = list(ids), []
        for tok in forced:
            history.append(int(tok))
            batch = Batch.build([SeqChunk(tokens=history, start=len(history) - 1, slot=0, blocks=blocks)], cfg,
                                device, hasher=model.hasher)
            rows.append(model.forward(batch, cache)[0].float().cpu().numpy())
    return prefill, np.stack(rows) if rows else np.zeros((0, prefill.shape[1]), np.float32)


@dataclasses.dataclass
class FixtureResult:
    name: str
    noise: Agreement  # the reference's prefix prefills vs its single prefill
    decode_noise: Agreement  # the reference's decode steps vs its replay
    prefill: Agreement  # mini's prefill vs the reference's prefill
    decode: Agreement  # mini's forced decode vs the reference's replay
    decode_steps: Agreement  # mini's forced decode vs the reference's own decode steps (the same computation)
    prefill_rows: list[float]  # max |mini - reference| per prompt row
    decode_rows: list[float]  # max |mini - reference decode step| per step

    def row(self) -> dict:
        return {"fixture": self.name, "noise": self.noise.row(), "decode_noise": self.decode_noise.row(),
                "prefill": self.prefill.row(), "decode": self.decode.row(), "decode_steps": self.decode_steps.row(),
                "prefill_rows": [float(f"{x:.3g}") for x in self.prefill_rows],
                "decode_rows": [float(f"{x:.3g}") for x in self.decode_rows]}

    @classmethod
    def from_row(cls, r: dict) -> "FixtureResult":
        def agreement(d):
            return Agreement(d["rel_mae"], d["top1"], d["max_abs"])
        return cls(r["fixture"], *(agreement(r[k]) for k in ("noise", "decode_noise", "prefill", "decode",
                                                              "decode_steps")), r["prefill_rows"], r["decode_rows"])


def measure(name: str, device="cpu", dtype=torch.bfloat16, model=None) -> FixtureResult:
    ref = reference(name)
    if model is None:
        model, cfg = load(name, device, dtype)
    else:
        model, cfg = model
    forced = [int(t) for t in ref["greedy_ids"][:DECODE_STEPS]]
    prefill, decode = run_logits(model, cfg, [int(t) for t in ref["prompt_ids"]], forced, device, dtype)
    scale = scale_of(name)
    return FixtureResult(name, own_noise(name), decode_noise(name), compare(prefill, ref["prefill_logits"], scale),
                         compare(decode, ref["replay_logits"], scale), compare(decode, ref["decode_logits"], scale),
                         np.abs(prefill - ref["prefill_logits"]).max(-1).tolist(),
                         np.abs(decode - ref["decode_logits"]).max(-1).tolist())


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="reference", choices=["reference", "fast"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--fixtures", default=",".join(NAMES))
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    from mini import ops
    ops.set_backend(args.backend)
    rows = []
    torch.set_num_threads(1)  # as the reference ran
    for name in args.fixtures.split(","):
        r = measure(name, args.device).row()
        r.update(backend=args.backend, device=args.device)
        rows.append(r)
    report(rows, args.json)
    return 0


def report(rows: list[dict], json_path: str | None) -> None:
    """A harness's rows: one JSON line each on stdout, and all of them in `json_path` when given."""
    for r in rows:
        print(json.dumps(r))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's `mini`, installed or not
    raise SystemExit(main())
