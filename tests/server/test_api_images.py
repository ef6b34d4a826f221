"""Images over the OpenAI API (issue 29 item 4), with the official `openai` client: data URLs, several images per
message and per conversation, usage counting the image tokens, and every refusal a 400 naming the part."""
import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from server_apps import MODEL, fake_app
from PIL import Image

from mini.config import preset
from mini.model.image_input import load_image
from mini.server.app import build_app
from mini.server.bodies import ApiError
from mini.server.images import ImageLimits, check_public
from mini.testing.background_server import BackgroundServer

LIMITS = ImageLimits(max_images=2, max_bytes=100_000, max_pixels=1_000_000)


def _png(w: int, h: int, seed: int = 0, noise: bool = True) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8) if noise else \
        np.zeros((h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _image(data: bytes, **kw) -> dict:
    return {"type": "image_url", "image_url": {"url": _url(data, **kw) if isinstance(data, bytes) else data}}


@pytest.fixture(scope="module")
def client():
    app = build_app("tiny-v4.1-vl", MODEL, device="cpu", dtype=torch.float32, num_blocks=64, block_tokens=16,
                    max_num_seqs=8, images=LIMITS)
    with BackgroundServer(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _chat(client, content, **kw):
    messages = content if isinstance(content, list) and content and "role" in content[0] else \
        [{"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 3),
                                          temperature=0, **kw)


def test_usage_counts_each_image_span(client):
    """An image alone in a message adds exactly its span to the prompt (the user and assistant tags around it are
    added tokens, which split the text the same way with or without it)."""
    a, b = _png(60, 50, 1), _png(90, 160, 2)
    cfg = preset("tiny-v4.1-vl")
    spans = [load_image(x, cfg).plan.n_tokens for x in (a, b)]
    empty = _chat(client, "").usage.prompt_tokens
    one = _chat(client, [_image(a)])
    assert one.usage.prompt_tokens == empty + spans[0]
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 3
    two = _chat(client, [_image(a), _image(b)])  # two in one message: their spans and a blank line between
    assert two.usage.prompt_tokens > empty + sum(spans)


def test_images_in_several_messages_and_n(client):
    a, b = _png(60, 50, 1), _png(60, 50, 3)
    detailed = {"type": "image_url", "image_url": {"url": _url(a), "detail": "low"}}  # a hint: the same tokens
    assert _chat(client, [detailed]).usage.prompt_tokens == _chat(client, [_image(a)]).usage.prompt_tokens
    conversation = [{"role": "user", "content": [{"type": "text", "text": "first"}, _image(a)]},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": [_image(b), {"type": "text", "text": "and this one?"}]}]
    out = _chat(client, conversation, n=2, logprobs=True)
    assert len(out.choices) == 2 and out.choices[0].message.content == out.choices[1].message.content  # greedy
    other = _chat(client, conversation[:2] + [{"role": "user", "content": [_image(a), conversation[2]["content"][1]]}],
                  logprobs=True)
    assert other.usage.prompt_tokens == out.usage.prompt_tokens  # the same sizes: the same span lengths
    first = lambda r: r.choices[0].logprobs.content[0].logprob  # noqa: E731
    assert first(other) != first(out)  # another image, another answer's probabilities


def _refused(client, content, param: str, match: str):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, content)
    err = e.value.body
    assert err["param"] == param, err
    assert match in err["message"], err


def test_bad_images_are_400s_naming_the_part(client):
    ok = _image(_png(60, 50))
    text = {"type": "text", "text": "what is it?"}
    _refused(client, [text, _image(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)], "messages[0].content[1]", "not a readable")
    _refused(client, [text, ok, _image(b"BM" + b"\0" * 64, mime="image/bmp")], "messages[0].content[2]",
             "PNG, JPEG, WebP, GIF")
    _refused(client, [_image("data:image/png;base64,@@@")], "messages[0].content[0]", "not valid base64")
    _refused(client, [_image("data:text/plain;base64,aGk=")], "messages[0].content[0]", "data:image/")
    _refused(client, [ok, ok, ok], "messages[0].content[2]", "at most 2")
    _refused(client, [text, _image(_png(200, 200, noise=True))], "messages[0].content[1]", "100,000-byte limit")
    bomb = _png(2000, 1000, noise=False)  # 2 M pixels in 7 kB: refused from its header, never decoded
    assert len(bomb) < 20_000
    _refused(client, [_image(bomb)], "messages[0].content[0]", "pixel limit")
    _refused(client, [_image("https://example.com/cat.png")], "messages[0].content[0]", "--allow-image-urls")
    _refused(client, [_image("ftp://example.com/cat.png")], "messages[0].content[0]", "data: URL")
    _refused(client, [text, {**ok, "image_url": {**ok["image_url"], "detail": "ultra"}}], "messages[0].content[1]",
             "detail must be")
    _refused(client, [text, {**ok, "cache_control": {}}], "messages[0].content[1]", "unsupported fields")
    _refused(client, [{"role": "system", "content": [ok]}, {"role": "user", "content": "hi"}],
             "messages[0].content[0]", "only user and tool messages")
    assert _chat(client, [text, ok]).choices[0].finish_reason == "length"  # the server still serves


def test_a_model_without_a_vision_tower_answers_400():
    with BackgroundServer(fake_app()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        _refused(client, [{"type": "text", "text": "hi"}, _image(_png(60, 50))], "messages[0].content[1]",
                 "no vision tower")
        # the Responses and Anthropic APIs: the same 400, in each API's shape, naming the part as it names it
        r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": _url(_png(60, 50))}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[1]", r.json()
        assert "no vision tower" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": base64.b64encode(_png(60, 50)).decode()}}]}]})
        error = r.json()
        assert r.status_code == 400 and error["type"] == "error", error
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith("messages[0].content[0]: this model has no vision tower")


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/a.png", "http://localhost/a.png", "http://10.1.2.3/a.png",
                                 "http://192.168.0.1/a.png", "http://169.254.169.254/latest", "http://[::1]/a.png",
                                 "http://0.0.0.0/a.png", "file:///etc/passwd"])
def test_fetching_refuses_private_addresses(url):
    with pytest.raises(ApiError):
        check_public(url, "messages[0].content[0]")
