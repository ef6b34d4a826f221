"""The official-reference fixture f3 (images in the prompt; tests/fixtures/v41_reference/f3, the shared README's
section "f3"): what mini computes from the PNGs, stage by stage, against what the official `image_processor.py` +
`vision.py` + `model.py` computed.

Two cases: `reference.npz` (one image) and `reference_2img.npz` (two). Per case: the pixel tensors, the ViT output
and the aligned embeddings of every image (max |diff|), the layer-0 input rows (`input_embeds`), then the logits as
official_fixture.py measures f0-f2: prefill vs `prefill_logits`, forced decode (fed `greedy_ids[:8]`, plain text)
vs `replay_logits`, beside the reference's own noise (its prefix prefills, its decode vs its replay).

Run as a script for the table: `python3 tests/parity/official_f3.py [--json rows.json]` (the parity test runs it
with MKL's AVX2 path and one thread, as the reference ran).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import official_fixture as of  # noqa: E402

FIXTURE = of.FIXTURES / "f3"
CASES = ("reference", "reference_2img")


@lru_cache(maxsize=None)
def reference(case: str) -> dict:
    with np.load(FIXTURE / f"{case}.npz") as z:
        out = {k: z[k] for k in z.files}
    out["meta"] = json.loads(str(out.pop("meta_json")))
    return out


def scale_of(case: str) -> float:
    return float(reference(case)["prefill_logits"].astype(np.float64).std())


def own_noise(case: str) -> of.Agreement:
    ref = reference(case)
    return of.compare(ref["prefix_logits"], ref["prefill_logits"], scale_of(case))


def decode_noise(case: str) -> of.Agreement:
    ref = reference(case)
    return of.compare(ref["decode_logits"], ref["replay_logits"], scale_of(case))


def prompt(case: str, cfg):
    """The case's PromptImages: its template ids with the fixture's PNGs, preprocessed by mini."""
    from mini.model.image_input import expand_prompt, load_image
    ref = reference(case)
    images = [load_image((FIXTURE / m["path"]).read_bytes(), cfg) for m in ref["meta"]["images"]]
    return expand_prompt([int(t) for t in ref["prompt_template_ids"]], images, cfg)


def run_logits(model, cfg, pi, forced: list[int], device="cpu", dtype=torch.bfloat16):
    """(prefill logits [len(pi.ids), V], decode logits [len(forced), V], span embeddings per image): one prefill of
    the expanded prompt with its images, then one plain-text decode step per forced token."""
    from mini.model import Batch, KVCache, SeqChunk
    from mini.model.vision import ImageRows
    history = pi.engram_ids()  # image positions dead for Engram
    total, block_tokens = len(history) + len(forced), 128
    cache = KVCache(cfg, n_slots=1, n_blocks=-(-total // block_tokens), block_tokens=block_tokens, device=device,
                    dtype=dtype)
    blocks = list(range(cache.n_blocks))
    with torch.inference_mode():
        spans = model.vision.spans(pi.images)
        images = ImageRows.of(list(zip(pi.starts, spans)), device)
        batch = Batch.build([SeqChunk(tokens=list(history), start=0, slot=0, blocks=blocks)], cfg, device,
                            hasher=model.hasher)
        batch = dataclasses.replace(batch, logit_rows=torch.arange(len(history), device=batch.input_ids.device),
                                    images=images)
        prefill = model.forward(batch, cache).float().cpu().numpy()
        rows = []
        for tok in forced:
            history.append(int(tok))
            batch = Batch.build([SeqChunk(tokens=history, start=len(history) - 1, slot=0, blocks=blocks)], cfg,
                                device, hasher=model.hasher)
            rows.append(model.forward(batch, cache)[0].float().cpu().numpy())
    return prefill, np.stack(rows), spans


@dataclasses.dataclass
class CaseResult:
    case: str
    pixels: list[float]  # max |diff| per image
    vit: list[float]
    embeds: list[float]
    input_embeds: float  # max |diff| of the layer-0 input rows of the spans
    noise: of.Agreement
    decode_noise: of.Agreement
    prefill: of.Agreement
    decode: of.Agreement
    decode_steps: of.Agreement
    prefill_rows: list[float]

    def row(self) -> dict:
        out = dataclasses.asdict(self)
        for k in ("noise", "decode_noise", "prefill", "decode", "decode_steps"):
            out[k] = getattr(self, k).row()
        out["prefill_rows"] = [float(f"{x:.3g}") for x in self.prefill_rows]
        return out

    @classmethod
    def from_row(cls, r: dict) -> "CaseResult":
        r = dict(r)
        for k in ("noise", "decode_noise", "prefill", "decode", "decode_steps"):
            r[k] = of.Agreement(r[k]["rel_mae"], r[k]["top1"], r[k]["max_abs"])
        return cls(**{f.name: r[f.name] for f in dataclasses.fields(cls)})


def measure(case: str, model=None, device="cpu", dtype=torch.bfloat16) -> CaseResult:
    from mini.ops.vision import encode_images, vit_one
    ref = reference(case)
    model, cfg = model or of.load("f3", device, dtype)
    pi = prompt(case, cfg)
    forced = [int(t) for t in ref["greedy_ids"][:of.DECODE_STEPS]]
    assert pi.ids == ref["prompt_ids"].tolist() and pi.token_types == ref["token_types"].tolist()
    prefill, decode, spans = run_logits(model, cfg, pi, forced, device, dtype)
    w = model.vision.weights
    pixels, vit, embeds = [], [], []
    for k, im in enumerate(pi.images):
        grid = (im.plan.n_vit_h, im.plan.n_vit_w)
        pixels.append(float(np.abs(im.patches.float().numpy() - ref[f"image{k}_pixel_values"]).max()))
        v = vit_one(im.patches.to(device), *grid, w).float().cpu().numpy()
        vit.append(float(np.abs(v - ref[f"image{k}_vit_out"]).max()))
        e = encode_images([im.patches.to(device)], [grid], w, batched=False)[0].float().cpu().numpy()
        embeds.append(float(np.abs(e - ref[f"image{k}_embeds"]).max()))
    span_rows = np.concatenate([np.arange(s, s + e.shape[0]) for s, e in zip(pi.starts, spans)])
    merged = torch.cat(spans).float().cpu().numpy()
    input_embeds = float(np.abs(merged - ref["input_embeds"][span_rows]).max())
    scale = scale_of(case)
    return CaseResult(case, pixels, vit, embeds, input_embeds, own_noise(case), decode_noise(case),
                      of.compare(prefill, ref["prefill_logits"], scale), of.compare(decode, ref["replay_logits"], scale),
                      of.compare(decode, ref["decode_logits"], scale),
                      np.abs(prefill - ref["prefill_logits"]).max(-1).tolist())


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="reference", choices=["reference", "fast"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    from mini import ops
    ops.set_backend(args.backend)
    torch.set_num_threads(1)  # as the reference ran
    loaded = of.load("f3", args.device)
    rows = []
    for case in CASES:
        r = measure(case, loaded, args.device).row()
        r.update(backend=args.backend, device=args.device)
        rows.append(r)
    of.report(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's `mini`, installed or not
    raise SystemExit(main())
