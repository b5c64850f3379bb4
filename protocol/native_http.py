"""The generation routes served by pdserve's own HTTP handling, with no ASGI per request.

Through uvicorn, each request gets an ASGI scope, a request cycle with its `receive`/`send`
and an event, a `Request` and the messages of its answer: on the router's hot path that was
about a fifth of the Python it ran per request. `NativeProtocol` (a subclass of uvicorn's
httptools protocol, uvicorn's `http=` option, so parsing, malformed requests, keep-alive,
`--max-client-connections` and the header deadline stay uvicorn's and http_limits.py's) takes
a plain POST to one of `NativeRoutes.handlers` out of that: its raw body and headers go to the
handler as an `Incoming` (the handler the ASGI path calls too: one behaviour), and its answer,
a Starlette `Response` used as a value (status, headers, body) or an `SSEResponse`, is written
here the way uvicorn's cycle writes it (`Exchange`): the same bytes, the whole answer in one
write.

What is not plain goes through uvicorn and the app as before: a request with `Origin` (CORS),
`Expect: 100-continue`, a chunked or undeclared body, a body declared over the limit, a
percent-encoded path, an upgrade, one over the concurrency limit, or one that arrives while
the connection's previous request is still being answered (pipelining: uvicorn queues it).

While an `Exchange` is being served it stands in `protocol.cycle`'s place, so uvicorn's
connection code (hang-up, graceful shutdown, pipelined requests queued behind it) treats it
as the cycle it replaces.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import httptools
from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, HttpToolsProtocol

from pdserve.protocol.disconnect import LOST_CONNECTION, LostConnection
from pdserve.protocol.held_head import HeldHead
from pdserve.protocol.http_limits import HeaderDeadlineProtocol
from pdserve.protocol.incoming import GONE, LATE, Incoming
from pdserve.protocol.response_headers import set_header

log = logging.getLogger("pdserve.protocol")

Handler = Callable[[Incoming], Awaitable[Response]]

# A body declared larger takes the ASGI path: uvicorn reads it in step with its handler (it stops
# reading the socket past 64 KiB unread), where this path would take it all in at once; with a few
# multi-megabyte bodies at a time that was twice the loop's longest stall (/health's worst answer
# 0.14-0.23 s against 0.05-0.12 s, tests/router/test_input_bounds.py). Generation requests are
# mostly far smaller.
NATIVE_BODY_BYTES = 1 << 20

# uvicorn's answer when an app fails before its answer starts (its cycle's send_500_response).
_500_HEADERS = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21"),
                (b"connection", b"close")]


@dataclass(frozen=True)
class NativeRoutes:
    handlers: Mapping[str, Handler]  # POST path -> its handler, which answers every error itself
    max_body_bytes: int  # a body declared larger takes the ASGI path (its 413 is the app's)
    body_timeout_s: float  # a body not all in by then is answered as the app answers it (408)
    headers: tuple[tuple[bytes, bytes], ...] = ()  # set on every answer (set_header: replacing any of the name)

    @functools.cached_property
    def by_path(self) -> dict[bytes, Handler]:
        """`handlers` by the path's bytes, as a request line carries it."""
        return {path.encode("latin-1"): handler for path, handler in self.handlers.items()}

    @functools.cached_property
    def body_limit(self) -> int:
        """The largest body this path takes (larger ones take the ASGI path)."""
        return min(self.max_body_bytes, NATIVE_BODY_BYTES)


class _NoEvent:
    """What uvicorn sets on a lost connection (`cycle.message_event`): nothing waits on it here."""

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()


# Header names uvicorn's per-header loop writes as they are: none of the bytes its HEADER_RE
# refuses (so no ':', ' ', CR or LF) and no capital (it would lower it). Then the block of head
# lines splits one way only (a name ends at its line's first ": "), and a match of the block below
# with one line a header is a match of every value against HEADER_VALUE_RE (which refuses CR and
# LF: a value holding CRLF would add a line). The classes are uvicorn's single-byte ones.
def _byte_class(passes, negate: bool = False) -> bytes:
    return b"[" + b"".join(re.escape(bytes([c])) for c in range(256) if passes(bytes([c])) != negate) + b"]"


_NAME_REFUSED = re.compile(_byte_class(lambda c: not HEADER_RE.search(c) and not c.isupper(), negate=True))
_VALUE_LINES = re.compile(b"(?:[^:]*: %s*\r\n)*" % _byte_class(lambda c: not HEADER_VALUE_RE.search(c)))


def _plain(headers: list) -> bytes | None:
    """`headers` as head lines, when uvicorn would write them as they are: no name with a capital
    (Starlette's and uvicorn's have none), none `connection`, and uvicorn's two checks passed (one
    search over all names, one match over all the lines). Else None: uvicorn's per-header loop
    decides."""
    if _NAME_REFUSED.search(b"".join([name for name, _ in headers])):
        return None
    block = b"".join([b"%s: %s\r\n" % (name, value) for name, value in headers])
    if _VALUE_LINES.fullmatch(block) is None or block.count(b"\r\n") != len(headers) \
            or b"\nconnection:" in b"\n" + block:
        return None
    return block


class Exchange:
    """One natively served request: its body as it arrives, then its answer."""

    __slots__ = ("protocol", "handler", "headers", "first", "body", "scope", "keep_alive", "disconnected",
                 "response_complete", "more_body", "message_event", "timer", "_chunked", "_out")

    def __init__(self, protocol: "NativeProtocol", handler: Handler, headers: list, first: dict, keep_alive: bool):
        self.protocol = protocol
        self.handler = handler
        self.headers = headers
        self.first = first
        self.body = bytearray()
        self.scope = {LOST_CONNECTION: LostConnection()}  # http_limits.py tells it of a hang-up
        self.keep_alive = keep_alive
        self.disconnected = False  # set by uvicorn's connection_lost
        self.response_complete = False
        self.more_body = True  # the request's body is still arriving
        self.message_event = _NO_EVENT
        self.timer: asyncio.TimerHandle | None = None  # the body's deadline, armed only if it is late
        self._chunked = False
        self._out = None  # where a stream's writes go (a HeldHead over the transport)

    async def run(self, body: bytes) -> None:
        """Answer with `body` (incoming.py's LATE or GONE if it was not read whole), as uvicorn's
        cycle runs an app."""
        try:
            response = await self.handler(Incoming(self.headers, self.scope, None, body, self.first))
            for name, value in self.protocol.native.headers:
                set_header(response, name, value)
            if isinstance(response, StreamingResponse):
                await response(self.scope, self._receive, self._send)
            else:
                self._whole(response.status_code, response.raw_headers, response.body)
        except BaseException as exc:
            log.error("Exception in ASGI application\n", exc_info=exc)
            if self._out is None and not self.response_complete:
                self._whole(500, _500_HEADERS, b"Internal Server Error")
            else:
                self.protocol.transport.close()
            return
        if not self.response_complete and not self.disconnected:
            log.error("ASGI callable returned without completing response.")
            self.protocol.transport.close()

    def _head(self, status: int, headers: list) -> bytes | None:
        """The status line and headers as uvicorn's cycle writes them; None if it would refuse them."""
        protocol = self.protocol
        defaults, cached = protocol.server_state.default_headers, protocol.default_lines
        if cached[0] is not defaults:  # uvicorn makes a new list when its `date` changes
            cached = protocol.default_lines = (defaults, _plain(defaults))
        default_block, own_block = cached[1], _plain(headers)
        if default_block is None or own_block is None:
            return self._head_per_header(status, defaults + headers)
        block = default_block + own_block
        if not self.keep_alive:
            block += b"connection: close\r\n"
        if b"\ncontent-length:" not in b"\n" + block and status not in (204, 304):
            self._chunked = True
            block += b"transfer-encoding: chunked\r\n"
        return STATUS_LINE[status] + block + b"\r\n"

    def _head_per_header(self, status: int, headers: list) -> bytes | None:
        """`_head` for a `connection` header or a name not in lowercase: uvicorn's loop."""
        lines = [STATUS_LINE[status]]
        close = length = False
        for name, value in headers:
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                return None
            name = name.lower()
            if name == b"content-length":
                length = True
            elif name == b"connection" and b"close" in [t.lower().strip() for t in value.split(b",")]:
                self.keep_alive = False
                close = True
            lines += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not close:
            lines.append(b"connection: close\r\n")
        if not length and status not in (204, 304):
            self._chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _whole(self, status: int, headers: list, body: bytes) -> None:
        head = self._head(status, headers)
        if head is None:  # uvicorn raises in its send; its cycle then answers 500
            self._whole(500, _500_HEADERS, b"Internal Server Error")
            return
        if self._chunked:
            body = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)) if body else b"0\r\n\r\n"
        if not self.disconnected:
            self.protocol.transport.write(head + body)
            self._complete()

    def _complete(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.protocol.transport.close()
        self.protocol.on_response_complete()

    async def _receive(self) -> dict:
        """A stream's `receive`: the body was read; this returns only once the client is gone."""
        gone = asyncio.get_running_loop().create_future()
        previous = self.scope[LOST_CONNECTION].watch(lambda: gone.done() or gone.set_result(None))
        try:
            await gone
        finally:
            self.scope[LOST_CONNECTION].unwatch(previous)
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        """A stream's `send`, as uvicorn's cycle's: the head held for the first part of the body,
        each part a chunk, writes waiting while the transport's buffer is full."""
        protocol = self.protocol
        if protocol.flow.write_paused and not self.disconnected:
            await protocol.flow.drain()
        if self.disconnected:
            return
        if self._out is None:
            head = self._head(message["status"], list(message.get("headers", ())))
            if head is None:
                raise RuntimeError("Invalid HTTP header.")
            self._out = HeldHead(protocol.transport, protocol.loop)
            self._out.write(head)
            return
        if self.response_complete:
            raise RuntimeError("Unexpected ASGI message sent, after response already completed.")
        body, more = message.get("body", b""), message.get("more_body", False)
        if self._chunked:
            self._out.write((b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n"))
        else:
            self._out.write(body)
        if not more:
            self._complete()


class NativeProtocol(HeaderDeadlineProtocol):
    native: NativeRoutes | None = None  # set on a subclass per server, as the header timeout is
    # The server's default headers (`server`, `date`) as head lines (`_plain`), made again only
    # when uvicorn makes a new list of them (once a second, for the date).
    default_lines: tuple = (None, None)
    _first: dict[bytes, bytes] | None = None  # the request's headers by name, first value each

    def on_message_begin(self) -> None:
        # uvicorn's per-request state, but not yet its ASGI scope (a dict of ten entries and a
        # copy of the app state): only a request that takes the ASGI path needs one (`_asgi_scope`).
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = None
        self._arm()  # the header deadline (http_limits.py)

    def _asgi_scope(self) -> None:
        """uvicorn's `on_message_begin`, for the scope it makes, the request so far kept."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        HttpToolsProtocol.on_message_begin(self)
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers

    def on_headers_complete(self) -> None:
        handler, keep_alive = self._native_handler()
        if handler is None:
            self._asgi_scope()
            super().on_headers_complete()
            return
        self._disarm()  # the header deadline (http_limits.py)
        self.cycle = Exchange(self, handler, self.headers, self._first, keep_alive)

    def _native_handler(self) -> tuple[Handler | None, bool]:
        """The handler of a plain POST to a native route on an idle connection, else None."""
        native, parser = self.native, self.parser
        if native is None or parser.get_method() != b"POST" or self.expect_100_continue or self.pipeline:
            return None, False
        if self.cycle is not None and not self.cycle.response_complete:  # pipelined: uvicorn queues it
            return None, False
        if self.root_path or parser.should_upgrade():
            return None, False
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            return None, False  # uvicorn answers 503
        url = self.url
        # An origin-form target with no query is its path (the common case: no URL object made).
        path = url if url[:1] == b"/" and b"?" not in url and b"#" not in url else httptools.parse_url(url).path
        handler = native.by_path.get(path) if b"%" not in path else None
        if handler is None:
            return None, False
        first = dict(reversed(self.headers))  # name -> its first value (Incoming's lookups)
        if b"origin" in first or b"transfer-encoding" in first:
            return None, False
        length = first.get(b"content-length")
        if length is None or not length.isdigit() or int(length) > native.body_limit:
            return None, False
        self._first = first
        return handler, parser.get_http_version() != "1.0" and parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle.__class__ is not Exchange:
            super().on_body(body)
        elif cycle.more_body:  # (after a late body's 408, the rest is dropped)
            cycle.body += body

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if cycle.__class__ is not Exchange:
            super().on_message_complete()
        elif cycle.more_body:
            cycle.more_body = False
            if cycle.timer is not None:
                cycle.timer.cancel()
                cycle.timer = None
            self._start(cycle, bytes(cycle.body))

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        cycle = self.cycle
        # A body still arriving after this read: its deadline, armed only now (most bodies come
        # with their headers, and then no timer is made).
        if cycle.__class__ is Exchange and cycle.more_body and cycle.timer is None and not cycle.disconnected:
            cycle.timer = self.loop.call_later(self.native.body_timeout_s, self._body_late, cycle)

    def _body_late(self, exchange: Exchange) -> None:
        exchange.timer = None
        if exchange.more_body and not exchange.disconnected:
            exchange.more_body = False
            self._start(exchange, LATE)

    def _start(self, exchange: Exchange, body: bytes) -> None:
        # (uvicorn's opt-in fresh context per request, where its version has the option)
        context = contextvars.Context() if getattr(self.config, "reset_contextvars", False) else None
        task = self.loop.create_task(exchange.run(body), context=context)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        if cycle.__class__ is Exchange and cycle.timer is not None:
            cycle.timer.cancel()
            cycle.timer = None
        super().connection_lost(exc)
        if cycle.__class__ is Exchange and cycle.more_body:
            # Gone mid-body: its handler is told as the app's is through `receive` (the request
            # is counted as the client's hang-up, 499; nothing is written).
            cycle.more_body = False
            self._start(cycle, GONE)
