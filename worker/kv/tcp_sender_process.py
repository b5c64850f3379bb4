"""The TCP transport's senders in a process of their own (`--kv-tcp-io process`).

A prefill worker's TCP senders (tcp_stream.DataServer) are Python threads: each piece they
send takes the GIL a few times, and each take lands inside whatever the engine's step thread
is doing. Beside them an eager prefill's launches (~1000 GIL releases a step) ran 2.5-3.5x as
long on an H200, which is P/D-over-TCP's TTFT cost against NIXL, whose bytes the reader moves
(docs/tcp-kv-gpu-results.md). Here the data port, the sender threads and their buffers live in
a child process, and the engine's interpreter does per transfer only what it must:

- the cache: the child maps the engine's KV cache, not a copy of it: on the CPU its storage in
  shared memory (the connector puts it there before any transport registers it), on CUDA an IPC
  handle of the same device memory.
- a read: the side channel (engine process) authenticates it and opens the pin's read as before
  (tcp_transport.TcpServer.handle_read), then offers it to the child with a snapshot of the pin
  (pins.PinSnapshot) and waits for the grant (ticket, port, plan): one message and its reply.
- the pin, while read: every later change (a step's blocks computed, a step launched, the last
  step, the first token, a cancel or release) goes to the child as a new snapshot, taken and
  sent under one lock so snapshots arrive in the order taken. The child's `PinMirror` answers the
  DataServer's questions (readiness, check, wait_ready) from them, unchanged code on both sides.
- layers: a launched step's LayerClock writes its count into a shared ring (shared_clocks.py);
  the child reads it (and on CUDA the layer's interprocess event) without a message.
- the end: what the DataServer does to a pin at a transfer's end (close the read, release a
  plain read's pin) and the bytes sent come back as messages, applied on a thread of the
  engine's own, once per transfer. Per chunk the engine's interpreter does nothing.

If the child dies, every read it held is closed (a plain read's pin released, as a failed
transfer's is) and the engine serves later reads with in-process senders (logged). The child
exits when the engine's end of its pipe closes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import torch

from pdserve.worker.kv import side_channel, tcp_stream
from pdserve.worker.kv.child_link import ANSWER_S, ChildEnd, ChildGone, ChildLink
from pdserve.worker.kv.data_listener import DataListenerConfig
from pdserve.worker.kv.pins import RUNNING, PinError, PinSnapshot, wait_ready
from pdserve.worker.kv.shared_clocks import ClockMirrors

log = logging.getLogger(__name__)

# tcp_stream's settings the child takes from the engine's module at start (tests change them).
TUNABLES = ("CHUNK_BYTES", "MAX_SEND_STREAMS", "SEND_TIMEOUT_S", "CLAIM_S", "READY_WAIT_S", "LAYER_GROUPS")


@dataclasses.dataclass(frozen=True)
class SenderSpec:
    bind_host: str
    num_layers: int
    listener: DataListenerConfig
    tunables: tuple[tuple[str, object], ...]
    log_level: int


def tunables(names) -> tuple[tuple[str, object], ...]:
    return tuple((n, getattr(tcp_stream, n)) for n in names)


# -- engine side -------------------------------------------------------------------------------------

class SenderProcess:
    """tcp_stream.DataServer's interface (offer, in_flight, wait_idle, close, port) over a child
    process that runs the real one. Starts the child at once; `offer` waits for it to listen."""

    def __init__(self, bind_host: str, blocks: torch.Tensor, pins, auth, on_sent, num_layers: int,
                 listener: DataListenerConfig, ring):
        self.pins, self.on_sent = pins, on_sent
        if blocks.device.type == "cpu" and not blocks.is_shared():
            blocks.share_memory_()  # a cache nothing has registered yet (the connector shares it earlier)
        spec = SenderSpec(bind_host, num_layers, listener, tunables(TUNABLES),
                          logging.getLogger("pdserve").getEffectiveLevel())
        # rid -> [token, keep, granted] of each read offered to the child and not closed there
        # (under the link's lock, which serializes the pipe's sends).
        self._interest: dict[str, list[list]] = collections.defaultdict(list)
        self._link = ChildLink("pdserve-kv-tcp-senders", child_main, (spec, blocks, auth, ring.share()),
                               on_message=self._message, on_answer=self._answered, on_gone=self._gone)
        pins.observer = self._pin_changed

    @property
    def port(self) -> int | None:
        return self._link.ready_value

    @property
    def pid(self) -> int | None:
        return self._link.pid

    @property
    def gone(self) -> bool:
        return self._link.gone

    # -- DataServer's interface ----------------------------------------------------------------------

    def offer(self, request_id: str, token: str, digest: str, ids: list[int], keep: bool, streams,
              positions: list[int] | None = None, layered: bool = False) -> dict:
        self._link.wait_ready()
        read = [token, keep, False]
        with self._link.lock:
            n, answer = self._link.register(read)
            self._interest[request_id].append(read)
            self._link.send_locked(("offer", n, request_id, token, digest, list(ids), keep, streams, positions,
                                    layered, self.pins.snapshot(request_id)))
        kind, value = self._link.result(answer, ANSWER_S)
        if kind == "granted":  # marked so in _answered, and `_gone` closes it like any other
            return value
        self._forget(request_id, lambda r: r is read)  # the caller closes the read, as for any refusal
        if kind == "busy":
            raise side_channel.Busy(value)
        if kind == "error":
            raise RuntimeError(f"the KV senders' process refused the read: {value}")
        raise ChildGone(value)

    @property
    def in_flight(self) -> int:
        return self._link.call("in_flight")

    def wait_idle(self, timeout_s: float) -> bool:
        return self._link.call("idle", timeout_s, wait_s=timeout_s + ANSWER_S)

    def close(self) -> None:
        self._link.close()

    # -- internals -----------------------------------------------------------------------------------

    def _pin_changed(self, request_id: str) -> None:
        """Any thread, after a pin changed: a pin the child reads gets a new snapshot."""
        if request_id not in self._interest:  # the common case, without the lock
            return
        with self._link.lock:
            if request_id in self._interest and not self._link.gone:
                try:
                    self._link.send_locked(("pin", request_id, self.pins.snapshot(request_id)))
                except ChildGone:
                    pass  # _gone closes its reads

    def _forget(self, request_id: str, which) -> None:
        """One read of the pin fewer offered to the child: the first that `which` picks."""
        with self._link.lock:
            reads = self._interest.get(request_id)
            for i, read in enumerate(reads or ()):
                if which(read):
                    del reads[i]
                    if not reads:
                        del self._interest[request_id]
                    return

    def _answered(self, read: list, kind: str) -> None:
        if kind == "granted":
            read[2] = True  # before any close_read of its transfer, which comes after

    def _message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "close_read":
            _, rid, token = msg
            self._forget(rid, lambda r: r[0] == token and r[2])  # a granted read of that token
            self.pins.close_read(rid, token)
        elif kind == "release":
            self.pins.release(msg[1], msg[2])
        elif kind == "sent":
            self.on_sent(msg[1])

    def _gone(self, stopping: bool) -> None:
        """The child's pipe closed: every read it held ends here as a failed transfer ends."""
        with self._link.lock:
            interest, self._interest = self._interest, collections.defaultdict(list)
        if interest and not stopping:
            log.error("the KV senders' process held reads of %d pins: closed", len(interest))
        for rid, reads in interest.items():
            for token, keep, granted in reads:
                if granted:  # an offer still waiting is closed by its caller, as a refused one
                    self.pins.close_read(rid, token)
                    if not keep:
                        self.pins.release(rid, token)


# -- the child ---------------------------------------------------------------------------------------

class PinMirror:
    """The pin table's questions that tcp_stream.DataServer asks, answered from the engine's
    snapshots of the pins this process reads; what it does to a pin goes back to the engine."""

    def __init__(self, clocks: ClockMirrors, send):
        self._clocks, self._send = clocks, send
        self._cond = threading.Condition()
        self._pins: dict[str, list] = {}  # rid -> [PinSnapshot | None, reads open here]

    def open(self, rid: str, snap: PinSnapshot | None) -> None:
        with self._cond:
            entry = self._pins.setdefault(rid, [snap, 0])
            entry[0] = snap  # sent after every earlier snapshot of it: the newest
            entry[1] += 1

    def unopen(self, rid: str) -> None:
        """An offer that was not granted: its read was never opened here (the engine closes it)."""
        with self._cond:
            self._drop_read(rid)

    def update(self, rid: str, snap: PinSnapshot | None) -> None:
        with self._cond:
            entry = self._pins.get(rid)
            if entry is not None:
                entry[0] = snap
                self._cond.notify_all()

    def _snap(self, rid, token, digest) -> PinSnapshot:
        """Under the lock: the reader's pin (PinError as PinTable's)."""
        entry = self._pins.get(rid) if isinstance(rid, str) else None
        if entry is None or entry[0] is None:
            raise PinError("unknown, released or expired transfer, or a wrong transfer token")
        entry[0].check(token, digest, time.monotonic())
        return entry[0]

    def check(self, rid, token, digest) -> None:
        with self._cond:
            self._snap(rid, token, digest)

    def readiness(self, rid, token, digest) -> tuple[int, list, int]:
        with self._cond:
            snap = self._snap(rid, token, digest)
            if snap.state != RUNNING:
                return snap.total, [], snap.total
            return snap.ready, [(upto, self._clocks.get(slot, gen, layers)) for upto, slot, gen, layers
                                in snap.computing], snap.total

    def wait_ready(self, rid, token, digest, upto: int, timeout_s: float, hung_up=None,
                   computing_ok: bool = False) -> bool:
        return wait_ready(self._cond, lambda: self._snap(rid, token, digest), upto, timeout_s, hung_up, computing_ok)

    def close_read(self, rid: str, token: str) -> None:
        with self._cond:
            self._drop_read(rid)
        self._send("close_read", rid, token)

    def release(self, rid: str, token: str) -> None:
        with self._cond:
            entry = self._pins.get(rid)
            if entry is not None and entry[0] is not None:
                entry[0] = dataclasses.replace(entry[0], released=True)
        self._send("release", rid, token)

    def _drop_read(self, rid: str) -> None:
        entry = self._pins.get(rid)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._pins[rid]


def child_main(conn, spec: SenderSpec, blocks: torch.Tensor, auth, ring_shared: tuple) -> None:
    end = ChildEnd(conn, spec.log_level, "kv-tcp-senders")
    for name, value in spec.tunables:
        setattr(tcp_stream, name, value)
    try:
        mirror = PinMirror(ClockMirrors(ring_shared), end.send)
        server = tcp_stream.DataServer(spec.bind_host, blocks, mirror, auth, lambda n: end.send("sent", n),
                                       spec.num_layers, spec.listener)
    except Exception as e:  # noqa: BLE001  said to the engine, which serves reads itself
        end.send("failed", f"{type(e).__name__}: {e}")
        return
    end.send("ready", server.port)  # the data port, which the grants name

    def handle(msg) -> None:
        kind = msg[0]
        if kind == "offer":
            _, n, rid, token, digest, ids, keep, streams, positions, layered, snap = msg
            mirror.open(rid, snap)
            try:
                end.send("answer", n, "granted", server.offer(rid, token, digest, ids, keep, streams, positions,
                                                              layered))
            except side_channel.Busy as e:
                mirror.unopen(rid)
                end.send("answer", n, "busy", str(e))
            except Exception as e:  # noqa: BLE001  a refused offer, said to the side channel's reader
                mirror.unopen(rid)
                end.send("answer", n, "error", f"{type(e).__name__}: {e}")
        elif kind == "pin":
            mirror.update(msg[1], msg[2])
        elif kind == "in_flight":
            end.send("answer", msg[1], "value", server.in_flight)
        elif kind == "idle":
            n, timeout_s = msg[1], msg[2]
            threading.Thread(target=lambda: end.send("answer", n, "value", server.wait_idle(timeout_s)),
                             daemon=True).start()

    end.serve(handle, server.close)
