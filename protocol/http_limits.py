"""Limits on slow and numerous clients, for the uvicorn server of the router and the worker.

uvicorn bounds the idle time *between* requests (`timeout_keep_alive`) and, with
`limit_concurrency`, answers 503 once that many connections or requests are open; it does not
bound how long a client may take to send a request's headers: a client that sends one header
line every few seconds holds its connection (and a file descriptor) forever, and a few
thousand such clients starve everybody else (slowloris). `HeaderDeadlineProtocol` closes a
connection whose request headers are not complete within `header_timeout_s` of its first byte
(or of the connection opening). The body has its own deadline where it is read
(`protocol.body.read_body`, 408). The idle time between requests is bounded on the same
per-connection timer (`timeout_keep_alive`, as uvicorn bounds it with a timer per request).

The same protocol tells each request what only it knows first: its client's hang-up (a
`LostConnection` in the scope, called from `connection_lost`: protocol/disconnect.py) and that its
whole body has arrived (`BODY_RECEIVED`: protocol/body.py then arms no deadline).

What this cannot do, and the ingress in front should: limit connections and request rate per
client address, and terminate TLS (a TLS handshake is not covered by the header deadline).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.protocol.deadline_timer import DeadlineTimer
from pdserve.protocol.disconnect import LOST_CONNECTION, LostConnection
from pdserve.protocol.held_head import HeldHead

# Set in a request's scope once its whole body has arrived before its app reads it: reading it
# then never waits, so protocol/body.py arms no body deadline (a timer per request).
BODY_RECEIVED = "pdserve.body_received"


class HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0  # set on a subclass per server (uvicorn instantiates the class)
    hold_head: bool = False  # each response's head goes out with its body's first write (held_head.py)

    # One timer per connection (deadline_timer.py), not one armed and cancelled per request:
    # `_headers_due` is when the headers being received must be complete, `_idle_due` when a
    # kept-alive connection with no request since its last answer closes (uvicorn's
    # `timeout_keep_alive`, which it bounds with a timer made and cancelled per answer); None when
    # not due. The timer, when it fires, closes the connection if a due time has passed, is wound
    # again for one still ahead, and lapses if nothing is due (the next request's first byte, or
    # answer, winds it again).
    _timer: DeadlineTimer
    _headers_due: float | None = None
    _idle_due: float | None = None

    def _arm(self) -> None:
        self._idle_due = None
        self._headers_due = self.loop.time() + self.header_timeout_s
        self._timer.wind(self._headers_due)

    def _disarm(self) -> None:
        self._headers_due = None

    def _tick(self) -> None:
        headers, idle = self._headers_due, self._idle_due
        now = self.loop.time()
        if (headers is not None and now >= headers) or (idle is not None and now >= idle):
            if not self.transport.is_closing():
                self.transport.close()
        else:
            self._timer.wind(headers, idle)

    def on_response_complete(self) -> None:
        """uvicorn's, with its keep-alive bound on this connection's timer."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:  # a request received meanwhile: its turn now
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self._idle_due = self.loop.time() + self.timeout_keep_alive
            self._timer.wind(self._idle_due)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._timer = DeadlineTimer(self.loop, self._tick)
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # the next request on a kept-alive connection gets its own deadline

    def on_headers_complete(self) -> None:
        self._disarm()
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is before:  # an upgrade: no request cycle made
            return
        # The request's hang-up, told by connection_lost (protocol/disconnect.py); the cycle's
        # scope is the one its app gets.
        self.cycle.scope[LOST_CONNECTION] = LostConnection()
        if self.hold_head:  # the cycle just made (its task has not run yet)
            self.cycle.transport = HeldHead(self.transport, self.loop)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.cycle is not None and not self.cycle.more_body:
            self.cycle.scope[BODY_RECEIVED] = True

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_due = self._idle_due = None
        self._timer.stop()
        cycle = self.cycle
        super().connection_lost(exc)
        # The cycle uvicorn tells of it (`disconnected`, an `http.disconnect` from `receive`): the
        # latest one, if its response is not complete.
        if cycle is not None and not cycle.response_complete:
            lost = cycle.scope.get(LOST_CONNECTION)
            if lost is not None:
                lost.connection_lost()


@dataclass(frozen=True)
class ClientLimits:
    header_timeout_s: float = 10.0
    keep_alive_s: float = 30.0
    # Open connections (and requests) past which new requests get 503 at once.
    max_connections: int = 4096

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0 or self.keep_alive_s <= 0 or self.max_connections < 1:
            raise ValueError("header timeout and keep-alive must be > 0 and max connections >= 1")

    def uvicorn_options(self, hold_head: bool = False, protocol: type = HeaderDeadlineProtocol, **settings) -> dict:
        """`protocol`: HeaderDeadlineProtocol or a subclass, `settings` its class attributes
        (protocol/native_http.py's `NativeProtocol` and its `native` routes)."""
        protocol = type("HeaderDeadline", (protocol,),
                        {"header_timeout_s": self.header_timeout_s, "hold_head": hold_head, **settings})
        return {"http": protocol, "timeout_keep_alive": self.keep_alive_s, "limit_concurrency": self.max_connections}
