"""Images in the prompt, before the model (spec §2.8; the official `image_processor.py`): decode, plan the size,
pad, normalise, cut into ViT patches, and expand each image placeholder into its token span.

Size plan. The image is upscaled (aspect kept) to about `vision_min_pixels` when smaller, its sides rounded up to
a multiple of the patch, and, when the span would exceed `vision_max_n_token` tokens, shrunk to the largest
aspect-preserving size that fits. The picture is then letterboxed into that size (`ImageOps.pad`: resized to fit,
centred, the rest filled with gray 127), scaled to [-1, 1] and rounded to bf16, as the official code does.

Token span. The ViT sees an `n_vit_h x n_vit_w` patch grid; the aligner folds 3x3 patches into one token, so the
LLM sees an `n_llm_h x n_llm_w` grid, written as
    [START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END]
Every position of the span carries `image_token_id`; only the token type tells them apart.

One deliberate difference from the official loader: EXIF orientation is applied (`ImageOps.exif_transpose`), so a
phone photo reaches the model the way its viewer shows it. Without an orientation tag (PNG, GIF, most WebP) it is a
no-op, and the fixtures' images have none (docs/design.md, "Images").
"""
from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch

from mini.config import ModelConfig
from mini.step import ImageSpan

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3  # token types, as prepare_vl_inputs
PAD_GRAY = (127, 127, 127)  # the official fill of the letterbox
MAX_DECODED_PIXELS = 64 * 1024 * 1024  # a larger decoded image is refused before it is decoded (decompression bomb)


@dataclass(frozen=True)
class ImagePlan:
    """Where an image of a given size goes: its pixel size after resizing, its ViT and LLM grids."""
    height: int  # pixels fed to the ViT, multiples of the patch
    width: int
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def n_tokens(self) -> int:
        """Span length: start, n_llm_h rows of n_llm_w images + a newline, end."""
        return span_tokens(self.n_llm_h, self.n_llm_w)


@dataclass
class ImageInput:
    """One preprocessed image: ViT patches [n_vit_h * n_vit_w, 3, p, p] bf16 (raster order, channel-major) and its
    plan. `digest` names the decoded pixels (sha256 of the size and the RGB bytes): equal digests mean equal spans."""
    patches: torch.Tensor
    plan: ImagePlan
    digest: str

    @property
    def token_types(self) -> list[int]:
        return span_types(self.plan.n_llm_h, self.plan.n_llm_w)


def span_tokens(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def span_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


def _llm_grid(height: int, width: int, patch: int, ratio: int) -> tuple[int, int]:
    """The aligner's token grid over the patch grid of this pixel size (a partial 3x3 cell still makes a token)."""
    return math.ceil(height // patch / ratio), math.ceil(width // patch / ratio)


def _fit_token_cap(height: float, width: float, patch: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest pixel size of this aspect ratio whose span fits `max_tokens`: solve h_cells * (w_cells + 1) + 2
    = max_tokens for w_cells with h_cells = w_cells * aspect, floor both, scale the image by the tighter of the two,
    and round down to whole patches. A very tall (wide) image collapses to one column (row) of cells."""
    aspect = height / width
    w_cells = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    h_cells = w_cells * aspect
    cell = patch * ratio
    if w_cells < 1.0:
        return (max_tokens - 2) // 2 * cell, cell
    if h_cells < 1.0:
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(w_cells) * cell / width, math.floor(h_cells) * cell / height)
    return math.floor(height * scale / patch) * patch, math.floor(width * scale / patch) * patch


def plan_image(width: int, height: int, cfg: ModelConfig) -> ImagePlan:
    """The size plan of an image of `width x height` pixels (a pure function of the size and the config)."""
    p, ratio, cap = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    if width <= 0 or height <= 0:
        raise ValueError(f"an image of {width}x{height} pixels has nothing to show")
    if cfg.vision_max_wh_ratio is not None and width > height * cfg.vision_max_wh_ratio:
        width = height * cfg.vision_max_wh_ratio  # squashed to the widest aspect ratio the model takes
    if width * height < cfg.vision_min_pixels:  # upscaled, aspect kept, to about min_pixels (truncated)
        up = (cfg.vision_min_pixels / (width * height)) ** 0.5
        width, height = int(width * up), int(height * up)
    h, w = math.ceil(height / p) * p, math.ceil(width / p) * p
    n_llm_h, n_llm_w = _llm_grid(h, w, p, ratio)
    if span_tokens(n_llm_h, n_llm_w) > cap:  # shrunk from the (upscaled, unrounded) size to the token cap
        h, w = _fit_token_cap(height, width, p, ratio, cap)
        n_llm_h, n_llm_w = _llm_grid(h, w, p, ratio)
        assert span_tokens(n_llm_h, n_llm_w) <= cap, (width, height, cap)
    return ImagePlan(h, w, h // p, w // p, n_llm_h, n_llm_w)


def decode_image(data: bytes, max_pixels: int = MAX_DECODED_PIXELS):
    """Encoded bytes (PNG, JPEG, WebP, GIF: the first frame; anything else Pillow reads) -> an RGB PIL image, EXIF
    orientation applied. Raises ValueError for data that is not an image, or one of more than `max_pixels`."""
    from PIL import Image, ImageOps, UnidentifiedImageError
    try:
        with Image.open(io.BytesIO(data)) as source:
            if source.width * source.height > max_pixels:  # the header is read, the pixels not yet
                raise ValueError(f"image of {source.width}x{source.height} pixels is over the {max_pixels}-pixel "
                                 f"limit")
            source.seek(0)  # an animation's first frame
            image = ImageOps.exif_transpose(source).convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"not a readable image: {e}") from None
    return image


def preprocess(image, cfg: ModelConfig) -> ImageInput:
    """An RGB PIL image -> ViT patches: resized per `plan_image`, letterboxed with gray, (x/255 - 0.5)/0.5 in bf16."""
    from PIL import ImageOps
    if not cfg.vision:
        raise ValueError("this model has no vision tower: it cannot read images")
    image = image.convert("RGB")
    digest = hashlib.sha256(f"{image.width}x{image.height}:".encode() + image.tobytes()).hexdigest()
    plan, p = plan_image(image.width, image.height, cfg), cfg.vision_patch_size
    squash = cfg.vision_max_wh_ratio is not None and image.width >= cfg.vision_max_wh_ratio * image.height
    if squash:  # the official code stretches a too-wide image instead of letterboxing it
        image = image.resize((plan.width, plan.height))
    else:
        image = ImageOps.pad(image, (plan.width, plan.height), color=PAD_GRAY)
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)  # [3, H, W]
    patches = x.reshape(3, plan.n_vit_h, p, plan.n_vit_w, p).permute(1, 3, 0, 2, 4)
    return ImageInput(patches.reshape(plan.n_vit_h * plan.n_vit_w, 3, p, p), plan, digest)


def load_image(data: bytes, cfg: ModelConfig, max_pixels: int = MAX_DECODED_PIXELS) -> ImageInput:
    """Encoded image bytes -> ImageInput."""
    return preprocess(decode_image(data, max_pixels), cfg)


@dataclass
class PromptImages:
    """A prompt with its images expanded (prepare_vl_inputs): token ids with every span at `image_token_id`, the
    token type of every position, and each image's first position."""
    ids: list[int]
    token_types: list[int]
    starts: list[int]
    images: list[ImageInput]

    def engram_ids(self) -> list[int]:
        """The ids with image positions marked dead (-1): they take part in no Engram n-gram (spec §2.3)."""
        return [-1 if t != TEXT else i for i, t in zip(self.ids, self.token_types)]

    def spans(self) -> list[ImageSpan]:
        """The images as an engine request carries them (mini.step.ImageSpan: position, length, digest)."""
        return [ImageSpan(s, im.plan.n_tokens, im.digest, im) for s, im in zip(self.starts, self.images)]


def dead_at_images(tokens: list[int], first: int, spans: list[ImageSpan]) -> list[int]:
    """`tokens` (positions first, first + 1, ...) with the positions inside `spans` marked dead (-1) for Engram:
    a copy when a span reaches into them, else `tokens` itself."""
    end, out = first + len(tokens), tokens
    for span in spans:
        lo, hi = max(span.start, first), min(span.end, end)
        if lo < hi:
            out = list(tokens) if out is tokens else out
            out[lo - first:hi - first] = [-1] * (hi - lo)
    return out


def expand_prompt(ids: list[int], images: list[ImageInput], cfg: ModelConfig) -> PromptImages:
    """Replace the k-th `image_token_id` of `ids` by the span of `images[k]`."""
    marks = sum(1 for i in ids if i == cfg.image_token_id)
    if marks != len(images):
        raise ValueError(f"the prompt has {marks} image placeholders (id {cfg.image_token_id}) for "
                         f"{len(images)} images")
    out, types, starts, it = [], [], [], iter(images)
    for tok in ids:
        if tok != cfg.image_token_id:
            out.append(tok)
            types.append(TEXT)
            continue
        img = next(it)
        starts.append(len(out))
        span = img.token_types
        out += [cfg.image_token_id] * len(span)
        types += span
    return PromptImages(out, types, starts, list(images))


def marked_ids(text: str, marker: str, encode, image_token_id: int) -> list[int]:
    """Token ids of `text` with each `marker` one `image_token_id` (to expand with `expand_prompt`): the text between
    markers is tokenized piece by piece, as an added token splits it."""
    pieces = text.split(marker)
    ids = list(encode(pieces[0]))
    for piece in pieces[1:]:
        ids += [image_token_id, *encode(piece)]
    return ids
