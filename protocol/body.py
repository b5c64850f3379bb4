"""Reading a request body: size limit first, then JSON, then (optionally) the pydantic model.

The limit is enforced on the declared Content-Length and again while reading, so a chunked
upload cannot get past it; nothing is parsed before the whole body is known to fit. The whole
body must arrive within `timeout_s` (a client trickling a byte every few seconds holds a
connection and a task; it gets 408), and a client that leaves mid-body is `ClientGone`, not an
error of ours.

A body that is valid JSON can still be unusable: `"\\ud800"` decodes to a lone UTF-16
surrogate, a `str` no tokenizer (and no UTF-8 encoder) accepts, and 100,000 nested brackets
exhaust the parser's recursion. Both are the client's fault and refused here with a 400, so
no such value reaches a tokenizer, a template or a worker.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from pdserve.protocol.disconnect import ClientGone
from pdserve.protocol.errors import APIError, bad_request, from_validation_error

M = TypeVar("M", bound=BaseModel)

# JSON nesting deeper than this is refused before it is parsed (OpenAI bodies nest < 10 deep;
# the parser itself would raise RecursionError near 1,000).
MAX_DEPTH = 64
DEFAULT_BODY_TIMEOUT_S = 60.0


async def read_body(request: Request, limit: int, timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    except TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ClientGone() from None
    return bytes(body)


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _too_deep(raw: bytes) -> bool:
    """Bracket depth outside strings, without parsing (no recursion): strings removed and
    everything but brackets dropped at C speed, then one pass over the brackets."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    depth = 0
    for b in _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        depth += 1 if b in (0x5B, 0x7B) else -1
        if depth > MAX_DEPTH:
            return True
    return False


def _check_strings(value, path: str = "") -> None:
    """Every string (keys too) must encode as UTF-8: refuse lone surrogates, naming the field."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(f"{p or 'body'}: string contains a lone UTF-16 surrogate (not valid Unicode)",
                                  p or None, code="invalid_unicode") from None
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((k, p))
                stack.append((item, f"{p}.{k}" if p else str(k)))
        elif isinstance(v, list):
            stack.extend((item, f"{p}.{i}" if p else str(i)) for i, item in enumerate(v))


def parse_object(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 saying why not."""
    if _too_deep(raw):
        raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels", code="too_deep")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    _check_strings(obj)
    return obj


def validate(model: type[M], obj: dict) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def read_model(request: Request, model: type[M], limit: int,
                     timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S) -> M:
    return validate(model, parse_object(await read_body(request, limit, timeout_s)))
