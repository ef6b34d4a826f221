"""Images in requests (issue 29): image parts -> the prompt's ids with each image's span, checked and decoded
before the request reaches the engine, so a bad image is a 400 naming its part and never a step's error. One path
for the three APIs; each names its parts in its own words and hands them here as ImageParts:

    chat completions  {"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": "auto"}}
    Responses         {"type": "input_image", "image_url": "data:image/png;base64,...", "detail": "auto"}
    Anthropic         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "..."}}

A part takes its place among the message's text parts, joined by blank lines as text parts are: the official V4.1
encoder (`encoding/encoding.py` of deepseek-ai/DeepSeek-V4.1-Flash, `_process_image_blocks`) turns each image block
into a text block holding `<｜deepseek_image｜>` and joins the blocks with "\n\n", with no other text around it. Here
the chat is rendered with a per-request marker in that place, the text between markers is tokenized piece by piece
and each marker becomes one `image_token_id`, which `expand_prompt` widens to the image's span (an added token
splits the text the same way, so the pieces tokenize as the whole would). `detail` is a hint: V4.1's size plan
decides the tokens.

Limits (ImageLimits): encoded bytes per image, images per request, decoded pixels per image (read from the header
before any pixel is decoded: a decompression bomb is a 400, never an out-of-memory). PNG, JPEG, WebP and GIF only.
http(s) URLs are refused unless the server allows them (`mini serve --allow-image-urls`); then they are fetched
with a size and time limit, only from public addresses (every address the name resolves to is checked), and a
redirect is followed only to a URL that passes the same checks. What remains: the name is resolved again by the
HTTP client, so a DNS answer that changes between the check and the fetch (rebinding) is not caught.
"""
from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from mini.server.bodies import ApiError

FORMATS = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF"}


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1000 * 1000  # encoded bytes of one image
    max_images: int = 8  # per request
    max_pixels: int = 25 * 1000 * 1000  # decoded pixels of one image (5000 x 5000)
    allow_urls: bool = False  # fetch http(s) image URLs (mini serve --allow-image-urls)
    fetch_timeout_s: float = 10.0  # the whole fetch of one URL, redirects included
    max_redirects: int = 3


MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}


@dataclass
class ImagePart:
    param: str  # where the request holds it, as its API names it: messages[1].content[2], input[0].content[1]
    url: str  # a data: URL, or http(s)
    media_type: str | None = None  # the type the client declared (Anthropic's source.media_type): checked


@dataclass
class ImageParts:
    """A request's images in prompt order; each stands in the rendered chat as `marker` (a fresh uuid per request,
    so no text a client writes can be taken for an image)."""
    marker: str = field(default_factory=lambda: f"<mini-image-{uuid.uuid4().hex}>")
    parts: list[ImagePart] = field(default_factory=list)

    def add(self, param: str, url: str, media_type: str | None = None) -> str:
        """Take an image; returns the text that holds its place."""
        self.parts.append(ImagePart(param, url, media_type))
        return self.marker

    def check_count(self, limits: ImageLimits) -> None:
        if len(self.parts) > limits.max_images:  # named: the first image over the limit
            param = self.parts[limits.max_images].param
            raise ApiError(f"{param}: the request has {len(self.parts)} images; this server takes at most "
                           f"{limits.max_images}", param=param)


def check_detail(detail, param: str, field_name: str = "detail") -> None:
    """`detail` is a hint (V4.1's size plan decides the tokens), but only OpenAI's values are accepted."""
    if detail not in ("auto", "low", "high", "original", None):
        raise ApiError(f"{param}: {field_name} must be auto, low, high or original", param=param)


def take_image_parts(messages) -> ImageParts:
    """Replace every `image_url` part of chat messages (their `content` lists, changed in place) by a text part
    holding the marker; returns the parts in prompt order. ApiError for a malformed part."""
    images = ImageParts()
    for i, msg in enumerate(messages):
        if not isinstance(msg.content, list):
            continue
        for k, part in enumerate(msg.content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            param = f"messages[{i}].content[{k}]"
            if msg.role not in ("user", "tool"):  # a tool's result may be an image, as in the official encoder
                raise ApiError(f"{param}: only user and tool messages carry images", param=param)
            url = part.get("image_url")
            extra = (set(part) - {"type", "image_url"}) | (set(url) - {"url", "detail"} if isinstance(url, dict)
                                                            else set())
            if extra:
                raise ApiError(f"{param}: unsupported fields {sorted(extra)} (an image part has image_url.url and "
                               "image_url.detail)", param=param)
            if isinstance(url, dict):
                check_detail(url.get("detail"), param, "image_url.detail")
            url = url.get("url") if isinstance(url, dict) else url  # also the bare-string form some clients send
            if not isinstance(url, str):
                raise ApiError(f"{param}: image_url needs a 'url' (a data: URL or, if allowed, http(s))", param=param)
            msg.content[k] = {"type": "text", "text": images.add(param, url)}
    return images


def load_images(parts: list[ImagePart], cfg, limits: ImageLimits) -> list:
    """Each part's bytes (data URL, or fetched) decoded and planned -> ImageInput, in order (a worker thread: this
    is slow). ApiError naming the part for anything wrong with it."""
    from mini.model.image_input import load_image
    out = []
    for part in parts:
        data = _bytes_of(part, limits)
        kind = next((name for magic, name in FORMATS.items() if data.startswith(magic)), None)
        if kind is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            kind = "WEBP"
        if kind is None:
            raise ApiError(f"{part.param}: not a supported image (PNG, JPEG, WebP, GIF)", param=part.param)
        if part.media_type is not None and MEDIA_TYPES.get(part.media_type) != kind:
            raise ApiError(f"{part.param}: the image is {kind}, not {part.media_type} as its media_type says",
                           param=part.param)
        try:
            out.append(load_image(data, cfg, limits.max_pixels))
        except ValueError as e:
            raise ApiError(f"{part.param}: {e}", param=part.param) from None
    return out


def prompt_ids(prompt: str, marker: str, n_images: int, tokenizer, image_token_id: int) -> list[int]:
    """The rendered prompt's ids, each marker one `image_token_id`."""
    from mini.model.image_input import marked_ids
    if prompt.count(marker) != n_images:  # a marker in the user's own text cannot happen (a fresh uuid), but say so
        raise ApiError("the prompt's image markers do not match its images")
    ids = marked_ids(prompt, marker, tokenizer.encode, image_token_id)
    if ids.count(image_token_id) != n_images:  # the placeholder token typed as text (the official encoder refuses it)
        raise ApiError(f"the messages' text holds the image placeholder token (id {image_token_id}) outside an "
                       "image part; send images as image parts", param="messages")
    return ids


def _bytes_of(part: ImagePart, limits: ImageLimits) -> bytes:
    url, param = part.url, part.param
    if url.startswith("data:"):
        head, sep, payload = url[5:].partition(",")
        if not sep or not head.startswith("image/") or not head.endswith(";base64"):
            raise ApiError(f"{param}: a data URL must be data:image/<type>;base64,<data>", param=param)
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise ApiError(f"{param}: the image is over this server's {limits.max_bytes:,}-byte limit", param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(f"{param}: the data URL is not valid base64", param=param) from None
    if urlsplit(url).scheme not in ("http", "https"):
        raise ApiError(f"{param}: an image URL is a data: URL (or http(s), if the server allows it)", param=param)
    if not limits.allow_urls:
        raise ApiError(f"{param}: this server does not fetch image URLs (start it with --allow-image-urls); send "
                       "the image inline as a data:image/...;base64 URL", param=param)
    return fetch(url, limits, param)


def check_public(url: str, param: str) -> None:
    """ApiError unless `url` is http(s) and every address its host resolves to is public (no loopback, private,
    link-local, multicast, reserved or unspecified address)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ApiError(f"{param}: {url!r} is not an http(s) URL", param=param)
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                                   type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ApiError(f"{param}: cannot resolve {parts.hostname!r}: {e}", param=param) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global:
            raise ApiError(f"{param}: {parts.hostname!r} is a private, loopback or link-local address ({address}); "
                           "only public addresses are fetched", param=param)


def fetch(url: str, limits: ImageLimits, param: str) -> bytes:
    """GET a public URL within the limits, following at most `max_redirects` redirects, each checked."""
    import httpx
    deadline = time.monotonic() + limits.fetch_timeout_s
    with httpx.Client(follow_redirects=False, timeout=limits.fetch_timeout_s) as client:
        for _ in range(limits.max_redirects + 1):
            check_public(url, param)
            try:
                with client.stream("GET", url) as r:
                    if r.is_redirect:
                        url = urljoin(url, r.headers.get("location", ""))
                        continue
                    if r.status_code != 200:
                        raise ApiError(f"{param}: fetching the image gave HTTP {r.status_code}", param=param)
                    data = bytearray()
                    for chunk in r.iter_bytes():
                        data += chunk
                        if len(data) > limits.max_bytes:
                            raise ApiError(f"{param}: the image is over this server's {limits.max_bytes:,}-byte "
                                           "limit", param=param)
                        if time.monotonic() > deadline:
                            raise ApiError(f"{param}: fetching the image took over {limits.fetch_timeout_s} s",
                                           param=param)
                    return bytes(data)
            except httpx.HTTPError as e:
                raise ApiError(f"{param}: fetching the image failed: {e}", param=param) from None
    raise ApiError(f"{param}: more than {limits.max_redirects} redirects", param=param)
