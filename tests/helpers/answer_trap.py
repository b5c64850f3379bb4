"""A TCP proxy in front of a worker that springs once, on the worker's first answer to a POST:
the bytes are held back, `on_spring()` runs (a test SIGKILLs the worker there), and the
caller's connection is cut. What the caller sees is a worker that took the request in, did its
work (a hand-off's KV pulled, say) and died before its first byte: a window too short to hit
with a signal sent from outside. Other traffic (health probes, metrics) passes through.

    trap = AnswerTrap(worker_port, on_spring=lambda: kill(worker))
    router = launch.router("--decode", trap.url, ...)
    ... trap.sprung.wait(30) ...
    trap.close()

Traps may share one `sprung` event: the first of them to see an answer springs, the others then
only pass bytes through.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Callable


class AnswerTrap:
    def __init__(self, target_port: int, on_spring: Callable[[], None], sprung: threading.Event | None = None,
                 lock: threading.Lock | None = None):
        self.target = ("127.0.0.1", target_port)
        self.on_spring = on_spring
        self.sprung = sprung or threading.Event()
        self._lock = lock or threading.Lock()  # shared with the traps sharing `sprung`
        self.springs = 0  # times this trap sprang (0 or 1)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:  # the worker is gone: as a refused connection
                client.close()
                continue
            server.settimeout(None)
            self._socks += [client, server]
            posted = threading.Event()  # a POST went up this connection: its answer springs the trap
            threading.Thread(target=self._up, args=(client, server, posted), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, posted), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, posted: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                if data.startswith(b"POST "):  # HTTP/1.1: one request at a time on a connection
                    posted.set()
                server.sendall(data)
        except OSError:
            pass
        _shut(server)

    def _down(self, server: socket.socket, client: socket.socket, posted: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if posted.is_set():
                    with self._lock:
                        spring = not self.sprung.is_set()
                        if spring:
                            self.springs += 1
                            self.on_spring()
                            self.sprung.set()
                    if spring:
                        break  # the answer is never relayed: the caller's connection is cut below
                client.sendall(data)
        except OSError:
            pass
        _reset(client)
        _shut(server)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._socks:
            _reset(s)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _reset(sock: socket.socket) -> None:
    """Close with a reset, as the kernel closes a killed process's connections."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass
