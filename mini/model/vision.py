"""Images in the model (spec §2.8, official `Transformer.merge_image_embeddings`): the vision tower makes each image's
span embeddings once; a forward step writes them over the embedding rows of the span positions it holds.

    span = [image_start] + ([aligner row] * n_llm_w + [image_newline]) * n_llm_h + [image_end]      # [span, D]

Every position of a span (delimiters included) is an image position: the MoE gates there add `bias_vl` instead of
`bias`, and Engram leaves it alone (its gate shut, and its token dead in every n-gram that would reach back over
it: the token history carries -1 there, `PromptImages.engram_ids`). Attention treats it as any other position.

`VisionTower.spans` is what an engine calls once per image (and may keep); `ImageRows` is one step's share of the
spans: which batch rows they cover and the embeddings those rows take. A span may be split across prefill chunks
(each chunk's ImageRows holds its part), although the official code prefills a span in one chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mini.config import ModelConfig
from mini.model.image_input import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, ImageInput
from mini.ops.vision import VisionWeights, encode_images

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
