"""Slow and silent clients of a prefill worker's TCP KV data port (worker/kv/data_listener.py),
as anyone who reaches the port could open them: no ticket, no secret.

Each comes from its own loopback source address (127.0.0.2, 127.0.0.3, ...: Linux routes all of
127/8 to lo), so a test can flood the port from many addresses, or from one, while a genuine
reader connects from 127.0.0.1."""

from __future__ import annotations

import select
import socket
import threading
import time

from pdserve.worker.kv import tcp_stream


def source(i: int) -> str:
    """The i-th attacker's address (never 127.0.0.1, the genuine readers')."""
    return f"127.0.0.{2 + i}"


def is_closed(sock: socket.socket) -> bool:
    """Whether the server closed it (it never sends to a connection whose hello is not whole, so
    readable means closed). Never waits: a socket's own timeout would apply to a recv."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    if not poll.poll(0):
        return False
    try:
        return sock.recv(1) == b""
    except OSError:  # reset: closed with our bytes unread
        return True


class Flood:
    """`per_address` connections from each of `addresses` source addresses to host:port, opened in
    order. `trickle_s`: each sends the hello one byte at a time, one every `trickle_s` (a whole
    hello would take HELLO.size x that); None: they send nothing."""

    def __init__(self, host: str, port: int, addresses: int, per_address: int, trickle_s: float | None = 0.5):
        self.socks = [socket.create_connection((host, port), timeout=5, source_address=(source(a), 0))
                      for a in range(addresses) for _ in range(per_address)]
        self._closed = [False] * len(self.socks)
        self._hello = tcp_stream.MAGIC + bytes(tcp_stream.HELLO.size - len(tcp_stream.MAGIC))
        self._trickle_s = trickle_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        if trickle_s is not None:
            self._thread.start()

    def _trickle(self) -> None:
        for i in range(len(self._hello)):
            for sock in self.socks:
                try:
                    sock.send(self._hello[i:i + 1])
                except OSError:
                    pass  # closed by the server: is_closed will say so
            if self._stop.wait(self._trickle_s):
                return

    def closed(self) -> int:
        """How many the server has closed so far (a closed one stays closed)."""
        for i, sock in enumerate(self.socks):
            self._closed[i] = self._closed[i] or is_closed(sock)
        return sum(self._closed)

    def wait_closed(self, at_least: int, timeout: float = 10.0) -> bool:
        """Polls (with a bound) until the server has closed `at_least` of them."""
        deadline = time.monotonic() + timeout
        while self.closed() < at_least:
            if time.monotonic() > deadline:
                return False
            self._stop.wait(0.01)
        return True

    def open_ones(self) -> list[int]:
        self.closed()
        return [i for i, c in enumerate(self._closed) if not c]

    def __enter__(self) -> "Flood":
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for sock in self.socks:
            sock.close()
