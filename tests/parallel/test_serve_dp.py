"""DP serving end to end: `mini serve --ep 2` (two gloo ranks on the CPU, tiny-v4.1-vl fp32: tiny-v4.1 with a
vision tower) against the plain one-process server, text and images, an idle rank, aborted streams; and the
router's placement and output bookkeeping."""
import base64
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from mini.parallel.serve import RequestError, Router, slim
from mini.engine.llm import RequestOutput
from mini.engine.sequence import TokenLogprobs
from mini.parallel.launch import free_port
from mini.server.app import build_app
from mini.testing.background_server import BackgroundServer

MODEL = "tiny"
PRESET = "tiny-v4.1-vl"
ENGINE = dict(num_blocks=24, block_tokens=32)  # 768 positions per rank
# odd prompt lengths and output lengths: requests start and finish at different steps on both ranks
PROMPTS = [[3 + (11 * i + 5 * j) % 500 for j in range(n)] for i, n in enumerate([7, 23, 4, 13, 9])]
MAX_TOKENS = [6, 2, 5, 3, 4]


@contextlib.contextmanager
def _serve_ep2(preset: str, *flags: str):
    """`mini serve --ep 2` in its own session; stopped like Ctrl-C stops it (SIGINT to the terminal's process
    group, which holds the launcher only: it forwards one SIGINT to rank 0)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mini", "serve", "--ep", "2", "--model", preset, "--served-model-name", MODEL,
           "--device", "cpu", "--dtype", "float32", "--num-blocks", str(ENGINE["num_blocks"]),
           "--block-tokens", str(ENGINE["block_tokens"]), "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"the DP server exited:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "the DP server did not start"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield url
    os.killpg(proc.pid, signal.SIGINT)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:  # the ranks run in their own process groups
        for pid in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split():
            os.kill(int(pid), signal.SIGKILL)
        proc.kill()
        raise
    log = proc.stdout.read()
    assert rc == 0, log
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def dp_server():
    with _serve_ep2(PRESET) as url:
        yield url


def _complete(url: str, prompt, max_tokens: int) -> tuple[str, list[str], int]:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 1})
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    return choice["text"], choice["logprobs"]["tokens"], usage["completion_tokens"]


def _all(url: str) -> list:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: both ranks hold several requests at once
        return list(pool.map(lambda a: _complete(url, *a), zip(PROMPTS, MAX_TOKENS)))


def _dp_status(url: str) -> dict:
    return httpx.get(url + "/dp", timeout=10).json()


@pytest.fixture(scope="module")
def one_server():
    """The plain one-process server: what the DP server must answer."""
    # twice the DP ranks' cache: the skewed test's nine requests at once fit without preemption
    engine = {**ENGINE, "num_blocks": 2 * ENGINE["num_blocks"]}
    app = build_app(PRESET, MODEL, device="cpu", dtype=torch.float32, **engine)
    with BackgroundServer(app) as url:
        yield url


def test_two_ranks_answer_like_one(dp_server, one_server):
    placed = _dp_status(dp_server)["placed"]
    got = _all(dp_server)
    status = _dp_status(dp_server)
    assert status["unfinished"] == [0, 0]
    # five concurrent requests: both ranks work (how many each depends on the order they arrive in, by tokens)
    assert all(b - a >= 1 for a, b in zip(placed, status["placed"])) and sum(status["placed"]) - sum(placed) == 5
    want = _all(one_server)
    assert [n for _, _, n in want] == MAX_TOKENS
    assert got == want


def _image_url(w: int, h: int, seed: int) -> dict:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


# chats with images (spans of tiny-v4.1-vl's up to 64 tokens), one of them with two
IMAGE_CHATS = [[{"type": "text", "text": "what is this?"}, _image_url(120, 90, 1)],
               [_image_url(60, 200, 2), {"type": "text", "text": "and these two"}, _image_url(200, 140, 3)]]


def _chat(url: str, content: list) -> tuple[str, int, int]:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]


def test_images_are_served_like_one(dp_server, one_server):
    """Chats with images beside concurrent text requests: the images travel to their rank with the request (the
    step messages), and every answer is the one-process server's."""
    def everything(url):
        with ThreadPoolExecutor(len(IMAGE_CHATS) + 2) as pool:
            chats = [pool.submit(_chat, url, c) for c in IMAGE_CHATS]
            texts = [pool.submit(_complete, url, p, n) for p, n in zip(PROMPTS[:2], MAX_TOKENS[:2])]
            return [f.result() for f in chats], [f.result() for f in texts]
    placed = _dp_status(dp_server)["placed"]
    got = everything(dp_server)
    assert sum(_dp_status(dp_server)["placed"]) - sum(placed) == len(IMAGE_CHATS) + 2
    want = everything(one_server)
    assert got == want


def _placed_total(url: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while sum(_dp_status(url)["placed"]) < n:
        assert time.monotonic() < deadline, _dp_status(url)
        time.sleep(0.02)


# Two decoding requests (the first with less context), then a 500-token prompt, then a burst of short prompts.
# The decisions hold by margins that the test's own delays (an HTTP round trip between placements, a loaded CI
# machine) cannot eat: the warm requests decode 150 tokens, so both still run when the long prompt is placed, and
# the long prompt's choice of rank 0 holds while warm 2 comes within ~116 steps of warm 1 (120 - 4 prompt tokens).
# (The long prompt's 24 tokens: longer answers may differ from the one server's, whose chunks differ.)
SKEW_WARM = [(PROMPTS[2], 150), ([3 + (13 * j) % 500 for j in range(120)], 150)]  # 4 and 120 prompt tokens
SKEW_LONG = ([3 + (7 * j) % 500 for j in range(500)], 24)  # decoding while the burst is placed
SKEW_BURST = [(PROMPTS[i % 5][: 5 + i], 3) for i in range(6)]


def test_skewed_arrival_balances_tokens_and_answers_like_one(dp_server, one_server):
    """Placement by tokens in flight: the long prompt goes to the rank with less context (rank 0: 4 + decoded,
    against warm 2's 120 + decoded), and the burst of short prompts after it all goes to the other rank, whose
    tokens in flight stay below the long prompt's (placement by request count alternates: 3 of them would land
    behind the long prompt). The long prompt arrives while the other rank only decodes: its prefill is capped at
    256 tokens per step. Greedy answers equal the one-process server's."""
    status = _dp_status(dp_server)
    assert status["unfinished"] == [0, 0]
    placed, capped, n = status["placed"], status["capped_steps"], sum(status["placed"])
    with ThreadPoolExecutor(len(SKEW_BURST) + 3) as pool:
        futures = []
        for i, request in enumerate(SKEW_WARM + [SKEW_LONG]):  # one at a time, in this order
            futures.append(pool.submit(_complete, dp_server, *request))
            _placed_total(dp_server, n + i + 1)
        after_long = _dp_status(dp_server)
        futures += [pool.submit(_complete, dp_server, *request) for request in SKEW_BURST]
        got = [f.result() for f in futures]
    status = _dp_status(dp_server)
    # the premise: nothing finished before the burst came (else the machine is too slow for the margins above)
    assert after_long["unfinished"] == [2, 1], after_long
    assert [b - a for a, b in zip(placed, status["placed"])] == [2, 1 + len(SKEW_BURST)], status
    assert after_long["tokens_in_flight"][0] >= len(SKEW_LONG[0]), after_long
    assert status["capped_steps"] > capped, status  # 500 prompt tokens at most 256 a step: two steps capped
    assert status["unfinished"] == [0, 0]
    with ThreadPoolExecutor(len(SKEW_BURST) + 3) as pool:
        want = list(pool.map(lambda r: _complete(one_server, *r), SKEW_WARM + [SKEW_LONG] + SKEW_BURST))
    assert [n for _, _, n in want] == [m for _, m in SKEW_WARM + [SKEW_LONG] + SKEW_BURST]
    assert got == want


def test_idle_rank_keeps_step(dp_server):
    """One request at a time: the rank without it joins every step with an empty batch; after the server sat
    idle (longer than rank 0's poll), requests still run."""
    first = _complete(dp_server, PROMPTS[0], 4)
    time.sleep(2.5)
    assert _complete(dp_server, PROMPTS[0], 4) == first
    assert _dp_status(dp_server)["unfinished"] == [0, 0]


def _aborts(url: str) -> int:
    m = re.search(r'mini_requests_finished_total\{reason="abort"\} (\d+)', httpx.get(url + "/metrics").text)
    return int(m.group(1)) if m else 0


def test_aborted_streams_free_their_requests(dp_server):
    before = _aborts(dp_server)
    assert _dp_status(dp_server)["unfinished"] == [0, 0]
    streams = []
    for prompt in PROMPTS[:2]:  # one on each rank; 700 tokens would take far longer than this test
        client = httpx.Client(timeout=60)
        cm = client.stream("POST", dp_server + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 700, "temperature": 0, "ignore_eos": True,
            "stream": True})
        lines = cm.__enter__().iter_lines()  # kept open: a closed line iterator closes the response
        assert next(lines).startswith("data: ")  # the request is running
        streams.append((client, cm, lines))
    assert _dp_status(dp_server)["unfinished"] == [1, 1]
    for client, cm, _ in streams:  # the client goes away
        cm.__exit__(None, None, None)
        client.close()
    deadline = time.monotonic() + 30
    while _dp_status(dp_server)["unfinished"] != [0, 0]:
        assert time.monotonic() < deadline, _dp_status(dp_server)
        time.sleep(0.1)
    assert _aborts(dp_server) == before + 2
    assert _complete(dp_server, PROMPTS[2], 3)[2] == 3  # the ranks still serve


def _out(rid, new, lps, finished=False, reason=None):
    return RequestOutput(rid, [9, 9], [], "", new, "", finished, reason, logprobs=lps)


def test_router_places_by_load_and_restores_outputs():
    router = Router(3)
    assert [router.place(f"r{i}", [1, 2, i]) for i in range(4)] == [0, 1, 2, 0]
    assert router.load == [2, 1, 1] and router.owner("r1") == 1 and router.owner("nope") is None
    lp = [TokenLogprobs(t, -0.5 * t, {t: -0.5 * t}) for t in (4, 5, 6)]
    a = router.receive(slim(_out("r1", [4], lp[:1])))  # the engine's outputs carry all logprobs so far
    b = router.receive(slim(_out("r1", [5, 6], lp, finished=True, reason="length")))
    assert a.prompt_token_ids == [1, 2, 1] and a.token_ids == [4] and a.logprobs == lp[:1]
    assert b.token_ids == [4, 5, 6] and b.logprobs == lp and b.finished
    assert router.load == [2, 0, 1] and router.owner("r1") is None
    assert router.place("r4", [7]) == 1  # the least-loaded rank now
    err = router.receive(RequestError("r2", "bad"))
    assert isinstance(err, RequestError) and router.load == [2, 1, 0]


def test_speculation_is_served_over_ranks():
    """`mini serve --ep 2 --speculative dspark` (tiny-v4.1-dspark, every draft verified: --no-spec-adaptive): each
    rank drafts for its own requests and verifies them; the greedy answers are the plain DP server's, under
    --deterministic both. The first request, alone on a fresh server, goes to rank 0 (ties go to the lowest rank),
    whose engine's counters /metrics shows: it drafted."""
    flags = ("--deterministic",)

    def answers(*more):
        with _serve_ep2("tiny-v4.1-dspark", *flags, *more) as url:
            first = _complete(url, PROMPTS[1], 8)
            metrics = httpx.get(url + "/metrics", timeout=10).text
            return first, _all(url), metrics
    first, plain, _ = answers()
    *spec, metrics = answers("--speculative", "dspark", "--no-spec-adaptive")
    assert spec == [first, plain]
    drafted = re.search(r"^mini_spec_draft_tokens_total (\S+)$", metrics, re.M)
    assert drafted and float(drafted.group(1)) > 0, metrics[-2000:]
