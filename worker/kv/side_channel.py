"""The prefill worker's KV side channel: one ZMQ ROUTER socket on --kv-port, one thread.

Requests are [op, json] multipart messages; replies are [b"ok", json, *frames] or
[b"err", message]. Ops: describe (layout and transport metadata), lease (authenticate and
hold blocks for a one-sided NIXL read), read (TCP: the block bytes themselves), release
(the decode side is done). Every op but describe names a request and its transfer token.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

POLL_MS = 50


class SideChannelServer:
    def __init__(self, bind_host: str, port: int, handlers: dict[str, Callable], tick: Callable[[], None] | None = None):
        self.handlers = handlers
        self.tick = tick  # called every poll interval (NIXL notifications)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(f"tcp://{bind_host}:{port}")
        except zmq.ZMQError as e:
            self.sock.close()
            raise OSError(f"--kv-port {port}: cannot listen on {bind_host}:{port} ({e})") from e
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if self.tick:
                try:
                    self.tick()
                except Exception:
                    log.exception("KV side channel tick failed")
            if not dict(poller.poll(POLL_MS)):
                continue
            ident, _, op, body = self.sock.recv_multipart()
            handler = self.handlers.get(op.decode(errors="replace"))
            try:
                if handler is None:
                    raise ValueError(f"unknown op {op!r}")
                reply, frames, after = handler(json.loads(body))
                trackers = self.sock.send_multipart([ident, b"", b"ok", json.dumps(reply).encode(), *frames],
                                                    copy=not frames, track=bool(frames))
                if after is not None:
                    if trackers is not None:
                        trackers.wait(30)  # zero-copy frames: memory stays leased until sent
                    after()
            except Exception as e:
                log.warning("KV side channel %s refused: %s", op, e)
                self.sock.send_multipart([ident, b"", b"err", str(e).encode()])


class SideChannelError(RuntimeError):
    pass


_local = threading.local()  # per-thread sockets: a DEALER is not thread-safe


def _socket(host: str, port: int, timeout_s: float) -> zmq.Socket:
    """A kept-open DEALER per peer and thread: a new TCP connection per call costs most of a
    small transfer's fixed overhead."""
    cache = getattr(_local, "sockets", None)
    if cache is None:
        cache = _local.sockets = {}
    sock = cache.get((host, port))
    if sock is None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        cache[(host, port)] = sock
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    return sock


def _drop(host: str, port: int) -> None:
    sock = _local.sockets.pop((host, port), None)
    if sock is not None:
        sock.close()


def call(host: str, port: int, op: str, body: dict, timeout_s: float) -> tuple[dict, list]:
    """One request/reply to a peer's side channel. Raises SideChannelError on refusal or timeout."""
    sock = _socket(host, port, timeout_s)
    try:
        sock.send_multipart([b"", op.encode(), json.dumps(body).encode()])
        parts = sock.recv_multipart(copy=False)
    except zmq.Again as e:
        # A late reply would pair with our next request: never reuse a socket that timed out.
        _drop(host, port)
        raise SideChannelError(f"KV peer {host}:{port} did not answer {op} within {timeout_s}s") from e
    status = bytes(parts[1].buffer)
    if status != b"ok":
        raise SideChannelError(f"KV peer {host}:{port} refused {op}: {bytes(parts[2].buffer).decode(errors='replace')}")
    return json.loads(bytes(parts[2].buffer)), parts[3:]
