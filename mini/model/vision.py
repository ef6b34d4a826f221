"""Images in the model (spec §2.8, official `Transformer.merge_image_embeddings`): the vision tower makes each image's
span embeddings once; a forward step writes them over the embedding rows of the span positions it holds.

    span = [image_start] + ([aligner row] * n_llm_w + [image_newline]) * n_llm_h + [image_end]      # [span, D]

Every position of a span (delimiters included) is an image position: the MoE gates there add `bias_vl` instead of
`bias`, and Engram leaves it alone (its gate shut, and its token dead in every n-gram that would reach back over
it: the token history carries -1 there, `PromptImages.engram_ids`). Attention treats it as any other position.

`VisionTower.spans` encodes images; `ImageRows` is one step's share of the spans: which batch rows they cover and
the embeddings those rows take (`Batch.images`). A span may be split across prefill chunks (each chunk's ImageRows
holds its part), although the official code prefills a span in one chunk (the engine keeps it whole).

`SpanCache` is the engine's side of it (`Model.build_batch`): a step's chunks name their spans (mini.step.ImageSpan);
the images it has not encoded yet are encoded in one call, their span embeddings kept by digest, so an image is
encoded once however many chunks, sequences (n > 1, a shared prefix) or recomputations (preemption) read it, and
dropped once no live sequence holds it (`Model.release_images`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from mini.config import ModelConfig
from mini.model.image_input import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ImageInput
from mini.ops.vision import VisionWeights, encode_images
from mini.step import SeqChunk

VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


@dataclass
class VisionTower:
    weights: VisionWeights
    start: torch.Tensor  # [D]: the learned span delimiters
    newline: torch.Tensor
    end: torch.Tensor

    @classmethod
    def take(cls, state: dict, cfg: ModelConfig, device, dtype=torch.bfloat16, consume: bool = True) -> "VisionTower":
        """From the checkpoint tensors (`vision.*`, `aligner.*`, `image_*`), on `device` in `dtype`; `consume`
        removes them from `state` (the text model's loader then never sees them)."""
        names = [n for n in state if n.startswith(VISION_PREFIXES)]
        mine = {n: (state.pop(n) if consume else state[n]).to(device) for n in names}
        return cls(VisionWeights.from_state(mine, cfg, dtype), *(mine[f"image_{k}"].to(dtype)
                                                                 for k in ("start", "newline", "end")))

    @torch.inference_mode()
    def spans(self, images: list[ImageInput], batched: bool | None = None) -> list[torch.Tensor]:
        """The span embeddings [span_tokens, D] of each image: the encoder over all of them in one call (the fast
        path batches them; `batched` as `encode_images`), then the delimiters around its rows."""
        dev = self.start.device
        rows = encode_images([im.patches.to(dev) for im in images],
                             [(im.plan.n_vit_h, im.plan.n_vit_w) for im in images], self.weights, batched)
        out = []
        for im, r in zip(images, rows):
            types = torch.tensor(im.token_types, device=dev)
            span = self.start.new_empty(types.numel(), self.start.shape[0])
            span[types == IMAGE] = r.to(span.dtype)  # reading order, one row per IMAGE slot
            span[types == IMAGE_START] = self.start
            span[types == IMAGE_NEW_LINE] = self.newline
            span[types == IMAGE_END] = self.end
            out.append(span)
        return out


@dataclass
class ImageRows:
    """One forward step's image positions: `rows` [n] (rows of the step's flat batch) take `embeds` [n, D]."""
    rows: torch.Tensor
    embeds: torch.Tensor

    @classmethod
    def of(cls, parts: list[tuple[int, torch.Tensor]], device) -> "ImageRows":
        """From (first batch row, span embeddings or a slice of them) pairs."""
        rows = torch.cat([torch.arange(r, r + e.shape[0]) for r, e in parts]).to(device)
        return cls(rows, torch.cat([e.to(device) for _, e in parts]))

    def merge(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings h [T, D] with the image rows written -> (h, image_mask [T] bool)."""
        h = h.index_put((self.rows,), self.embeds.to(h.dtype))
        mask = torch.zeros(h.shape[0], dtype=torch.bool, device=h.device)
        return h, mask.index_fill(0, self.rows, True)


SPAN_CACHE_BYTES = 256 << 20  # span embeddings kept (V4.1-Flash: 10 MB for a span of 1024 tokens of 5120 bf16)


class SpanCache:
    """Span embeddings by image digest, kept while a live sequence holds the image: the engine says when none does
    (`release`, from StepModel.release_images; a preempted sequence is live, so its recomputation reads them here),
    and past `max_bytes` the least recently used are dropped (never those of the step that reads them; an image
    dropped so is encoded again when a step reads it). `encoded` counts the images the tower has encoded (tests
    read it)."""

    def __init__(self, tower: VisionTower, max_bytes: int = SPAN_CACHE_BYTES):
        self.tower, self.max_bytes = tower, max_bytes
        self.spans: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoded = 0

    def step_rows(self, chunks: list[SeqChunk], device) -> ImageRows | None:
        """The step's image rows: the part of each span inside each chunk, at its rows of the flat batch (chunks in
        order); None when no chunk holds an image position."""
        parts, row = [], 0  # (first batch row, span, first and last + 1 position within the span)
        for c in chunks:
            end = len(c.tokens)
            for span in c.images:
                lo, hi = max(span.start, c.start), min(span.end, end)
                if lo < hi:
                    parts.append((row + lo - c.start, span, lo - span.start, hi - span.start))
            row += end - c.start
        if not parts:
            return None
        new = {span.digest: span.data for _, span, _, _ in parts if span.digest not in self.spans}
        if new:  # one batched encoder call over the step's new images
            for digest, emb in zip(new, self.tower.spans(list(new.values()))):
                self.spans[digest] = emb
            self.encoded += len(new)
        used = {span.digest for _, span, _, _ in parts}
        for digest in used:
            self.spans.move_to_end(digest)
        self._trim(keep=used)
        return ImageRows.of([(r, self.spans[span.digest][a:b]) for r, span, a, b in parts], device)

    def release(self, digests: list[str]) -> None:
        """Drop the span embeddings of these images (those not kept are ignored)."""
        for digest in digests:
            self.spans.pop(digest, None)

    def _trim(self, keep: set[str]) -> None:
        size = sum(e.numel() * e.element_size() for e in self.spans.values())
        for digest in list(self.spans):
            if size <= self.max_bytes:
                break
            if digest not in keep:
                e = self.spans.pop(digest)
                size -= e.numel() * e.element_size()
