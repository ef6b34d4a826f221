"""Images before the model (mini/model/image_input.py): the official size plan, the formats Pillow decodes, EXIF
orientation, the limits, and the span expansion. f3's own images are checked in tests/parity/test_official_f3.py."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from mini.config import ModelConfig, preset
from mini.model.image_input import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, decode_image, expand_prompt,
                                    load_image, plan_image, preprocess, span_tokens)

F3 = ModelConfig.load(__import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures/v41_reference/f3")


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("size, resized, vit, llm", [
    ((100, 130), (112, 140), (10, 8), (4, 3)),  # kept, padded to whole patches
    ((50, 40), (98, 84), (6, 7), (2, 3)),  # upscaled to min_pixels
    ((400, 260), (378, 238), (17, 27), (6, 9)),  # shrunk to the 64-token cap
])
def test_plan_takes_every_branch_as_the_fixture_records(size, resized, vit, llm):
    p = plan_image(*size, F3)
    assert (p.width, p.height) == resized and (p.n_vit_h, p.n_vit_w) == vit and (p.n_llm_h, p.n_llm_w) == llm


def test_plan_never_exceeds_the_token_cap():
    rng = np.random.default_rng(0)
    for w, h in list(rng.integers(1, 5000, (300, 2))) + [(1, 4000), (4000, 1), (14, 14), (1, 1)]:
        p = plan_image(int(w), int(h), F3)
        assert p.n_tokens <= F3.vision_max_n_token and p.n_tokens == span_tokens(p.n_llm_h, p.n_llm_w)
        assert p.height % 14 == 0 and p.width % 14 == 0 and p.n_vit_h * 14 == p.height
    tall, wide = plan_image(10, 4000, F3), plan_image(4000, 10, F3)
    assert tall.n_llm_w == 1 and wide.n_llm_h == 1  # collapsed to one column / one row of cells


def test_max_wh_ratio_squashes_a_wide_image():
    cfg = F3.replace(vision_max_wh_ratio=2.0)
    assert plan_image(1000, 100, cfg) == plan_image(200, 100, cfg)
    image = preprocess(_noise(1000, 100), cfg)  # stretched, not letterboxed: no gray rows
    assert image.patches.shape[0] == image.plan.n_vit_h * image.plan.n_vit_w


def test_letterbox_is_gray_and_values_are_bf16_in_range():
    img = preprocess(Image.new("RGB", (20, 100), (255, 0, 0)), F3)  # tall: gray bars left and right
    x = img.patches
    assert x.dtype == torch.bfloat16 and x.shape[1:] == (3, 14, 14)
    gray = (127 / 255 - 0.5) / 0.5
    left = x.view(img.plan.n_vit_h, img.plan.n_vit_w, 3, 14, 14)[:, 0, :, :, 0]  # the leftmost pixel column
    assert torch.allclose(left.float(), torch.tensor(gray).to(torch.bfloat16).float())
    assert x.float().max() == 1 and x.float().min() == -1


@pytest.mark.parametrize("fmt, kw, exact", [
    ("PNG", {}, True), ("WEBP", {"lossless": True}, True), ("JPEG", {"quality": 95}, False), ("GIF", {}, False)])
def test_formats_decode_to_rgb(fmt, kw, exact):
    src = _noise(64, 48)
    got = decode_image(_encode(src, fmt, **kw))
    assert got.mode == "RGB" and got.size == (64, 48)
    if exact:
        assert np.array_equal(np.asarray(got), np.asarray(src))


def test_gif_takes_the_first_frame_and_alpha_is_dropped():
    frames = [Image.new("RGB", (30, 20), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(buf.getvalue()).getpixel((5, 5)) == (255, 0, 0)
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    assert decode_image(_encode(rgba, "PNG")).getpixel((0, 0)) == (10, 20, 30)


def test_exif_orientation_is_applied():
    src = _noise(60, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown rotated 90 degrees clockwise
    assert decode_image(_encode(src, "JPEG", exif=exif)).size == (30, 60)
    assert decode_image(_encode(src, "JPEG")).size == (60, 30)


def test_broken_huge_or_unvisionable_images_are_errors():
    with pytest.raises(ValueError, match="not a readable image"):
        decode_image(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(ValueError, match="pixel"):
        decode_image(_encode(_noise(100, 100), "PNG"), max_pixels=9_999)
    with pytest.raises(ValueError, match="no vision tower"):
        preprocess(_noise(10, 10), preset("tiny-v4.1"))


def test_expand_prompt_as_prepare_vl_inputs():
    cfg = preset("tiny-v4.1-vl")
    a, b = load_image(_encode(_noise(50, 40), "PNG"), cfg), load_image(_encode(_noise(300, 200, 1), "PNG"), cfg)
    tok = cfg.image_token_id
    pi = expand_prompt([5, tok, 6, 7, tok, 8], [a, b], cfg)
    assert pi.starts == [1, 3 + a.plan.n_tokens]
    assert len(pi.ids) == 4 + a.plan.n_tokens + b.plan.n_tokens and pi.ids.count(tok) == len(pi.ids) - 4
    span = pi.token_types[1:1 + a.plan.n_tokens]
    w = a.plan.n_llm_w
    assert span == [IMAGE_START] + ([IMAGE] * w + [IMAGE_NEW_LINE]) * a.plan.n_llm_h + [IMAGE_END]
    assert pi.token_types[0] == TEXT and pi.engram_ids()[:2] == [5, -1] and pi.engram_ids()[-1] == 8
    assert a.digest != b.digest and load_image(_encode(_noise(50, 40), "PNG"), cfg).digest == a.digest
    with pytest.raises(ValueError, match="2 image placeholders"):
        expand_prompt([tok, tok], [a], cfg)
