"""The TCP KV data port's listener: what a connection may hold before its hello authenticates.

A data connection opens with a fixed-size hello (tcp_stream.HELLO: a ticket the side channel
granted and its HMAC under --kv-secret). Until that hello has arrived and verified, the
connection is anybody's: no credentials, any rate, one byte a minute if it likes. Were it given
a thread and a slot at accept, with a timeout per `recv`, 64 clients trickling a byte every few
seconds would hold every slot for minutes and every genuine pull would be refused. Here:

- One thread and one selector. A connection saying hello is a non-blocking socket in the
  selector, never a thread, and the loop only ever reads what is already there: it never waits
  on a client. N slow clients cost at most `max_handshakes` sockets and a hello's bytes each.
- The whole hello within `hello_timeout_s` of the accept, however the bytes trickle in.
- Handshakes have their own bounded table: `max_handshakes` in all, `max_handshakes_per_peer`
  per source address. A new connection over either cap displaces the oldest handshake (its
  address's own, else anyone's) rather than being refused: a genuine reader sends its hello
  with the connect and is through within a round trip, so only connections that dawdle are
  displaced, and dawdlers, however many, cannot keep a reader out.
- A connection gets a transfer's stream (one of those an authenticated `read` granted:
  tcp_stream.MAX_SEND_STREAMS in all) and a sender thread only once its whole hello is handed
  to `on_hello` and verifies there. Unauthenticated connections never hold those.
- `max_connections_per_peer` bounds every open connection of one address, streams included; an
  address at that bound gets a new connection only in place of its own oldest handshake.

Invariant: `_open[peer]` counts the address's connections open here or handed to `on_hello`
and not yet `closed(peer)`; `_handshakes` holds exactly the connections in the selector besides
the listening socket and the wake pipe, in accept order (so by ascending deadline).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

log = logging.getLogger(__name__)

TICK_S = 0.5  # `tick` runs at least this often (tcp_stream reaps unclaimed tickets there)
ACCEPT_BURST = 64  # accepts per turn of the loop, then the hellos already waiting are read
ACCEPT_BACKOFF_S = 0.05  # after a failed accept (no file descriptor left): the next try
LOG_EVERY_S = 10.0  # a flood of dropped connections is one warning per this, with counts


@dataclasses.dataclass(frozen=True)
class DataListenerConfig:
    """Bounds on connections that have not authenticated yet (and on one address's total)."""

    hello_timeout_s: float = 5.0  # the whole hello, from the accept
    max_handshakes: int = 64  # connections still saying hello, all addresses
    max_handshakes_per_peer: int = 8  # ... from one source address
    # Every open data connection of one address: tcp_stream.MAX_SEND_STREAMS (32), so one
    # address may hold every stream a prefill worker serves, and never more sockets than that.
    max_connections_per_peer: int = 32

    def __post_init__(self) -> None:
        if not (isinstance(self.hello_timeout_s, (int, float)) and math.isfinite(self.hello_timeout_s)
                and self.hello_timeout_s > 0):
            raise ValueError(f"hello_timeout_s must be positive seconds, got {self.hello_timeout_s!r}")
        if not 1 <= self.max_handshakes_per_peer <= self.max_handshakes:
            raise ValueError(f"need 1 <= max_handshakes_per_peer ({self.max_handshakes_per_peer}) <= "
                             f"max_handshakes ({self.max_handshakes})")
        if self.max_connections_per_peer < self.max_handshakes_per_peer:
            raise ValueError(f"max_connections_per_peer ({self.max_connections_per_peer}) must be at least "
                             f"max_handshakes_per_peer ({self.max_handshakes_per_peer})")


@dataclasses.dataclass(eq=False)
class _Handshake:
    conn: socket.socket
    peer: str
    deadline: float  # monotonic
    hello: bytearray
    got: int = 0


OnHello = Callable[[socket.socket, str, bytes], bool]


class DataListener:
    """Accepts data connections on an ephemeral port of `bind_host` and holds each until its
    `hello_size`-byte hello is whole. Then `on_hello(conn, peer, hello)` runs on this thread (it
    must not block): True, the connection is now the caller's, who calls `closed(peer)` once it
    closed it; False, this listener answers `refused` and closes it."""

    def __init__(self, bind_host: str, hello_size: int, refused: bytes, on_hello: OnHello,
                 tick: Callable[[], None], config: DataListenerConfig):
        self.config = config
        self._hello_size, self._refused, self._on_hello, self._tick = hello_size, refused, on_hello, tick
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self.sock = socket.create_server((bind_host, 0), family=family, backlog=config.max_handshakes)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._handshakes: dict[socket.socket, _Handshake] = {}  # this thread only
        self._lock = threading.Lock()  # _open: the callers' threads close their connections
        self._open: Counter[str] = Counter()
        self.num_dropped = 0  # handshakes closed: late, displaced, over a cap, or hung up
        self._logged_dropped, self._next_log, self._next_accept_log = 0, 0.0, 0.0
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-tcp-accept", daemon=True)
        self._thread.start()

    @property
    def handshakes(self) -> int:
        """Connections still saying hello."""
        return len(self._handshakes)

    def connections(self, peer: str) -> int:
        """Open connections of address `peer`: saying hello, or handed on and not closed yet."""
        with self._lock:
            return self._open[peer]

    def closed(self, peer: str) -> None:
        """Any thread: a connection handed to `on_hello` was closed."""
        with self._lock:
            self._open[peer] -= 1
            if self._open[peer] <= 0:
                del self._open[peer]

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._selector.close()
        self.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the thread ---------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                timeout = TICK_S
                if self._handshakes:
                    oldest = next(iter(self._handshakes.values()))
                    timeout = min(timeout, max(0.0, oldest.deadline - time.monotonic()))
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(4096)
                    elif self._handshakes.get(key.fileobj) is key.data:  # not displaced earlier this turn
                        self._read(key.data)
                self._expire()
                self._tick()
                self._log_drops()
            except Exception:  # a bug must not end the listener: log and go on
                if not self._stop.is_set():
                    log.exception("KV data listener error")
                    self._stop.wait(TICK_S)
        for h in list(self._handshakes.values()):
            self._drop(h)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: the listener stays readable, so do not spin
                now = time.monotonic()
                if now >= self._next_accept_log:
                    log.warning("KV data listener cannot accept: %s", e)
                    self._next_accept_log = now + LOG_EVERY_S
                self._stop.wait(ACCEPT_BACKOFF_S)
                return
            self._admit(conn, addr[0])

    def _admit(self, conn: socket.socket, peer: str) -> None:
        cfg = self.config
        mine = [h for h in self._handshakes.values() if h.peer == peer]  # oldest first; max_handshakes at most
        with self._lock:
            at_bound = self._open[peer] >= cfg.max_connections_per_peer
        if at_bound and not mine:  # every connection of this address is a stream: no room for another
            conn.close()
            self.num_dropped += 1
            return
        if at_bound or len(mine) >= cfg.max_handshakes_per_peer:
            self._drop(mine[0])
        elif len(self._handshakes) >= cfg.max_handshakes:
            self._drop(next(iter(self._handshakes.values())))
        conn.setblocking(False)
        h = _Handshake(conn, peer, time.monotonic() + cfg.hello_timeout_s, bytearray(self._hello_size))
        self._handshakes[conn] = h
        with self._lock:
            self._open[peer] += 1
        self._selector.register(conn, selectors.EVENT_READ, h)

    def _read(self, h: _Handshake) -> None:
        try:
            n = h.conn.recv_into(memoryview(h.hello)[h.got:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n == 0:  # hung up (or reset) before its hello was whole
            self._drop(h)
            return
        h.got += n
        if h.got < len(h.hello):
            return
        self._forget(h)
        kept = False
        try:
            kept = self._on_hello(h.conn, h.peer, bytes(h.hello))
        except Exception:
            log.exception("KV data listener: checking a hello failed")
        if not kept:
            try:
                h.conn.send(self._refused)  # non-blocking, into an empty send buffer
            except OSError:
                pass
            h.conn.close()
            self.closed(h.peer)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._handshakes:
            oldest = next(iter(self._handshakes.values()))
            if oldest.deadline > now:
                return
            self._drop(oldest)

    def _forget(self, h: _Handshake) -> None:
        del self._handshakes[h.conn]
        self._selector.unregister(h.conn)

    def _drop(self, h: _Handshake) -> None:
        self._forget(h)
        h.conn.close()
        self.closed(h.peer)
        self.num_dropped += 1

    def _log_drops(self) -> None:
        now = time.monotonic()
        if self.num_dropped > self._logged_dropped and now >= self._next_log:
            log.warning("KV data port: %d connections closed without an authenticated hello (late, displaced, "
                        "over a per-address bound or hung up) since the last report; %d still saying hello",
                        self.num_dropped - self._logged_dropped, len(self._handshakes))
            self._logged_dropped, self._next_log = self.num_dropped, now + LOG_EVERY_S
