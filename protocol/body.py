"""Reading a request body: size limit first, then its shape, then JSON, then (optionally) the pydantic model.

The limit is enforced on the declared Content-Length and again while reading, so a chunked
upload cannot get past it; nothing is parsed before the whole body is known to fit. The whole
body must arrive within `timeout_s` (a client trickling a byte every few seconds holds a
connection and a task; it gets 408), and a client that leaves mid-body is `ClientGone`, not an
error of ours.

Work per byte is bounded before any Python object is made (issue 44): an 8 MB body can hold 4 M
array elements (`[0,0,…]`) or 2.6 M empty lists, and `json.loads` makes a Python object of each
(~24× the body's size), which every later walk visits again. So the body's structure is first
measured in its raw bytes, at C speed (`bytes.count`, `replace`, numpy to drop its strings):
more than `max_values` JSON values, or nesting deeper than MAX_DEPTH, is a 400 before parsing.
Parsing and validating a body that passes still costs CPU in proportion to it: callers run
`parse_object`, `validate` and `read_model` off the event loop (a thread), so /health answers
meanwhile.

A body that is valid JSON can still be unusable: `"\\ud800"` decodes to a lone UTF-16
surrogate, a `str` no tokenizer (and no UTF-8 encoder) accepts, and 100,000 nested brackets
exhaust the parser's recursion. Both are the client's fault and refused here with a 400, so
no such value reaches a tokenizer, a template or a worker.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Callable, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from pdserve.protocol.disconnect import ClientGone
from pdserve.protocol.errors import APIError, bad_request, from_validation_error
from pdserve.protocol.http_limits import BODY_RECEIVED

M = TypeVar("M", bound=BaseModel)

# JSON nesting deeper than this is refused before it is parsed (OpenAI bodies nest < 10 deep;
# the parser itself would raise RecursionError near 1,000).
MAX_DEPTH = 64
DEFAULT_BODY_TIMEOUT_S = 60.0
_DECODER = json.JSONDecoder()  # json.loads' own, for a body it would decode as UTF-8


async def read_body(request: Request, limit: int, timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    declared = _content_length(request.scope["headers"])
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    # The ASGI messages read here, not through Starlette's `request.stream()`: an async generator
    # per request costs the event loop's first-iteration hook and a finalizer on top of the reads.
    if timeout_s is None or request.scope.get(BODY_RECEIVED):
        # All there already (http_limits.py), or no deadline: no timeout object (and its task
        # lookup, a system call on Python 3.11) per request.
        return await _receive(request.receive, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive(request.receive, limit)
    except TimeoutError:
        raise body_timeout(timeout_s) from None


def body_timeout(timeout_s: float) -> APIError:
    """A body not all received within `timeout_s`: the connection is not worth keeping."""
    return APIError(408, f"request body not received within {timeout_s:g} s", code="request_timeout",
                    headers={"Connection": "close"})


def _content_length(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The first Content-Length value, as Starlette's `request.headers.get` gives it, without
    building its `Headers` (the server gives names lowercase)."""
    for name, value in headers:
        if name == b"content-length":
            return value.decode("latin-1")
    return None


async def _receive(receive, limit: int) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            raise ClientGone()
        body += message.get("body", b"")
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        if not message.get("more_body", False):
            return bytes(body)


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SQUARE = bytes.maketrans(b"{}", b"[]")
# Where a lone surrogate could come from: a \uD800-\uDFFF escape, or its UTF-8 bytes (ED A0..BF),
# which json.loads decodes from bytes with 'surrogatepass'.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _structure(raw: bytes) -> bytes:
    """The body with its strings (keys and values) removed: brackets, commas, colons, numbers and
    literals are left. Escaped backslashes, then escaped quotes, go first, so every quote left
    opens or closes a string; a running XOR over the quotes then marks what lies inside one.
    Vectorised: a few bytes of scratch per body byte, whatever the number or the content of its
    strings (a regex spent 1.2 s and +259 MiB on 2.6 M empty strings, and kept a frame per escape
    of one long string)."""
    text = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    quote = text == ord('"')
    keep = np.bitwise_xor.accumulate(quote)  # from an opening quote to just before its closing one
    keep |= quote
    np.logical_not(keep, out=keep)  # (in place: two masks of scratch in all)
    return text[keep].tobytes()


def _values(structure: bytes) -> int:
    """JSON values (array elements, object members, containers) of a body: a comma outside
    strings separates two, a bracket opens one. At most twice the true count (`[[],[]]`), never less."""
    return structure.count(b",") + structure.count(b"[") + structure.count(b"{") + 1


def _too_deep(structure: bytes) -> bool:
    """Bracket depth of a body with its strings removed, without recursion or a Python loop per
    bracket: each pass of `replace` removes every innermost pair, so a body nesting at most
    MAX_DEPTH levels is gone after MAX_DEPTH passes. (`{}` count as `[]`: mismatched pairs are
    json.loads' to refuse.) What no pass shortens is unbalanced, hence malformed: refused here
    only if it alone holds more than MAX_DEPTH unmatched brackets."""
    brackets = structure.translate(_SQUARE, _NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            return len(shorter) > MAX_DEPTH
        brackets = shorter
    return bool(brackets)


def check_shape(raw: bytes, max_values: int | None = None) -> None:
    """Before parsing: at most `max_values` JSON values (None: any number), at most MAX_DEPTH levels.
    Counted in the raw bytes first (commas and brackets inside strings included: an upper
    bound); only a body over a bound by that count has its strings dropped for the exact one."""
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets <= MAX_DEPTH and (max_values is None or raw.count(b",") + brackets + 1 <= max_values):
        return
    structure = _structure(raw)
    if _too_deep(structure):
        raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels", code="too_deep")
    if max_values is not None and (values := _values(structure)) > max_values:
        raise bad_request(f"request body holds about {values} JSON values (array elements and object members); "
                          f"at most {max_values} are read", code="too_many_values")


def _first_surrogate(value, path: str = "") -> str | None:
    """The path of the first string (keys too) that does not encode as UTF-8, if any."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((k, p))
                stack.append((item, f"{p}.{k}" if p else str(k)))
        elif isinstance(v, list):
            stack.extend((item, f"{p}.{i}" if p else str(i)) for i, item in enumerate(v))
    return None


def _check_strings(obj: dict, raw: bytes) -> None:
    """Every string (keys too) must encode as UTF-8: refuse lone surrogates, naming the field.
    A body with no surrogate escape or bytes has none (the usual case: no walk at all); one that
    has some (an escaped emoji is a valid pair) is checked in C by encoding it whole, and walked,
    to name the field, only when that fails."""
    if not _MAYBE_SURROGATE.search(raw):
        return
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        p = _first_surrogate(obj)
    raise bad_request(f"{p or 'body'}: string contains a lone UTF-16 surrogate (not valid Unicode)",
                      p or None, code="invalid_unicode")


def parse_object(raw: bytes, max_values: int | None = None) -> dict:
    """The body as a JSON object, or a 400 saying why not. CPU in proportion to the body: call it
    off the event loop (`asyncio.to_thread`) for anything a client sent."""
    check_shape(raw, max_values)
    try:
        if raw[:1] == b"{" and raw[1:2] != b"\x00":
            # UTF-8, as `json.loads` would detect it from these bytes: decoded as it would
            # decode them, without its encoding detection and keyword handling per body.
            obj = _DECODER.decode(raw.decode("utf-8", "surrogatepass"))
        else:
            obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    _check_strings(obj, raw)
    return obj


def validate(model: type[M], obj: dict) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _read(raw: bytes, model: type[M], max_values: int | None, check: Callable[[M], None] | None) -> M:
    req = validate(model, parse_object(raw, max_values))
    if check is not None:
        check(req)
    return req


async def read_model(request: Request, model: type[M], limit: int,
                     timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S, max_values: int | None = None,
                     check: Callable[[M], None] | None = None) -> M:
    """The body as `model`, parsed, validated and `check`ed on a thread."""
    raw = await read_body(request, limit, timeout_s)
    return await asyncio.to_thread(_read, raw, model, max_values, check)
