"""A generation request as its handler sees it, whichever way it came in.

The generation routes are served two ways: through the ASGI stack (uvicorn's request cycle,
FastAPI), and straight from pdserve's own HTTP protocol (protocol/native_http.py), which builds
no ASGI scope, `receive`, `send` or Starlette `Request` per request. One handler serves both, so
it reads a request only through this: its headers (names lowercase, as both servers give them),
its body, and the hang-up of its client (`scope` holds the `LostConnection` where the server
gives one, protocol/disconnect.py; `receive` is the ASGI one, or None when the body is in hand).
"""

from __future__ import annotations

from starlette.datastructures import Headers

from pdserve.protocol.body import body_timeout, read_body
from pdserve.protocol.disconnect import ClientGone
from pdserve.protocol.errors import APIError

# What the native path gives as the body of a request whose body it could not read whole: it
# was still arriving at `--body-timeout`, or its client left first.
LATE, GONE = b"<late>", b"<gone>"


class Incoming:
    __slots__ = ("raw_headers", "scope", "receive", "_body", "_first")

    def __init__(self, raw_headers: list[tuple[bytes, bytes]], scope: dict, receive=None, body: bytes | None = None,
                 first: dict[bytes, bytes] | None = None):
        self.raw_headers = raw_headers
        self.scope = scope
        self.receive = receive
        self._body = body
        self._first = first  # name -> its first value; made on the first lookup if not given

    @classmethod
    def of_asgi(cls, scope: dict, receive) -> "Incoming":
        return cls(scope["headers"], scope, receive)

    def header(self, name: bytes) -> str | None:
        """The first value of header `name` (lowercase), as Starlette's `headers.get` gives it
        (which raises and catches a KeyError for each header a request lacks)."""
        first = self._first
        if first is None:
            first = self._first = dict(reversed(self.raw_headers))  # (reversed: the first one wins)
        value = first.get(name)
        return None if value is None else value.decode("latin-1")

    @property
    def headers(self) -> Headers:
        """All headers as Starlette's mapping, for the few readers that want one (auth, tracing)."""
        return Headers(raw=self.raw_headers)

    async def body(self, limit: int, timeout_s: float | None) -> bytes:
        """The whole body: 413 past `limit`, 408 if it takes longer than `timeout_s` (body.py)."""
        if self._body is None:
            return await read_body(self, limit, timeout_s)
        return self.received(limit, timeout_s)

    def received(self, limit: int, timeout_s: float | None) -> bytes | None:
        """`body()` without a wait, when the body came with the request (the native path); None
        when it is still to be read."""
        body = self._body
        if body is None:
            return None
        if body is LATE:
            raise body_timeout(timeout_s)
        if body is GONE:
            raise ClientGone()
        if len(body) > limit:  # the native path takes only bodies declared within the limit
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        return body
