"""The prefill worker's KV side channel: one ZMQ ROUTER socket on --kv-port, one thread.

Wire format (after ZMQ's routing frames):
  request  [b"", op, body json, mac]              body carries ts and nonce (see `auth`) and
                                                  `to`: the worker it is meant for
  reply    [b"", b"ok", json, mac, *block frames] or [b"", b"err", message, mac]
Ops: describe (layout only), lease (authenticate a transfer token and hold its blocks for a
one-sided NIXL read; the NIXL agent metadata travels only in a lease's reply), read (TCP: a
ticket for the prefill worker's data connections, which carry the bytes off this thread
(tcp_stream.py); from a decode worker of an earlier release, the block bytes themselves in the
reply, a copy, and the pin is released at once), release (the decode side is done), progress (a streamed pin:
how many blocks are ready, and the first token once the
prefill ended).

Deferred replies: a handler that has nothing to answer yet (a progress with nothing new, a
lease of blocks still being computed) raises `pins.NotReady`; the request waits in a bounded
list and is retried whenever the step thread calls `wake()` (a pin changed), and answered at
the latest after DEFER_S (a handler called with `deadline=True` answers with what it has). So
a reader learns of a chunk within microseconds of its step ending, without polling, and the
one thread never blocks.

Every request names its destination inside the signed body, `to = {engine_id, host, port}`,
and the server refuses one meant for another worker (`Destination`). The MAC already binds
the op and the request (id, token, indices, prompt digest); without `to`, a decode worker
tricked into signing a lease or read for an address it was handed (forged kv_transfer_params
naming an allowed host but the attacker's port) produced a message the attacker could relay
unchanged to the real prefill worker: a signing oracle for the whole cache (issue 23). Only
`describe` (layout only) may leave the engine id out: the asker may not know it yet.

One thread serves everyone, so nothing on it may wait for a peer:
- every message is handled inside one try, whatever its frames (a malformed one gets an
  error reply, or is dropped when it cannot even be answered), and the loop itself is
  guarded: the thread ends only on `stop()`; `healthy` reports that, for /health;
- requests are capped at MAX_REQUEST_BYTES (libzmq drops the connection beyond it);
- inline block bytes (the earlier read) are copied out of the KV cache before they are
  queued, so a pin never waits on a slow reader, and sends never block: a ROUTER drops a message to a peer whose queue
  (SNDHWM) is full, and a peer address with MAX_UNSENT_PER_PEER replies still unsent gets
  "busy" instead of more bytes. ZMQ fair-queues incoming messages across connections.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

import zmq

from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.messages import (Destination, LeaseReply, LeaseRequest, MalformedReply, ProgressReply,
                                        ProgressRequest)
from pdserve.worker.kv.pins import NotReady
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.protocol.kv_transfer import KVTransferParams

log = logging.getLogger(__name__)

POLL_MS = 50
MAX_REQUEST_BYTES = 64 * 1024  # requests are small JSON; bytes only flow in replies
SNDHWM = 16  # queued outgoing messages per connection before ROUTER drops
MAX_UNSENT_PER_PEER = 2  # replies with block bytes not yet on the wire, per peer address
MAX_UNSENT = 16  # the same, all peers together: bounds the memory of copied blocks
DEFER_S = 1.0  # longest a deferred request waits before it is answered with what there is
MAX_DEFERRED = 512  # deferred requests held at once; beyond, "busy"

Handler = Callable[[dict], tuple[dict, list]]  # body -> (reply, block frames)


class Busy(RuntimeError):
    pass


def destination(engine_id: str | None, host: str, port: int) -> Destination:
    """What a request names as its recipient (signed with the rest of the body)."""
    return Destination(engine_id, host, port)


class SideChannelServer:
    def __init__(self, bind_host: str, port: int, handlers: dict[str, Handler], auth: SideChannelAuth,
                 tick: Callable[[], None] | None = None, identity: Destination | None = None):
        """`identity`: `destination(engine id, advertised host, port)` of this worker; a request
        whose `to` differs is refused (None: only in tests of the channel itself)."""
        self.handlers = handlers
        self.auth = auth
        self.identity = identity
        self.tick = tick  # called every poll interval (NIXL notifications)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        try:
            self.sock.bind(f"tcp://{bind_host}:{port}")
        except zmq.ZMQError as e:
            self.sock.close()
            raise OSError(f"--kv-port {port}: cannot listen on {bind_host}:{port} ({e})") from e
        # (ident, nonce, op, body, peer, deadline): requests waiting for a pin to change
        self._deferred: list[tuple[bytes, str, bytes, dict, str, float]] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._unsent: list[tuple[zmq.MessageTracker, str]] = []  # (tracker, peer address)
        self._unsent_by_peer: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self.num_refused = 0
        self._next_log = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def wake(self) -> None:
        """Any thread: a pin changed; retry the deferred requests now."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake is already pending (or the channel is stopping)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if self.tick:
                    self.tick()
                self._reap()
                ready = dict(poller.poll(POLL_MS))
                if self._wake_r.fileno() in ready:  # pyzmq reports a plain socket by its descriptor
                    self._drain_wake()
                if self._deferred:
                    self._retry_deferred()
                if self.sock not in ready:
                    continue
                for _ in range(64):  # a burst, then back to tick and reap
                    try:
                        msg = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(msg)
            except Exception:  # a bug must not end the channel: log it and serve the next message
                log.exception("KV side channel loop error")
                time.sleep(POLL_MS / 1000)
        log.info("KV side channel stopped")

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _retry_deferred(self) -> None:
        waiting, self._deferred = self._deferred, []
        now = time.monotonic()
        for ident, nonce, op, body, peer, deadline in waiting:
            self._answer(ident, nonce, op, body, peer, deadline, late=now >= deadline)

    def _handle(self, msg: list[zmq.Frame]) -> None:
        ident = msg[0].bytes
        try:
            peer = msg[0].get("Peer-Address") or "?"
        except zmq.ZMQError:
            peer = "?"
        parts = [f.bytes for f in msg[1:]]
        if len(parts) != 4 or parts[0] != b"":
            self._refuse(ident, "", f"malformed request: {len(msg)} frames, expected [id, '', op, body, mac]", peer)
            return
        _, op, raw, mac = parts
        nonce = ""
        try:
            body = self.auth.verify_request(op, raw, mac)
            nonce = str(body.get("nonce", ""))
            handler = self.handlers.get(op.decode(errors="replace"))
            if handler is None:
                raise ValueError(f"unknown op {op[:32]!r}")
            self._check_destination(op, body)
            if op == b"read":
                self._reap()
        except Exception as e:
            self._refuse(ident, nonce, str(e) or type(e).__name__, peer)
            return
        self._answer(ident, nonce, op, body, peer, time.monotonic() + DEFER_S, late=False)

    def _answer(self, ident: bytes, nonce: str, op: bytes, body: dict, peer: str, deadline: float,
                late: bool) -> None:
        """Run the op's handler and reply; a NotReady defers the request (`late`: its deadline
        passed, the handler answers with what it has or refuses)."""
        try:
            handler = self.handlers[op.decode()]
            if op == b"read" and (self._unsent_by_peer[peer] >= MAX_UNSENT_PER_PEER or len(self._unsent) >= MAX_UNSENT):
                raise Busy(f"busy: replies to {peer} are still unsent; retry after reading them")
            try:
                reply, frames = handler({**body, "deadline": True} if late else body)
            except NotReady:
                if late:
                    raise TimeoutError(f"{op.decode()}: the blocks were not ready within {DEFER_S}s") from None
                if len(self._deferred) >= MAX_DEFERRED:
                    raise Busy("busy: too many requests are waiting for prefills; retry") from None
                self._deferred.append((ident, nonce, op, body, peer, deadline))
                return
            payload = json.dumps(reply).encode()
            head = [ident, b"", b"ok", payload, self.auth.sign_reply(nonce, b"ok", payload)]
            if not frames:
                self.sock.send_multipart(head, zmq.NOBLOCK)
                return
            # The frames are this reply's own copy: zero-copy hands them to ZMQ, the tracker says
            # when ZMQ let go (sent, or dropped with a full queue or a closed connection).
            tracker = self.sock.send_multipart(head + frames, zmq.NOBLOCK, copy=False, track=True)
            self._unsent.append((tracker, peer))
            self._unsent_by_peer[peer] += 1
        except Exception as e:
            self._refuse(ident, nonce, str(e) or type(e).__name__, peer)

    def _check_destination(self, op: bytes, body: dict) -> None:
        if self.identity is None:
            return
        to = Destination.of_request(body)
        if not to.names(self.identity, describe=op == b"describe"):
            raise PermissionError(f"this request is meant for {to}, not for this worker ({self.identity}): refused")

    def _refuse(self, ident: bytes, nonce: str, message: str, peer: str) -> None:
        self.num_refused += 1
        now = time.monotonic()
        if now >= self._next_log:  # a flood of bad messages must not become a flood of log lines
            log.warning("KV side channel refused a request from %s: %s (%d refused so far)", peer, message[:200],
                        self.num_refused)
            self._next_log = now + 1.0
        payload = message[:500].encode(errors="replace")
        try:
            self.sock.send_multipart([ident, b"", b"err", payload, self.auth.sign_reply(nonce, b"err", payload)],
                                     zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone or its queue is full: it gets its own timeout

    def _reap(self) -> None:
        if not self._unsent:
            return
        still = []
        for tracker, peer in self._unsent:
            if tracker.done:
                self._unsent_by_peer[peer] -= 1
                if self._unsent_by_peer[peer] <= 0:
                    del self._unsent_by_peer[peer]
            else:
                still.append((tracker, peer))
        self._unsent = still


class SideChannelError(RuntimeError):
    pass


class PeerTimeout(SideChannelError):
    """The peer did not answer in time: it is down, partitioned, or not a KV side channel."""


class PeerBusy(SideChannelError):
    """The peer has too many of our replies still unsent; retrying shortly is right."""


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


def call(host: str, port: int, op: str, body: dict, timeout_s: float, auth: SideChannelAuth,
         engine_id: str | None = None) -> tuple[dict, list]:
    """One request/reply to the side channel of engine `engine_id` at host:port (the body names
    it, signed: the message is good for that worker only). Raises SideChannelError on refusal
    or timeout."""
    sock = _socket(host, port, timeout_s)
    raw, mac, nonce = auth.sign_request(op, {**body, "to": destination(engine_id, host, port).to_body()})
    try:
        sock.send_multipart([b"", op.encode(), raw, mac])
        parts = sock.recv_multipart(copy=False)
    except zmq.Again as e:
        # A late reply would pair with our next request: never reuse a socket that timed out.
        _drop(host, port)
        raise PeerTimeout(f"KV peer {host}:{port} did not answer {op} within {timeout_s}s") from e
    if len(parts) < 4 or parts[0].bytes != b"":
        _drop(host, port)
        raise SideChannelError(f"KV peer {host}:{port} sent a malformed reply to {op}")
    status, payload, reply_mac = parts[1].bytes, parts[2].bytes, parts[3].bytes
    if status != b"ok":
        kind = PeerBusy if payload.startswith(b"busy:") else SideChannelError
        raise kind(f"KV peer {host}:{port} refused {op}: {payload.decode(errors='replace')}")
    try:
        auth.verify_reply(nonce, status, payload, reply_mac)
    except PermissionError as e:
        _drop(host, port)
        raise SideChannelError(f"KV peer {host}:{port}: {e}") from None
    return json.loads(payload), parts[4:]


def progress(host: str, port: int, params: KVTransferParams, digest: str, have: int, timeout_s: float,
             auth: SideChannelAuth, lease: bool = False, want_metadata: bool = False, last_seen: bool = True,
             layers: int | None = None) -> ProgressReply:
    """A streamed pin's progress once it has more than `have` ready blocks or its prefill ended
    (or after the server's DEFER_S with what there is): {ready, state, first_token_id}. `lease`
    (a leasing transport, e.g. NIXL): the reply also leases the pin and names its block ids (and,
    `want_metadata`, carries the peer's transport metadata under the transport's name), so the ready blocks can
    be READ without a lease round trip.
    `last_seen` False: also answer as soon as the prefill's last step begins ({last: true}).
    `layers` (a layered reader: it holds that many layers of the blocks being written): also
    answer when a running step has written more layers (`partial`: pins.PinTable.progress); a
    peer of an earlier release ignores it and answers for whole blocks only."""
    engine_id = params.remote_engine_id
    body = ProgressRequest(params.remote_request_id, params.transfer_token, digest, have, last_seen, layers, lease,
                           want_metadata).to_body()
    reply, _ = call(host, port, "progress", body, timeout_s, auth, engine_id)
    try:
        return ProgressReply.parse(reply, f"KV peer {host}:{port}", engine_id, digest, params.transport, lease,
                                   want_metadata)
    except MalformedReply as e:
        raise SideChannelError(str(e)) from None


def lease(host: str, port: int, params: KVTransferParams, indices: list[int], digest: str, want_metadata: bool,
          timeout_s: float, auth: SideChannelAuth) -> LeaseReply:
    """Lease `indices` of the blocks `params` name, and check the reply is from the engine the params
    name, for this prompt. The caller checks the blocks it got (one rank or the whole cache)."""
    engine_id = params.remote_engine_id
    body = LeaseRequest(params.remote_request_id, params.transfer_token, digest, indices, want_metadata).to_body()
    reply, _ = call(host, port, "lease", body, timeout_s, auth, engine_id)
    try:
        return LeaseReply.parse(reply, f"KV peer {host}:{port}", engine_id, digest, params.transport, want_metadata)
    except MalformedReply as e:
        raise SideChannelError(str(e)) from None
