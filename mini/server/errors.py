"""Error bodies in the shape each API's clients read: OpenAI's `{"error": {message, type, param, code}}` for
everything but Anthropic's Messages API (`/v1/messages...`), whose SDK reads `{"type": "error", "error": {type,
message}}` with Anthropic's error types. The request guard and the handlers both answer through here."""
from __future__ import annotations

ANTHROPIC_PREFIX = "/v1/messages"

# Anthropic's error type of an HTTP status (docs.anthropic.com, "Errors"); others are api_error
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                   413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                   499: "invalid_request_error", 529: "overloaded_error"}


def error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if path.startswith(ANTHROPIC_PREFIX):
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
