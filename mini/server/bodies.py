"""A request's body: read (by the Guard, under its cap), decoded, parsed and validated off the event loop, and
the one error type handlers raise (`ApiError`, shaped per API by mini.server.errors). Every bad input is a 400 that
names the field as the client wrote it."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from mini.server.errors import error_body
from mini.server.protocol import FieldError


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def response(self, path: str = "") -> JSONResponse:
        """The error in the shape of the API at `path` (mini.server.errors)."""
        return JSONResponse(error_body(path, self.status, self.message, self.param, self.code),
                            status_code=self.status)


MAX_JSON_DEPTH = 64  # nesting of a request body: OpenAI requests need < 10; deeper is refused, never recursed into


async def parse_body(request: Request, schema):
    """The body (read and size-checked by the Guard) decoded, parsed and validated in a worker thread: a large
    body never holds the event loop."""
    raw = await request.body()
    return await asyncio.to_thread(_parse, raw, schema)


def _parse(raw: bytes, schema):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"the request body is not valid UTF-8 (bad byte at offset {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(f"invalid JSON in the request body: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise ApiError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        depth = json_depth(data)
    except UnicodeEncodeError:
        raise ApiError("the request contains invalid Unicode (a lone surrogate escape)") from None
    if depth > MAX_JSON_DEPTH:
        raise ApiError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, data) from None


def validation_error(e: ValidationError, data) -> ApiError:
    """The first problem of a validation error as an ApiError naming the field as the client wrote it (pydantic's
    location also names the union members it tried, e.g. `reasoning_effort.literal['low', ...]`), with what each
    member would have accepted."""
    errors = e.errors()
    first = errors[0]
    loc = field_path(first["loc"], data, first["type"] == "missing")
    if first["type"] == "extra_forbidden":  # never accepted and ignored
        return ApiError(f"'{loc}' is not supported by this server", param=loc, code="unsupported_parameter")
    blamed = (first.get("ctx") or {}).get("error")
    if isinstance(blamed, FieldError) and not loc:  # a check across fields names the one to blame
        loc = blamed.param
    # a union's members each report their own error at the same field: say what any of them accepts
    msgs = [err["msg"].removeprefix("Value error, ") for err in errors if err is first or (
        err["type"] != "extra_forbidden" and field_path(err["loc"], data, err["type"] == "missing") == loc)]
    msg = " or ".join(dict.fromkeys(m[0].lower() + m[1:] if m.startswith("Input should") else m for m in msgs))
    return ApiError(f"invalid value for '{loc}': {msg}" if loc else msg, param=loc or None)


def field_path(loc: tuple, data, missing: bool = False) -> str:
    """A validation error's location as the client's field path: the keys and indexes that exist in the request
    (pydantic adds the union member it tried, `literal[...]`, `int`, `function-after[...]`, which do not), and
    for a `missing` error the key left out."""
    parts, value = [], data
    for k, part in enumerate(loc):
        if missing and k == len(loc) - 1 and isinstance(part, str) and isinstance(value, dict):
            parts.append(("." if parts else "") + part)
            break
        if isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value):
            parts.append(f"[{part}]")
            value = value[part]
        elif isinstance(part, str) and isinstance(value, dict) and part in value:
            parts.append(("." if parts else "") + part)
            value = value[part]
    return "".join(parts)


def json_depth(value) -> int:
    """Nesting depth of parsed JSON (a scalar: 0), without recursion; UnicodeEncodeError if a string (key or value)
    holds a lone surrogate. A walk in Python, not one long C call (as re-serializing would be), so the event loop
    gets its turns while a large body is checked."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, str):
            v.encode("utf-8")
        elif isinstance(v, dict):
            deepest = max(deepest, depth)
            for k, child in v.items():
                k.encode("utf-8")
                todo.append((child, depth + 1))
        elif isinstance(v, list):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in v)
    return deepest
