"""The router's HTTP/1.1 client for the generation path: keep-alive connections per worker,
written to and parsed at the protocol level.

aiohttp did the same job at about a quarter of the router's CPU per request (building a request
object, its writer, its stream reader and timers). This client does only what the router needs:
a POST is one write (request line, headers and body together, the per-worker part of the head
prebuilt), the answer is parsed by httptools (uvicorn[standard]'s parser, already installed), and
body bytes are handed to the reader as they arrive, unparsed: the router frames SSE itself.

Semantics kept from the aiohttp session it replaces on this path:
- at most `limit` connections in use at once (idle ones do not count); waiting for one counts
  against the connect timeout, as the connect does;
- `total_s`: the whole call, status and body, within it;
- `close()` on a response whose body is not fully read closes the connection (that is what
  tells a worker the client left: it aborts the request); a body read to its end returns the
  connection to the pool as soon as the last byte is parsed;
- every failure of the connection (refused, reset, closed before or in the middle of the
  answer, a malformed answer, a timeout of the call) is an `UpstreamConnectionError` (or
  `asyncio.TimeoutError`), raised to whoever waits on the status line or reads the body.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from urllib.parse import urlsplit

import httptools

from pdserve.protocol.deadline_timer import DeadlineTimer

# Buffered body bytes past which the socket stops being read until the reader catches up.
_HIGH_WATER = 1 << 20
# A connection idle longer than this is not reused (aiohttp's keepalive_timeout on this path).
KEEPALIVE_S = 60.0


class UpstreamConnectionError(ConnectionError):
    """The connection to a worker failed, or its answer was cut off or malformed."""


class Headers(dict):
    """Response headers, names lowercased; `get` takes any case."""

    def get(self, name: str, default=None):
        return super().get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name) -> bool:
        return super().__contains__(name.lower())


class UpstreamResponse:
    """One answer: `status` and `headers` known, the body read with `readany()` / `read()`."""

    __slots__ = (
        "status",
        "raw_headers",
        "_headers",
        "_conn",
        "_chunks",
        "_size",
        "_complete",
        "_error",
        "_waiter",
        "_closed",
        "idle_s",
        "_wait_since",
        "_idle_timer",
        "_loop",
    )

    def __init__(self, conn: "Connection"):
        self._loop = conn.loop  # asyncio.get_running_loop() checks the pid (a syscall) on every call
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []  # as the worker sent them
        self._headers: Headers | None = None
        self._conn: Connection | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._complete = False  # the whole body is parsed (it may still be buffered here)
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._closed = False
        # With `idle_s`, a wait in readany() longer than it raises asyncio.TimeoutError: one
        # timer per idle period, not one per read (an asyncio.timeout per chunk costs ~5 µs).
        self.idle_s: float | None = None
        self._wait_since = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def headers(self) -> Headers:
        """The headers by lowercase name (repeated ones joined with ", "), made on first use:
        most answers are relayed without a header of theirs being read."""
        headers = self._headers
        if headers is None:
            headers = self._headers = Headers()
            for name, value in self.raw_headers:
                key = name.decode("latin-1").lower()
                text = value.decode("latin-1")
                # (dict's own methods: `key` is lowercase already, so Headers' lowering is not needed)
                joined = f"{dict.get(headers, key)}, {text}" if dict.__contains__(headers, key) else text
                dict.__setitem__(headers, key, joined)
        return headers

    @property
    def content_type(self) -> str:
        value = self.headers.get("content-type")
        if not value:
            return "application/octet-stream"
        return value.split(";", 1)[0].strip().lower()

    def at_eof(self) -> bool:
        return self._complete and not self._chunks

    async def readany(self) -> bytes:
        """The body bytes buffered so far (waiting for some), b"" once the body is over."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                self._finish()
                return b""
            if self._closed:
                raise UpstreamConnectionError("the response was closed")
            loop = self._loop
            self._waiter = loop.create_future()
            if self.idle_s is not None:
                self._wait_since = loop.time()
                if self._idle_timer is None:
                    self._idle_timer = loop.call_at(self._wait_since + self.idle_s, self._idle_check)
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        if self._conn is not None and self._conn.paused:
            self._conn.resume()
        return data

    async def iter_any(self):
        while data := await self.readany():
            yield data

    async def read(self) -> bytes:
        """The rest of the body; then the response is done."""
        if self._complete and self._error is None:  # all of it is here (the common case): no wait
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._size = 0
            self._finish()
            return data
        parts = []
        while data := await self.readany():
            parts.append(data)
        self._finish()
        return b"".join(parts)

    def close(self) -> None:
        """Done with the response: a body not fully parsed closes its connection (the worker
        sees the client leave). Synchronous and idempotent: it runs inside cancelled tasks."""
        if self._closed:
            return
        self._closed = True
        self._chunks.clear()
        self._finish()
        conn, self._conn = self._conn, None
        if conn is not None:  # still attached: the body is not over
            conn.close(UpstreamConnectionError("the response was closed before its end"))
        self._wake(UpstreamConnectionError("the response was closed"))

    release = close

    # ---- fed by the connection ----

    def _finish(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self._waiter is None or self._waiter.done():
            return  # not waiting: the next wait arms the timer again
        due = self._wait_since + self.idle_s
        loop = self._loop
        if loop.time() < due:  # this wait began after the timer was armed
            self._idle_timer = loop.call_at(due, self._idle_check)
            return
        self._waiter.set_exception(asyncio.TimeoutError(f"no data from the worker for {self.idle_s} s"))

    def _end(self) -> None:
        self._complete = True
        self._conn = None
        if self.at_eof():
            self._finish()
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self._complete:
            self._error = error
        self._conn = None
        self._finish()
        self._wake()

    def _wake(self, error: BaseException | None = None) -> None:
        w = self._waiter
        if w is not None and not w.done():
            if error is not None:
                w.set_exception(error)
            else:
                w.set_result(None)


def _ends_with_connection(response: UpstreamResponse) -> bool:
    """An answer with no length that is not chunked: its body ends with the connection."""
    headers = response.headers
    return (not dict.__contains__(headers, "content-length")
            and "chunked" not in dict.get(headers, "transfer-encoding", "").lower()
            and response.status not in (204, 304) and response.status >= 200)


class Connection(asyncio.Protocol):
    """One keep-alive connection to one worker; it carries one request at a time."""

    def __init__(self, pool: "Pool"):
        self.pool = pool
        self.loop = asyncio.get_running_loop()  # made by the loop's create_connection
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.idle_since = 0.0
        self.reused = False
        self._parser = httptools.HttpResponseParser(self)
        self._response: UpstreamResponse | None = None
        self._head: asyncio.Future | None = None  # resolved when the status line and headers are in
        # The call's bounds, by one timer per connection (protocol/deadline_timer.py) rather than
        # one armed and cancelled per call: when the status line must be in (`_head_due`, set
        # with `first_byte_s`) and the whole answer (`_total_due`, with `total_s`); None when none
        # is due. The timer, when it fires, fails the call whose bound has passed, is wound again
        # for a bound still ahead and lapses when none is due.
        self._head_due: float | None = None
        self._head_s = 0.0
        self._total_due: float | None = None
        self._timer = DeadlineTimer(self.loop, self._tick)
        self._got_bytes = False  # of the current answer
        self._lost = False

    # ---- asyncio.Protocol ----

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._response is None:  # bytes nobody asked for: this connection cannot be trusted
            self.close(UpstreamConnectionError("unexpected bytes from the worker"))
            return
        self._got_bytes = True
        response = self._response
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.close(UpstreamConnectionError("the worker upgraded the connection"))
            return
        except httptools.HttpParserError as e:
            self.close(UpstreamConnectionError(f"malformed answer from the worker: {e}"))
            return
        # The body's reader is woken (and the socket paused past the high-water mark) once per
        # read, not once per piece parsed from it: it runs only after this returns anyway.
        if response is self._response and response._chunks:
            if response._size > _HIGH_WATER:
                self.pause()
            response._wake()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self.pool.forget(self)
        response = self._response
        if response is not None and self._head is not None and self._head.done() and _ends_with_connection(response):
            self._response = None
            self._head_due = self._total_due = None
            self._timer.stop()
            response._end()  # a body delimited by the connection's end: the call is over
            self.pool.done_with(self)
            return
        reason = f"the worker closed the connection{' mid-answer' if self._got_bytes else ''}"
        if exc is not None:
            reason += f": {exc!r}"
        self._error(UpstreamConnectionError(reason))

    # ---- httptools callbacks ----

    def on_header(self, name: bytes, value: bytes) -> None:
        self._response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_due = None
        response = self._response
        response.status = self._parser.get_status_code()
        if not self._head.done():
            self._head.set_result(response)

    def on_body(self, body: bytes) -> None:
        # Runs for every piece of every body: the buffer fed inline, its reader woken by
        # data_received once the read is parsed.
        response = self._response
        response._chunks.append(body)
        response._size += len(body)

    def on_message_complete(self) -> None:
        response, self._response = self._response, None
        if response.status < 200:  # 1xx: the real answer follows on the same connection
            self._response = UpstreamResponse(self)
            return
        self._total_due = None  # the body is over: so is the call's bound (the rest is buffered)
        response._end()
        self.resume()  # paused for a large body that has now ended: the next answer must be read
        if self._parser.should_keep_alive() and not self._lost:
            self.pool.put(self)
        else:
            self.close(None)

    # ---- the client side ----

    def send(self, head: bytes, body: bytes, total_s: float | None, first_byte_s: float | None) -> asyncio.Future:
        """Write the request; the returned future gets the Response once its head is parsed."""
        loop = self.loop
        self._head = loop.create_future()
        self._response = UpstreamResponse(self)
        self._got_bytes = False
        if first_byte_s is not None or total_s is not None:
            now = loop.time()
            self._head_s = first_byte_s
            self._head_due = None if first_byte_s is None else now + first_byte_s
            self._total_due = None if total_s is None else now + total_s
            self._timer.wind(self._head_due, self._total_due)
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)  # large bodies are not copied into one buffer
        return self._head

    def _tick(self) -> None:
        head, total = self._head_due, self._total_due
        now = self.loop.time()
        if head is not None and now >= head:
            self.close(asyncio.TimeoutError(f"the worker sent no answer within {self._head_s} s"))
        elif total is not None and now >= total:
            self.close(asyncio.TimeoutError("the call to the worker took longer than its total timeout"))
        else:
            self._timer.wind(head, total)

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self._lost:
            self.paused = False
            self.transport.resume_reading()

    def close(self, error: BaseException | None) -> None:
        """Close the connection; a request still on it fails with `error`."""
        if self.transport is not None:
            self.transport.close()
        self._lost = True
        self.pool.forget(self)
        self._error(error or UpstreamConnectionError("connection closed"))

    def _error(self, error: BaseException) -> None:
        self._head_due = self._total_due = None
        self._timer.stop()
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(error)
        response, self._response = self._response, None
        if response is not None:
            response._fail(error)
        self.pool.done_with(self)


class Pool:
    """The idle connections to one worker (most recently used first)."""

    def __init__(self, client: "Client", url: str):
        parts = urlsplit(url)
        self.client = client
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        host = parts.netloc.rsplit("@", 1)[-1]
        self.head_tail = f"Host: {host}\r\n{client.extra_headers}".encode("latin-1")
        self.idle: list[Connection] = []
        self.busy: set[Connection] = set()

    def reuse(self) -> Connection | None:
        """An idle connection still fit to carry a request, now in use; None if there is none."""
        while self.idle:
            conn = self.idle.pop()
            if time.monotonic() - conn.idle_since < KEEPALIVE_S and not conn._lost:
                conn.reused = True
                self.busy.add(conn)
                return conn
            conn.close(None)
        return None

    async def connection(self) -> Connection:
        if (conn := self.reuse()) is not None:
            return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: Connection(self), self.host, self.port, ssl=self.ssl)
        except OSError as e:
            raise UpstreamConnectionError(f"cannot connect to {self.host}:{self.port}: {e}") from None
        self.busy.add(conn)
        return conn

    def put(self, conn: Connection) -> None:
        if conn in self.busy:
            self.busy.discard(conn)
            self.client.released()
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def done_with(self, conn: Connection) -> None:
        if conn in self.busy:
            self.busy.discard(conn)
            self.client.released()

    def forget(self, conn: Connection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        for conn in [*self.idle, *self.busy]:
            conn.close(None)


class Client:
    """Pools per worker URL, at most `limit` connections in use across them."""

    def __init__(self, limit: int, headers: dict[str, str] | None = None):
        self.limit = limit
        self.extra_headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._pools: dict[str, Pool] = {}
        self._in_use = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        connect_s: float | None = None,
        total_s: float | None = None,
        first_byte_s: float | None = None,
    ) -> UpstreamResponse:
        """POST `body` to `path` of the worker at `url`; the answer once its head is in (within
        `first_byte_s` of the write, when given). Raises UpstreamConnectionError or
        asyncio.TimeoutError."""
        pool = self._pools.get(url)
        if pool is None:
            pool = self._pools[url] = Pool(self, url)
        started = time.monotonic()
        conn = await self._acquire(pool, connect_s)
        head = self._head(pool, path, headers, len(body))
        while True:
            left = None if total_s is None else max(total_s - (time.monotonic() - started), 0.0)
            reused = conn.reused
            try:
                return await conn.send(head, body, left, first_byte_s)
            except UpstreamConnectionError:
                if not reused or conn._got_bytes:
                    raise
            except BaseException:
                # Cancelled (the caller left, a first-byte bound, an abandoned worker) or failed:
                # the request may be on the worker, so the connection is closed: the worker aborts it.
                conn.close(UpstreamConnectionError("the call was given up"))
                raise
            # A kept-alive connection the worker closed (its idle timeout) just as it was reused:
            # the worker read nothing of this request, so it goes once more on a new connection
            # (not reused: its failure is final).
            conn = await self._acquire(pool, connect_s, fresh=True)

    async def _acquire(self, pool: Pool, connect_s: float | None, fresh: bool = False) -> Connection:
        if not fresh and self._in_use < self.limit and (conn := pool.reuse()) is not None:
            self._in_use += 1  # the common case: no wait, so no timeout object either
            return conn
        async with asyncio.timeout(connect_s):
            await self._slot()
            try:
                return await (self._fresh(pool) if fresh else pool.connection())
            except BaseException:
                self.released()
                raise

    async def _fresh(self, pool: Pool) -> Connection:
        for conn in pool.idle:
            conn.close(None)
        return await pool.connection()

    @staticmethod
    def _head(pool: Pool, path: str, headers: dict[str, str], length: int) -> bytes:
        lines = ""
        for k, v in headers.items():  # a loop, not a join of a generator: no generator per call
            lines += f"{k}: {v}\r\n"
        return (
            f"POST {pool.prefix}{path} HTTP/1.1\r\n{lines}Content-Length: {length}\r\n".encode()
            + pool.head_tail
            + b"\r\n"
        )

    async def _slot(self) -> None:
        if self._in_use < self.limit:
            self._in_use += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # released() hands its slot over: _in_use already counts this call
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.released()  # handed over just as this wait was cancelled: pass it on
            else:
                self._waiters.remove(waiter)
            raise

    def released(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._in_use -= 1

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
