"""Every error in OpenAI's shape: unknown model 404, unknown path 404, wrong method 405, a field mini does not
support 400 naming it (never 200 with the field ignored)."""
import httpx
import openai
import pytest

from server_apps import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_unknown_model_is_404_model_not_found(server):
    url, _ = server
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        err = _error(httpx.post(url + path, json={**body, "model": "gpt-4o"}), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4o" in err["message"]
    with pytest.raises(openai.NotFoundError) as e:
        _client(url).chat.completions.create(model="nope", messages=CHAT["messages"])
    assert e.value.code == "model_not_found" and e.value.param == "model"


def test_unknown_path_and_wrong_method(server):
    url, _ = server
    err = _error(httpx.post(url + "/v1/embeddings", json={"model": MODEL, "input": "x"}), 404)
    assert "/v1/embeddings" in err["message"] and err["type"] == "invalid_request_error"
    _error(httpx.get(url + "/v2/nothing"), 404)
    r = httpx.get(url + "/v1/chat/completions")
    err = _error(r, 405)
    assert "GET" in err["message"] and "POST" in r.headers.get("allow", "")
    _error(httpx.delete(url + "/v1/models"), 405)


@pytest.mark.parametrize("path,extra,name", [
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"audio": {"voice": "x"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text"]}, "modalities"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True, "chunk_size": 4}}, "chunk_size"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "audio"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"n": 17}, "n"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"drop_thinking": False}}, "drop_thinking"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "json_schema"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"logit_bias": {"abc": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"100000": 5}}, "logit_bias"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: x"}}, "grammar"),
    ("/v1/completions", {"structured_outputs": {}}, "exactly one"),
    ("/v1/chat/completions", {"service_tier": "cheapest"}, "service_tier"),
    ("/v1/chat/completions", {"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("/v1/chat/completions", {"verbosity": "extreme"}, "verbosity"),
    ("/v1/chat/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_unsupported_fields_are_400_naming_them(server, path, extra, name):
    url, _ = server
    body = {**(CHAT if "chat" in path else COMPLETION), **extra}
    err = _error(httpx.post(url + path, json=body), 400)
    assert name in err["message"] + str(err["param"]), err


def test_openai_client_raises_bad_request_for_unsupported_fields(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError, match="best_of"):
        _client(url).completions.create(model=MODEL, prompt="x", best_of=2, n=1)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        _client(url).chat.completions.create(model=MODEL, messages=CHAT["messages"], reasoning_effort="extreme")


@pytest.mark.parametrize("extra,param,listed", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort", ["minimal", "low", "medium", "high", "max", "none",
                                                           "1-100"]),
    ({"chat_template_kwargs": {"reasoning_effort": 0}}, "chat_template_kwargs", ["minimal", "1-100"]),
    ({"tool_choice": "sometimes"}, "tool_choice", ["'none'", "'auto'", "'required'"]),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", ["'user'", "'assistant'"]),
    ({"messages": [{"content": "x"}]}, "messages[0].role", ["required"]),
])
def test_errors_name_the_field_as_sent_and_list_what_it_accepts(server, extra, param, listed):
    """`param` is the client's field path, never pydantic's union members (`reasoning_effort.literal[...]`)."""
    url, _ = server
    err = _error(httpx.post(url + "/v1/chat/completions", json={**CHAT, **extra}), 400)
    assert err["param"] == param, err
    assert all(word in err["message"] for word in listed), err


def test_null_fields_are_left_out(server):
    """null is "not given" (never an error, never a setting): top-level fields and the nulls of a message dumped
    from a response (`message.model_dump()`)."""
    url, _ = server
    body = {**CHAT, "temperature": None, "stop": None, "seed": None, "metadata": None, "service_tier": None,
            "messages": [{"role": "user", "content": "hi", "name": None},
                         {"role": "assistant", "content": "yo", "refusal": None, "audio": None, "function_call": None,
                          "tool_calls": None, "annotations": None},
                         {"role": "user", "content": "again"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
