"""Images in the Responses API (`input_image` parts, the official `openai` client) and Anthropic's Messages API
(`image` blocks, the official `anthropic` client): the same decoding, limits and size plan as chat completions
(mini.server.images), errors in each API's own shape naming the part as that API names it, usage counting the image
tokens; and the chat template's image placement, pinned to the official V4.1 encoder's layout."""
import base64

import openai
import pytest
import torch
from server_apps import MODEL
from test_api_images import LIMITS, _png, _url

from mini.server.anthropic import MessagesRequest
from mini.server.anthropic import chat_request as anthropic_chat
from mini.server.app import build_app
from mini.server.images import take_image_parts
from mini.server.protocol import ChatCompletionRequest
from mini.server.responses import ResponsesRequest, normalize_input
from mini.server.responses import chat_request as responses_chat
from mini.testing.background_server import BackgroundServer

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK (the test extra; the GPU image has none)")

PLACEHOLDER = "<｜deepseek_image｜>"  # the official encoder's image placeholder (image_token_id 129264 in V4.1)


@pytest.fixture(scope="module")
def url():
    app = build_app("tiny-v4.1-vl", MODEL, device="cpu", dtype=torch.float32, num_blocks=64, block_tokens=16,
                    max_num_seqs=8, images=LIMITS)
    with BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


A, B = _png(60, 50, 1), _png(90, 160, 2)


def _input_image(data, **kw) -> dict:
    return {"type": "input_image", "image_url": _url(data) if isinstance(data, bytes) else data,
            "detail": "auto", **kw}


def _block(data: bytes, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": base64.b64encode(data).decode()}}


def _chat(oai, content, **kw):
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=3,
                                       temperature=0, **kw)


def _respond(oai, content, **kw):
    return oai.responses.create(model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=3,
                                temperature=0, store=False, **kw)


def _message(claude, content, **kw):
    return claude.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": content}],
                                  extra_body={"temperature": 0}, **kw)


# ---------------------------------------------------------------------------------------------- the Responses API
def test_responses_one_and_two_images_run_as_chat_does(oai):
    """The same images and text give the same prompt (input_tokens = chat's prompt_tokens) and, greedy, the same
    answer as chat completions: one code path."""
    for_chat = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": _url(A)}}]
    one = _respond(oai, [{"type": "input_text", "text": "what is it?"}, _input_image(A)])
    chat = _chat(oai, for_chat)
    assert one.usage.input_tokens == chat.usage.prompt_tokens
    assert one.output_text == chat.choices[0].message.content and one.status == "incomplete"
    two = _respond(oai, [_input_image(A), {"type": "input_text", "text": "and"}, _input_image(B, detail="low")])
    chat_two = _chat(oai, [{"type": "image_url", "image_url": {"url": _url(A)}}, {"type": "text", "text": "and"},
                           {"type": "image_url", "image_url": {"url": _url(B)}}])
    assert two.usage.input_tokens == chat_two.usage.prompt_tokens > one.usage.input_tokens
    # streamed: the last event's response (incomplete: cut at max_output_tokens) counts the same tokens
    events = list(oai.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"}, _input_image(A)]}], max_output_tokens=3, temperature=0,
        store=False, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.usage.input_tokens == one.usage.input_tokens
    assert events[-1].response.output_text == one.output_text


def _responses_refused(oai, content, param: str, match: str, role: str = "user"):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=[{"role": role, "content": content}], max_output_tokens=2)
    err = e.value.body
    assert err["param"] == param, err
    assert match in err["message"], err


def test_responses_bad_images_are_400s_naming_the_part(oai):
    text = {"type": "input_text", "text": "what is it?"}
    _responses_refused(oai, [text, _input_image(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)], "input[0].content[1]",
                       "not a readable")
    _responses_refused(oai, [_input_image(A), _input_image(A), _input_image(A)], "input[0].content[2]", "at most 2")
    _responses_refused(oai, [text, _input_image("https://example.com/cat.png")], "input[0].content[1]",
                       "--allow-image-urls")
    _responses_refused(oai, [{"type": "input_image", "file_id": "file-123", "detail": "auto"}],
                       "input[0].content[0].file_id", "file_id is not supported")
    _responses_refused(oai, [_input_image(A, detail="ultra")], "input[0].content[0]", "detail must be")
    _responses_refused(oai, [{"type": "input_image", "detail": "auto"}], "input[0].content[0]", "needs an image_url")
    _responses_refused(oai, [_input_image(A)], "input[0].content[0]", "only user messages", role="system")
    _responses_refused(oai, [_input_image(A)], "input[0].content[0]", "only user messages", role="assistant")
    assert _respond(oai, [text, _input_image(A)]).status == "incomplete"  # the server still serves


# ---------------------------------------------------------------------------------------------- Anthropic's Messages
def test_anthropic_one_and_two_images_run_as_chat_does(oai, claude):
    chat = _chat(oai, [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": _url(A)}}])
    one = _message(claude, [{"type": "text", "text": "what is it?"}, _block(A)])
    usage = one.usage  # Anthropic's input_tokens leaves out the prefix-cache hits
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert one.content[0].text == chat.choices[0].message.content
    counted = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, _block(A)]}])
    assert counted.input_tokens == chat.usage.prompt_tokens
    two = [_block(A), {"type": "text", "text": "and"}, _block(_png(70, 70, 5), "image/png")]
    total = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": two}]).input_tokens
    with claude.messages.stream(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": two}]) as stream:
        final = stream.get_final_message()
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total > counted.input_tokens


def test_a_tool_result_image_served_by_chat_and_anthropic(oai, claude):
    chat = oai.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": "look"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "snap", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "see"},
                                                           {"type": "image_url", "image_url": {"url": _url(B)}}]}])
    counted = claude.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "snap", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": [
            {"type": "text", "text": "see"}, _block(B)]}]}])
    empty = _chat(oai, "").usage.prompt_tokens
    assert counted.input_tokens == chat.usage.prompt_tokens > empty + 10


def _anthropic_refused(claude, content, match: str):
    with pytest.raises(anthropic.BadRequestError) as e:
        _message(claude, content)
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert match in err["error"]["message"], err


def test_anthropic_bad_images_are_400s_naming_the_part(claude):
    text = {"type": "text", "text": "what is it?"}
    _anthropic_refused(claude, [text, _block(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)], "messages[0].content[1]: not a")
    _anthropic_refused(claude, [text, _block(A, "image/jpeg")], "messages[0].content[1]: the image is PNG, not "
                                                                 "image/jpeg")
    _anthropic_refused(claude, [_block(A, "image/bmp")], "messages[0].content[0].source.media_type")
    _anthropic_refused(claude, [_block(A), _block(A), _block(A)], "messages[0].content[2]: the request has 3 images")
    _anthropic_refused(claude, [text, {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}],
                       "messages[0].content[1]: this server does not fetch image URLs")
    _anthropic_refused(claude, [{"type": "image", "source": {"type": "file", "file_id": "file_1"}}],
                       "no Files API")
    _anthropic_refused(claude, [{**_block(A), "citations": []}], "unsupported fields ['citations']")
    with pytest.raises(anthropic.BadRequestError) as e:  # images come from the user
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": [_block(A)]}])
    assert "messages[1].content[0]" in e.value.body["error"]["message"]
    assert _message(claude, [text, {**_block(A), "cache_control": {"type": "ephemeral"}}]).stop_reason == "max_tokens"


def test_urls_under_allow_image_urls_are_checked_as_for_chat():
    """With --allow-image-urls, a Responses image_url and an Anthropic url source pass the same address check as a
    chat URL: a loopback or private address is refused before any connection."""
    from dataclasses import replace
    app = build_app("tiny-v4.1-vl", MODEL, device="cpu", dtype=torch.float32, num_blocks=16, block_tokens=16,
                    max_num_seqs=2, images=replace(LIMITS, allow_urls=True))
    with BackgroundServer(app) as url:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        _responses_refused(oai, [_input_image("http://127.0.0.1:9/a.png")], "input[0].content[0]", "loopback")
        claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        _anthropic_refused(claude, [{"type": "image", "source": {"type": "url", "url": "http://10.1.2.3/a.png"}}],
                           "messages[0].content[0]: '10.1.2.3' is a private")


# ---------------------------------------------------------------------------------------------- the chat template
def _official(prompt: str, marker: str) -> str:
    return prompt.replace(marker, PLACEHOLDER)


def test_image_placement_is_the_official_encoders():
    """Each image part is a block of its own holding the placeholder, the message's blocks joined by a blank line,
    no other text around it: deepseek-ai/DeepSeek-V4.1-Flash `encoding/encoding.py` (`_process_image_blocks`, then
    `render_message` joining content blocks with "\\n\\n"); the expected strings are those of its
    `encoding/test_encoding.py::test_v41_renders_images` and of its `encoding/README.md` ("OpenAI-style messages").
    The three APIs render the same prompt."""
    def chat(content):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": content}]})
        images = take_image_parts(req.messages)
        return _official(req.prompt(), images.marker), len(images.parts)

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert chat([{"type": "text", "text": "inspect"}, image]) == (
        "<｜begin▁of▁sentence｜><｜User｜>inspect\n\n" + PLACEHOLDER + "<｜Assistant｜></think>", 1)
    readme = "<｜begin▁of▁sentence｜><｜User｜>第一张图\n\n" + PLACEHOLDER + "\n\n有什么内容？<｜Assistant｜></think>"
    assert chat([{"type": "text", "text": "第一张图"}, image, {"type": "text", "text": "有什么内容？"}]) == (readme, 1)
    assert chat([image, image]) == (
        "<｜begin▁of▁sentence｜><｜User｜>" + PLACEHOLDER + "\n\n" + PLACEHOLDER + "<｜Assistant｜></think>", 2)

    req = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "第一张图"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
                                                  "detail": "auto"}, {"type": "input_text", "text": "有什么内容？"}]}]})
    chat_req, images = responses_chat(req, normalize_input(req.input))
    assert _official(chat_req.prompt(), images.marker) == readme and images.parts[0].param == "input[0].content[1]"

    req = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "第一张图"}, _block(b"\x89PNG"), {"type": "text", "text": "有什么内容？"}]}]})
    chat_req, images = anthropic_chat(req)
    assert _official(chat_req.prompt(), images.marker) == readme and images.parts[0].param == "messages[0].content[1]"
    assert images.parts[0].url.startswith("data:image/png;base64,") and images.parts[0].media_type == "image/png"


def test_an_image_in_a_tool_result_is_in_the_result():
    """The official encoder also takes images in a tool's result (`_process_image_blocks` recurses into tool_result
    content; the result's blocks are joined by a blank line inside <tool_result>). The three APIs' tool results
    render the same."""
    call = {"id": "c1", "type": "function", "function": {"name": "snap", "arguments": "{}"}}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "look"}, {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "see"}, image]}]})
    images = take_image_parts(req.messages)
    prompt = _official(req.prompt(), images.marker)
    assert prompt.endswith("<｜User｜><tool_result>see\n\n" + PLACEHOLDER + "</tool_result><｜Assistant｜></think>")
    assert images.parts[0].param == "messages[2].content[1]"

    msg = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "snap", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": [
            {"type": "text", "text": "see"}, _block(b"\x89PNG")]}]}]})
    chat_req, images = anthropic_chat(msg)
    assert _official(chat_req.prompt(), images.marker) == prompt
    assert images.parts[0].param == "messages[2].content[0].content[1]"

    resp = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "look"},
        {"type": "function_call", "call_id": "c1", "name": "snap", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "see"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}]}]})
    chat_req, images = responses_chat(resp, normalize_input(resp.input))
    assert _official(chat_req.prompt(), images.marker) == prompt
    assert images.parts[0].param == "input[2].output[1]"


def test_placeholder_typed_as_text_is_a_400(oai):
    """The official encoder refuses the placeholder typed inside text; here text that tokenizes to the image id
    beside a real image is a 400 naming the messages (it was a 500: more image ids than images). With V4.1's
    tokenizer that text is `<｜deepseek_image｜>`; tiny-v4.1-vl's image id (510) is its BPE token 'oks'."""
    with pytest.raises(openai.BadRequestError) as e:
        _chat(oai, [{"type": "text", "text": "oks"}, {"type": "image_url", "image_url": {"url": _url(A)}}])
    assert e.value.body["param"] == "messages" and "image placeholder token" in e.value.body["message"]
    for content in ("oks", [{"type": "text", "text": "oks"}]):  # and in a request without images
        with pytest.raises(openai.BadRequestError) as e:
            _chat(oai, content)
        assert "image placeholder token (id 510) and no image" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # completions' token ids too
        oai.completions.create(model=MODEL, prompt=[5, 510, 6], max_tokens=1)
    assert "image placeholder token" in e.value.body["message"]
    assert _chat(oai, "ok").choices[0].finish_reason == "length"
