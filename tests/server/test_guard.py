"""What a request must pass before a handler sees it (mini.server.guard) and the limits that keep the event loop
free: API key, content type, browser origin, Host, body size and pace, header deadline, JSON depth, prompt length;
disconnects mid-body log one line. Over the fake model (fast); no assertion depends on this machine's speed: the
server's deadlines are set short here and the test waits generously for their effect."""
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import openai
import pytest

from server_apps import MODEL, fake_app
from fake_model import FakeTokenizer
from mini.args import add_serve_args
from mini.server.app import exposure_warning, policy_from_args, startup_line
from mini.testing.background_server import BackgroundServer
from mini.server.guard import LOOPBACK_HOSTS, Policy, host_name

JSON = {"content-type": "application/json"}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def keyed():
    app = fake_app(policy=Policy(api_key="sesame", allowed_origins=("http://app.example",), max_body_bytes=4000,
                                 read_timeout_s=0.5))
    with BackgroundServer(app) as url:
        yield url


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


KEY = {"authorization": "Bearer sesame"}


# ---------------------------------------------------------------------------------------------------- API key
@pytest.mark.parametrize("path,method", [("/v1/models", "GET"), ("/v1/completions", "POST"),
                                         ("/v1/chat/completions", "POST")])
def test_every_endpoint_but_health_and_metrics_needs_the_key(keyed, path, method):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sesame"}, {"authorization": "Basic x"}):
        r = httpx.request(method, keyed + path, headers={**JSON, **headers}, content=b"{}")
        err = _error(r, 401, "invalid_api_key")
        assert err["type"] == "invalid_request_error" and "Bearer" in err["message"]
    assert httpx.get(keyed + "/health").status_code == 200


def test_metrics_are_open_unless_they_need_the_key(keyed):
    """Scrapers (Prometheus, aiperf) send no key: /metrics is open as vLLM's is; --metrics-need-key closes it."""
    r = httpx.get(keyed + "/metrics")
    assert r.status_code == 200 and "mini_num_requests_running" in r.text
    with BackgroundServer(fake_app(policy=Policy(api_key="sesame", metrics_need_key=True))) as url:
        _error(httpx.get(url + "/metrics"), 401, "invalid_api_key")
        assert httpx.get(url + "/metrics", headers=KEY).status_code == 200
    assert policy_from_args(_serve_args("--metrics-need-key")).metrics_need_key
    assert not policy_from_args(_serve_args()).metrics_need_key


@pytest.mark.parametrize("method,path,allow", [("PUT", "/v1/chat/completions", "POST"), ("POST", "/health", "GET"),
                                               ("DELETE", "/v1/completions", "POST"), ("PATCH", "/v1/models", "GET")])
def test_a_wrong_method_is_405_before_any_body_check(keyed, method, path, allow):
    """No body, no content type, a body over the cap: the method is what is wrong, so it is what the client
    hears (with Allow)."""
    for extra in ({}, {"content": b"x" * 5000, "headers": {**KEY, "content-type": "text/plain"}}):
        r = httpx.request(method, keyed + path, **{"headers": KEY, **extra})
        _error(r, 405, "method_not_allowed")
        assert allow in r.headers["allow"]


def test_the_key_opens_the_api_and_the_openai_client_sees_401(keyed):
    assert httpx.get(keyed + "/v1/models", headers=KEY).status_code == 200
    ok = openai.OpenAI(base_url=keyed + "/v1", api_key="sesame", max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed + "/v1", api_key="nope", max_retries=0).models.list()


# ---------------------------------------------------------------------------------------------------- content type
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_json_endpoints_refuse_other_content_types(keyed, content_type):
    headers = {**KEY, **({"content-type": content_type} if content_type else {})}
    r = httpx.post(keyed + "/v1/completions", headers=headers, content=json.dumps(COMPLETION).encode())
    _error(r, 415, "unsupported_media_type")


def test_json_with_a_charset_is_json(keyed):
    r = httpx.post(keyed + "/v1/completions", headers={**KEY, "content-type": "Application/JSON; charset=utf-8"},
                   content=json.dumps(COMPLETION).encode())
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------------- origin, host
def test_cross_origin_requests_need_a_listed_origin(keyed):
    body = json.dumps(COMPLETION).encode()
    for headers in ({"origin": "http://evil.example"}, {"origin": "null"}, {"sec-fetch-site": "cross-site"},
                    {"origin": "http://localhost:3000", "sec-fetch-site": "same-site"}):
        r = httpx.post(keyed + "/v1/completions", headers={**KEY, **JSON, **headers}, content=body)
        _error(r, 403, "origin_not_allowed")
    same = "http://" + urlparse(keyed).netloc  # the server's own page
    r = httpx.post(keyed + "/v1/completions", headers={**KEY, **JSON, "origin": same}, content=body)
    assert r.status_code == 200, r.text
    r = httpx.post(keyed + "/v1/completions", headers={**KEY, **JSON, "origin": "http://app.example",
                                                       "sec-fetch-site": "cross-site"}, content=body)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"


def test_preflight_of_a_listed_origin_is_answered_without_the_key(keyed):
    pre = {"origin": "http://app.example", "access-control-request-method": "POST",
           "access-control-request-headers": "authorization, content-type"}
    r = httpx.options(keyed + "/v1/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(keyed + "/v1/completions", headers={**pre, "origin": "http://evil.example"})
    _error(r, 403, "origin_not_allowed")


def test_host_header_must_be_allowed(keyed):
    port = urlparse(keyed).port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.2"):
        _error(httpx.get(keyed + "/health", headers={"host": host}), 400, "host_not_allowed")
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}"):
        assert httpx.get(keyed + "/health", headers={"host": host}).status_code == 200


def test_host_names():
    assert [host_name(h) for h in ("a.example:80", "[::1]:8000", "::1", "LOCALHOST")] == \
        ["a.example", "::1", "::1", "localhost"]


# ---------------------------------------------------------------------------------------------------- body
def _response(s: socket.socket) -> bytes:
    """One HTTP response from a raw socket: the head and its content-length of body (or up to the close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next((line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")), b"0"))
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_body_over_the_cap_is_refused_before_it_is_read(keyed):
    port = urlparse(keyed).port
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer sesame\r\n"
                  b"content-type: application/json\r\ncontent-length: 50000000\r\n\r\n{")
        head = _response(s)  # answered while 49,999,999 bytes were never sent
    assert head.startswith(b"HTTP/1.1 413") and b"request_too_large" in head


def test_a_large_body_gets_a_413_the_client_can_read(keyed):
    """A client that sends all of a body over the cap reads the 413 (the server drains the body first: closing
    while the client still sends would reset the connection), with or without Content-Length."""
    body = b"{" + b" " * 20_000_000 + b"}"
    _error(httpx.post(keyed + "/v1/completions", headers={**KEY, **JSON}, content=body, timeout=60), 413,
           "request_too_large")
    _error(httpx.post(keyed + "/v1/completions", headers={**KEY, **JSON}, timeout=60,
                      content=(body[i:i + 1 << 20] for i in range(0, len(body), 1 << 20))), 413, "request_too_large")
    assert httpx.get(keyed + "/v1/models", headers=KEY).status_code == 200


def test_a_chunked_body_over_the_cap_is_refused(keyed):
    def chunks():
        for _ in range(100):
            yield b" " * 100
    r = httpx.post(keyed + "/v1/completions", headers={**KEY, **JSON}, content=chunks())
    _error(r, 413, "request_too_large")


def test_a_stalled_body_times_out(keyed):
    port = urlparse(keyed).port
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer sesame\r\n"
                  b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"")
        head = _response(s)  # the server's 0.5 s deadline between body chunks
    assert head.startswith(b"HTTP/1.1 408") and b"request_timeout" in head


def test_stalled_headers_close_the_connection(keyed):
    port = urlparse(keyed).port
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")  # no blank line: the headers never end
        assert s.recv(4096) == b""  # closed by the server's 0.5 s header deadline
    assert httpx.get(keyed + "/health").status_code == 200


def test_a_disconnect_mid_body_logs_one_line_and_no_traceback(keyed, caplog):
    port = urlparse(keyed).port
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer sesame\r\n"
                      b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\": ")
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while not any("disconnected" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(keyed + "/health").status_code == 200
    lines = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(lines) == 1 and "/v1/completions" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


# ---------------------------------------------------------------------------------------------------- JSON, prompt
@pytest.fixture(scope="module")
def open_server():
    with BackgroundServer(fake_app()) as url:
        yield url


def _nested(depth: int) -> bytes:
    return b'{"model": "fake", "prompt": "hi", "user": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [70, 3000, 100000])
def test_deep_json_is_400_not_a_recursion_error(open_server, depth):
    r = httpx.post(open_server + "/v1/completions", headers=JSON, content=_nested(depth))
    assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"], r.text


def test_shallow_json_passes_the_depth_check(open_server):
    r = httpx.post(open_server + "/v1/completions", headers=JSON, content=_nested(10))
    assert r.status_code == 400 and "nests deeper" not in r.text  # refused by the schema, not the depth


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(open_server):
    context = httpx.get(open_server + "/v1/models").json()["data"][0]["max_model_len"]
    r = httpx.post(open_server + "/v1/completions", headers=JSON,
                   json={"model": MODEL, "prompt": "x" * (8 * context + 1), "max_tokens": 1})
    err = _error(r, 400, "context_length_exceeded")
    assert f"{8 * context:,}" in err["message"]
    assert httpx.get(open_server + "/health").status_code == 200


def test_defaults_refuse_foreign_hosts_and_origins_without_a_key(open_server):
    assert httpx.get(open_server + "/v1/models").status_code == 200  # no key configured
    _error(httpx.get(open_server + "/v1/models", headers={"host": "rebound.example"}), 400, "host_not_allowed")
    _error(httpx.get(open_server + "/v1/models", headers={"origin": "http://evil.example"}), 403,
           "origin_not_allowed")


class HeldTokenizer(FakeTokenizer):
    """Tokenizing the prompt "hold" waits until the test lets it go."""

    def __init__(self):
        self.entered, self.gate = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        if text == "hold":
            self.entered.set()
            self.gate.wait(300)
        return super().encode(text)


def test_tokenizing_runs_off_the_event_loop():
    """While one request's prompt is being tokenized, /health answers: with tokenization on the event loop it
    could not until the tokenizer lets go, which happens only after /health answered (or its 120 s wait)."""
    tok = HeldTokenizer()
    with BackgroundServer(fake_app(tokenizer=tok)) as url, ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, url + "/v1/completions", timeout=None,
                           json={"model": MODEL, "prompt": "hold", "max_tokens": 1})
        assert tok.entered.wait(120)
        try:
            assert httpx.get(url + "/health", timeout=120).status_code == 200
        finally:
            tok.gate.set()
        assert held.result().status_code == 200


# ---------------------------------------------------------------------------------------------------- flags, messages
def _serve_args(*argv):
    import argparse
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["--device", "cpu", *argv])


def test_policy_from_flags(monkeypatch):
    p = policy_from_args(_serve_args())
    assert p.api_key is None and p.allowed_hosts == (*LOOPBACK_HOSTS, "127.0.0.1") and p.allowed_origins == ()
    assert p.max_body_bytes == 16_000_000
    p = policy_from_args(_serve_args("--host", "0.0.0.0", "--api-key", "k", "--allowed-origins", "http://a, http://b",
                                     "--max-body-mb", "2", "--request-timeout", "5"))
    assert p.allowed_hosts is None and p.api_key == "k" and p.allowed_origins == ("http://a", "http://b")
    assert p.max_body_bytes == 2_000_000 and p.read_timeout_s == 5
    assert policy_from_args(_serve_args("--allowed-hosts", "a.example,b.example")).allowed_hosts == \
        ("a.example", "b.example")
    monkeypatch.setenv("MINI_API_KEY", "from-env")
    assert policy_from_args(_serve_args()).api_key == "from-env"


def test_binding_beyond_loopback_without_a_key_warns():
    assert exposure_warning("127.0.0.1", Policy()) is None and exposure_warning("localhost", Policy()) is None
    assert exposure_warning("::1", Policy()) is None
    assert "without an API key" in exposure_warning("0.0.0.0", Policy())
    assert exposure_warning("0.0.0.0", Policy(api_key="k")) is None


def test_startup_line_names_model_dtype_backends_memory_and_address():
    app = fake_app()
    try:
        line = startup_line(app, "http://127.0.0.1:8000")
    finally:
        app.state.server.llm.shutdown()
    assert "\n" not in line
    for needle in (MODEL, "float32 on cpu", "ops reference", "decode eager", "cache 256 blocks x 4 positions",
                   "RSS", "http://127.0.0.1:8000"):
        assert needle in line, line


def test_json_depth_walks_without_recursion_and_finds_lone_surrogates():
    from mini.server.app import json_depth
    assert [json_depth(v) for v in (5, "x", [], {"a": [1, {"b": []}]})] == [0, 0, 1, 4]
    assert json_depth(json.loads("[" * 900 + "]" * 900)) == 900
    for bad in ('{"\\ud800": 1}', '{"a": ["ok", "\\udc00"]}'):
        with pytest.raises(UnicodeEncodeError):
            json_depth(json.loads(bad))


def test_a_lone_surrogate_in_a_key_is_400(open_server):
    r = httpx.post(open_server + "/v1/completions", headers=JSON,
                   content=b'{"model": "fake", "prompt": "hi", "metadata": {"\\ud800": "x"}}')
    assert r.status_code == 400 and "Unicode" in r.json()["error"]["message"], r.text
