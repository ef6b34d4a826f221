"""What a request must pass before any handler sees it: the Host header, the browser origin, the API key, the
content type and the body's size and pace. One ASGI middleware (`Guard`), outermost, so a refused request costs
no more than its headers.

Why each check: a web page the user visits can send requests to a server on localhost. A cross-origin `fetch` with
`Content-Type: text/plain` skips the browser's CORS preflight, so JSON endpoints refuse every other content type,
and requests that carry a foreign `Origin` (or `Sec-Fetch-Site: cross-site`) are refused unless the origin is
listed. DNS rebinding points a foreign name at 127.0.0.1, which the Host check refuses. The body is read here, up
to a cap and with a deadline between chunks, so a 50 MB upload is refused early (413) instead of being buffered,
and a client that stalls or disconnects mid-body costs one log line, not a worker.

`H11WithHeaderTimeout` adds what uvicorn lacks: a deadline for a request's headers (a connection that opens and
sends nothing, or headers at a trickle, is closed).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass

from mini.server.errors import error_body

log = logging.getLogger("mini.server")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_MAX_BODY_BYTES = 16 * 1000 * 1000
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers, readiness probes)
METRICS_PATH = "/metrics"  # open too unless Policy.metrics_need_key: scrapers (Prometheus, aiperf) send no key
# a body over the cap is still read (and dropped) up to this many bytes before the 413: a client that is still
# sending when the server closes gets a TCP reset and never reads the answer
DRAIN_MIN_BYTES = 64 * 1000 * 1000


@dataclass(frozen=True)
class Policy:
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # "*": any
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS  # None or "*": any
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout_s: float = 30.0  # headers (H11WithHeaderTimeout), and the body between two chunks
    metrics_need_key: bool = False  # /metrics takes the API key too (default: open, as vLLM's)

    def needs_key(self, path: str) -> bool:
        return self.api_key is not None and path not in OPEN_PATHS and \
            (path != METRICS_PATH or self.metrics_need_key)

    def host_allowed(self, host: str) -> bool:
        return self.allowed_hosts is None or "*" in self.allowed_hosts or host in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins


def host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Refusal(Exception):
    def __init__(self, status: int, message: str, code: str, headers: tuple = ()):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers


class Guard:
    """ASGI middleware applying a Policy to every HTTP request (see the module doc)."""

    def __init__(self, app, policy: Policy, routes: list | None = None):
        """`routes`: the app's routes (Starlette's, read at each request), so a method a path does not take is
        a 405 before its body is checked or read."""
        self.app, self.policy, self.routes = app, policy, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check_headers(scope, headers)
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(scope, headers, receive)
                if body is None:  # the client went away
                    return
                receive = _replay(body, receive)
        except Refusal as r:
            return await _refuse(send, r, scope["path"])
        await self.app(scope, receive, send)

    def _check_headers(self, scope, headers: dict[str, str]) -> None:
        p = self.policy
        host = headers.get("host", "")
        if not p.host_allowed(host_name(host)):
            raise Refusal(400, f"the Host header {host!r} is not allowed here (see --allowed-hosts)",
                          "host_not_allowed")
        origin = headers.get("origin")
        cross_site = headers.get("sec-fetch-site") in ("cross-site", "same-site")
        if (origin and origin != "null" and not p.origin_allowed(origin) and not _same_origin(origin, host)) or \
                ((cross_site or origin == "null") and not (origin and p.origin_allowed(origin))):
            raise Refusal(403, f"cross-origin requests from {origin or 'another site'!r} are not allowed "
                               "(see --allowed-origins)", "origin_not_allowed")
        if scope["method"] == "OPTIONS":  # a CORS preflight of an allowed origin (browsers send no key with it)
            return
        if p.needs_key(scope["path"]):
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
                key = headers.get("x-api-key", "")
            if not hmac.compare_digest(key.strip().encode(), p.api_key.encode()):
                raise Refusal(401, "missing or invalid API key: send `Authorization: Bearer <key>` (or "
                                   "`x-api-key: <key>`)", "invalid_api_key", ((b"www-authenticate", b"Bearer"),))
        allowed = self._other_methods(scope)
        if allowed:
            raise Refusal(405, f"{scope['method']} is not allowed on {scope['path']}", "method_not_allowed",
                          ((b"allow", ", ".join(allowed).encode()),))
        if scope["method"] in ("POST", "PUT", "PATCH"):
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                raise Refusal(415, f"the request body must be JSON sent as `Content-Type: application/json`, got "
                                   f"{media or 'no content type'!r}", "unsupported_media_type")

    def _other_methods(self, scope) -> tuple[str, ...]:
        """The methods the path takes when the request's is not among them (else empty)."""
        from starlette.routing import Match
        allowed: set[str] = set()
        for route in self.routes or ():
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return ()
            if match == Match.PARTIAL:
                allowed |= set(getattr(route, "methods", None) or ())
        return tuple(sorted(allowed))

    async def _read_body(self, scope, headers: dict[str, str], receive) -> bytes | None:
        cap = self.policy.max_body_bytes
        too_big = Refusal(413, f"the request body is larger than this server's limit of {cap:,} bytes",
                          "request_too_large", ((b"connection", b"close"),))
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            if headers.get("expect", "").lower() != "100-continue":  # else the client waits: nothing to drain
                await self._drain(receive, max(DRAIN_MIN_BYTES, 4 * cap))
            raise too_big  # refused before a byte of it is kept
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.policy.read_timeout_s)
            except asyncio.TimeoutError:
                raise Refusal(408, f"the request body did not arrive within {self.policy.read_timeout_s:g} s",
                              "request_timeout") from None
            if message["type"] == "http.disconnect":
                client = scope.get("client") or ("?", 0)
                log.warning("client %s:%s disconnected while sending %s %s", client[0], client[1], scope["method"],
                            scope["path"])
                return None
            size += len(message.get("body", b""))
            if size > cap:
                if message.get("more_body", False):
                    await self._drain(receive, max(DRAIN_MIN_BYTES, 4 * cap) - size)
                raise too_big
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


    async def _drain(self, receive, limit: int) -> None:
        """Read and drop the rest of a body, up to `limit` bytes and with the usual deadline between chunks, so
        that the 413 that follows reaches a client still sending (a close while it sends is a TCP reset)."""
        drained = 0
        while drained <= limit:
            try:
                message = await asyncio.wait_for(receive(), self.policy.read_timeout_s)
            except asyncio.TimeoutError:
                return
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
            drained += len(message.get("body", b""))


def _same_origin(origin: str, host: str) -> bool:
    """A browser's same-origin request: the Origin's authority is the Host it was sent to."""
    return bool(host) and origin.partition("://")[2].lower() == host.strip().lower()


def _replay(body: bytes, receive):
    """A `receive` that hands the app the body read already, then passes through (disconnect notices)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _refuse(send, r: Refusal, path: str) -> None:
    body = json.dumps(error_body(path, r.status, r.message, code=r.code)).encode()
    await send({"type": "http.response.start", "status": r.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *r.headers]})
    await send({"type": "http.response.body", "body": body})


def h11_with_header_timeout(seconds: float) -> type | str:
    """uvicorn's h11 protocol, closing a connection whose first request's headers take longer than `seconds` from
    its start (or a later request's, from the end of the previous response, at least uvicorn's keep-alive).
    Without the h11 package: uvicorn's own choice ("auto"), without the deadline, said in the log."""
    try:
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError as e:
        log.warning("no header deadline: uvicorn's h11 protocol does not import (%s)", e)
        return "auto"

    class H11WithHeaderTimeout(H11Protocol):
        _deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self):
            # never shorter than uvicorn's idle keep-alive (which closes an idle connection first), so that a
            # client reusing a pooled connection meets no earlier close than uvicorn's own; armed before the
            # call, in which a pipelined request may start and disarm it again
            self._arm(max(seconds, self.timeout_keep_alive))
            super().on_response_complete()

        def handle_events(self):
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self._disarm()

        def _arm(self, after: float = seconds):
            self._disarm()
            if not self.transport.is_closing():
                self._deadline = self.loop.call_later(after, self._expire)

        def _disarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self):
            self._deadline = None
            if not self.transport.is_closing():
                log.warning("closed a connection from %s:%s that sent no complete request headers in %g s",
                            *(self.client or ("?", 0)), seconds)
                self.transport.close()
    return H11WithHeaderTimeout
