"""The TCP transport's data connections: KV block bytes at the link's rate, off the side channel.

The side channel only authorizes a transfer (tcp_transport.py): a `read` inside an
authenticated lease gets a one-time ticket, the data port and the transfer's `Plan`. The bytes
then move over `Plan.streams` plain TCP connections to that port, each opened with the ticket
and an HMAC of it under --kv-secret (only a holder of the secret can use a ticket it saw on
the wire), each claimable once. Nothing here runs on the side channel's thread.

A transfer is cut into chunks of whole blocks (about CHUNK_BYTES); chunk j travels on stream
j mod streams, in order, so both sides know every chunk's place without headers. Per stream:

  prefill  copy chunk k+1 device -> page-locked host buffer (async, its own CUDA stream)
           while chunk k is on the wire (sent from that buffer: no Python copy)
  decode   recv_into a page-locked buffer, then host -> device into the destination blocks
           (async) while the next chunk lands in the other buffer

Several streams are several kernel sockets and threads (the GIL is released in send, recv and
the copies), because one TCP stream rarely fills a fast link on its own.

A streamed hand-off reads its whole prompt as one *stream read* (`Transfer.positions`), granted
when the prefill's first chunk is computed: its senders send blocks the moment the prefill has
computed them, so the bytes follow the prefill with no side-channel round trip, connection
set-up or pipeline refill per chunk, and only the last chunk's bytes are left when the prefill
ends. Which blocks are ready is known only as the prefill runs, so a stream read is framed: each
stream takes the next run of computed blocks (up to a chunk) from a cursor the transfer's
streams share, sends a PIECE header (its first position in the read, its block count) and the
bytes, and ends with a zero-count header; with nothing computed it first sends what it has
copied out, then waits on the pin (`PinTable.wait_ready`). The reader places each piece by its
header, refuses a block sent twice or never, and bounds its wait per piece by its stall timeout
rather than a deadline for the whole read (a long prefill is not a slow link).

A stream read may also ask for *layer pieces* (`layered`). Its senders then follow the launched
steps themselves (pins.PinTable.computing: the blocks each step completes and the
layer_clock.LayerClock its forward ticks): a step's blocks leave whole once its forward is
through, not when the engine gets to collect it (on an H200 pair that wait was most of the first
gap over TCP), and the blocks of the step that ends the prompt leave in groups of layers as the
clock passes them, so that step has sent most of its own KV by the time it ends. Such a read's
headers are LAYER_PIECE (position, block count, first layer, end layer); a block's layers may
come in several pieces, each layer once. Only the last step's blocks go in layer pieces (an
earlier chunk's bytes move while the next chunk is computed anyway), and each carries at least
1/LAYER_GROUPS of the layers: every piece costs the senders Python time, the GIL the engine's
step thread needs (layer pieces for every chunk made a 3000-token prefill 30 ms slower there).

Bounds and hang-ups:
- a connection is only a socket in the listener's selector until its whole hello arrived (within
  a deadline) and verified; only then does it take a granted stream and a sender thread. Slow,
  silent or unauthenticated connections are bounded there, in all and per address
  (data_listener.py).
- each stream holds two buffers of one chunk from a pool capped in bytes (host_buffers.py); a
  prefill worker grants at most MAX_SEND_STREAMS streams at once (beyond: "busy", retried), a
  decode worker's pulls share MAX_RECV_BYTES of buffers. A reader that stops draining holds its
  two buffers per stream and, for at most SEND_TIMEOUT_S per chunk, the pin; then the prefill
  side drops the connection, gives the buffers back and ends the transfer.
- the read that granted the transfer holds the pin (pins.open_read) until the transfer ends, and
  not a moment longer: a reader that dies mid-read leaves it to its TTL. Before each chunk's copy
  the prefill side checks the transfer token: a pin released or cancelled meanwhile (the prefill
  was aborted) ends the transfer there.
- a transfer ends when each of its streams ended (sent, failed, hung up, or never claimed
  within CLAIM_S, or by the time another of its streams failed: the reader has then failed the
  whole pull); then the pin's read is closed, a plain read's pin is released (a read is the
  release, as before), and every count and buffer is back (`DataServer.wait_idle`).
- the decode side joins every stream's thread and waits for its device copies before it
  returns or raises: no byte lands in a block after the pull ended.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import secrets
import select
import socket
import struct
import threading
import time

import torch

from pdserve.worker.kv import side_channel
from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.data_listener import DataListener, DataListenerConfig
from pdserve.worker.kv.host_buffers import HostBufferPool
from pdserve.worker.kv.layer_clock import LAYER_GROUPS
from pdserve.worker.kv.pins import HANG_UP_POLL_S, PinTable

log = logging.getLogger(__name__)

# A chunk: whole blocks, about this many bytes (at least one block). Each piece costs the senders
# a few GIL takes, each of which the engine's step thread (launching a prefill, ~1000 GIL
# releases a step) then waits out: 32 MiB rather than 8 gave a 3000-token prefill back 25-64 ms
# of TTFT on an H200 pair, the first gap within 1.5 ms (docs/tcp-kv-gpu-results.md).
# Page-locked buffers, allocated as used and kept: a prefill worker's senders up to
# MAX_SEND_STREAMS * 2 chunks (2 GiB), a decode worker's pulls MAX_RECV_BYTES.
CHUNK_BYTES = 32 << 20
MAX_STREAMS_PER_TRANSFER = 8
# Streams a prefill worker serves at once (2 buffers of a chunk each, allocated as used). A stream
# read holds its streams for its prefill's whole length (mostly waiting), so this covers two
# decode workers at --kv-max-pulls-per-peer 4 and 4 streams each before a reader hears "busy".
MAX_SEND_STREAMS = 32
MAX_RECV_BYTES = 1 << 30  # host buffers all pulls of a decode worker share (4 streams of 2 chunks: 4 pulls)
SEND_TIMEOUT_S = 10.0  # a chunk the reader does not take within this ends the transfer
CLAIM_S = 10.0  # a ticket's streams must be claimed within this after the read was granted
READY_WAIT_S = 300.0  # a streamed transfer's sender waits at most this for its prefill's next chunk

MAGIC = b"pdkv-tcp"
PIECE = struct.Struct("!II")  # a stream read's piece: first position in the read, block count (0: the end)
LAYER_PIECE = struct.Struct("!IIHH")  # a layered stream read's: also the layers [lo, hi) of those blocks
HELLO = struct.Struct("!8s16sHH32s")  # magic, ticket, stream index, streams, HMAC(ticket, index)
ACCEPTED, REFUSED = b"\x01", b"\x00"


@dataclasses.dataclass(frozen=True)
class Plan:
    """One transfer as both sides see it: `nblocks` blocks of `block_bytes`, in chunks of
    `chunk_blocks`, chunk j on stream j mod `streams`."""

    nblocks: int
    block_bytes: int
    chunk_blocks: int
    streams: int

    @property
    def num_chunks(self) -> int:
        return -(-self.nblocks // self.chunk_blocks)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_blocks * self.block_bytes

    def chunks(self, stream: int) -> list[tuple[int, int]]:
        """(first block position, block count) of each chunk stream `stream` carries, in order."""
        return [(j * self.chunk_blocks, min(self.chunk_blocks, self.nblocks - j * self.chunk_blocks))
                for j in range(stream, self.num_chunks, self.streams)]

    def buffers(self, stream: int) -> int:
        return min(2, len(self.chunks(stream)))


def chunk_blocks_for(block_bytes: int) -> int:
    return max(1, CHUNK_BYTES // block_bytes)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, count) of each run of consecutive ids."""
    runs: list[list[int]] = []
    for pos, i in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == i:
            runs[-1][2] += 1
        else:
            runs.append([pos, i, 1])
    return [tuple(r) for r in runs]


def _blocking(sock: socket.socket, timeout_s: float) -> None:
    """Blocking mode with the kernel's own timeouts: a send or a MSG_WAITALL receive then moves a
    whole chunk in one system call, so a stream thread takes the GIL back once per chunk rather
    than once per few hundred KiB. (Under a busy engine thread each take waits up to Python's
    switch interval, 5 ms: per-packet receives made a 64 MiB read under decode load 100+ ms.)"""
    sock.settimeout(None)
    tv = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("the KV peer closed the data connection")
        got += n
        if got < len(view) and deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("the KV data transfer ran out of time")


def _send_all(sock: socket.socket, view: memoryview, timeout_s: float) -> None:
    """Blocking sends (SO_SNDTIMEO each), at most `timeout_s` for the whole view: a reader that
    takes a byte now and then does not keep the stream alive."""
    deadline, sent = time.monotonic() + timeout_s, 0
    while sent < len(view):
        sent += sock.send(view[sent:])
        if sent < len(view) and time.monotonic() > deadline:
            raise TimeoutError("the KV reader did not take a chunk in time")


def _stream_ctx(stream):
    return torch.cuda.stream(stream) if stream is not None else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- prefill side ------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Transfer:
    ticket: bytes
    request_id: str
    token: str
    digest: str
    ids: list[int]  # source blocks, in the reader's order
    keep: bool  # leave the pin for an explicit release (tensor-parallel and streamed readers)
    plan: Plan
    claim_by: float  # monotonic
    positions: list[int] | None = None  # a stream read: the ids' positions in the pin, sent as computed
    cursor: int = 0  # a stream read: ids before this are taken by a stream (all their layers, or their first)
    layers: int = 0  # a layered stream read: layers per block (0: whole blocks, PIECE headers)
    open_runs: list = dataclasses.field(default_factory=list)  # [first, count, layers taken] not yet whole
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    claimed: set[int] = dataclasses.field(default_factory=set)
    open: int = 0  # streams not ended yet (running, or not claimed while the ticket is valid)
    expired: bool = False
    sent: int = 0


class DataServer:
    """Prefill side: the granted transfers, their data connections' sender threads, and the
    listener (data_listener.py) that hands over a connection once its hello claims a stream."""

    def __init__(self, bind_host: str, blocks: torch.Tensor, pins: PinTable, auth: SideChannelAuth, on_sent,
                 num_layers: int = 1, listener: DataListenerConfig = DataListenerConfig()):
        self.blocks, self.pins, self.auth, self.on_sent = blocks, pins, auth, on_sent
        self.block_bytes = blocks.shape[1]
        self.num_layers = num_layers  # a block is num_layers equal slices, one per layer (kv_cache.py)
        self.plan_chunk = chunk_blocks_for(self.block_bytes)
        self.pool = HostBufferPool(MAX_SEND_STREAMS * 2 * self.plan_chunk * self.block_bytes,
                                   pinned=blocks.device.type == "cuda")
        self._cond = threading.Condition()
        self._transfers: dict[bytes, Transfer] = {}
        self._streams = 0  # streams granted and not ended, all transfers
        self._connections = 0  # claimed connections (their sender threads), not those still saying hello
        self.listener = DataListener(bind_host, HELLO.size, REFUSED, self._on_hello, self._reap, listener)
        self.port = self.listener.port

    # -- the side channel's half: grant a transfer (no waiting, no bytes) ----------------------------

    def offer(self, request_id: str, token: str, digest: str, ids: list[int], keep: bool, streams,
              positions: list[int] | None = None, layered: bool = False) -> dict:
        """A ticket for reading `ids` (the caller holds a lease on them; `positions`: a stream
        read, each chunk sent once the pin has computed it; `layered`: and each layer of a block
        the prefill is computing, once written). Raises side_channel.Busy when every stream is taken."""
        want = streams if type(streams) is int and 1 <= streams <= MAX_STREAMS_PER_TRANSFER else 1
        ticket = secrets.token_bytes(16)
        with self._cond:
            granted = min(want, max(1, -(-len(ids) // self.plan_chunk)), MAX_SEND_STREAMS - self._streams)
            if granted < 1:
                raise side_channel.Busy(f"busy: all {MAX_SEND_STREAMS} KV data streams are in use; retry")
            plan = Plan(len(ids), self.block_bytes, self.plan_chunk, granted)
            layers = self.num_layers if layered and positions is not None else 0
            self._transfers[ticket] = Transfer(ticket, request_id, token, digest, list(ids), keep, plan,
                                               time.monotonic() + CLAIM_S, positions, layers=layers, open=granted)
            self._streams += granted
        return {"data_port": self.port, "ticket": ticket.hex(), "nblocks": plan.nblocks,
                "block_bytes": plan.block_bytes, "chunk_blocks": plan.chunk_blocks, "streams": plan.streams,
                **({"layers": layers} if layers else {})}

    # -- state, for /debug, tests and shutdown -----------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Transfers granted and not ended."""
        with self._cond:
            return len(self._transfers)

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no transfer, stream or claimed connection is left and every buffer is back
        (connections still saying hello are the listener's: `listener.handshakes`)."""
        with self._cond:
            done = self._cond.wait_for(lambda: not self._transfers and not self._streams and not self._connections,
                                       timeout_s)
        return done and self.pool.wait_idle(timeout_s)

    def close(self) -> None:
        self.listener.close()

    # -- threads -----------------------------------------------------------------------------------------

    def _on_hello(self, conn: socket.socket, peer: str, hello: bytes) -> bool:
        """On the listener's thread, a whole hello: a connection that claims a granted stream gets
        its sender thread (True); any other is refused by the listener (False)."""
        claimed = self._claim(hello)
        if claimed is None:
            return False
        with self._cond:
            self._connections += 1
        threading.Thread(target=self._connection, args=(conn, peer, *claimed), name="kv-tcp-send",
                         daemon=True).start()
        return True

    def _reap(self) -> None:
        now = time.monotonic()
        with self._cond:
            for t in list(self._transfers.values()):
                if not t.expired and t.claim_by <= now:
                    unclaimed = self._expire(t)
                    if unclaimed:
                        log.warning("KV data ticket of %s: %d of %d streams never connected", t.request_id,
                                    unclaimed, t.plan.streams)

    def _expire(self, t: Transfer) -> int:
        """Under the lock: `t`'s ticket claims no more streams; those never claimed end now.
        Returns how many that was."""
        if t.expired:
            return 0
        t.expired = True
        unclaimed = t.plan.streams - len(t.claimed)
        for _ in range(unclaimed):
            self._stream_ended(t)
        return unclaimed

    def _claim(self, hello: bytes) -> tuple[Transfer, int] | None:
        magic, ticket, index, streams, mac = HELLO.unpack(hello)
        with self._cond:
            t = self._transfers.get(ticket)
            if (magic != MAGIC or t is None or t.expired or index >= t.plan.streams or streams != t.plan.streams
                    or index in t.claimed or not self.auth.verify_data(ticket, index, mac)):
                return None
            t.claimed.add(index)
        return t, index

    def _connection(self, conn: socket.socket, peer: str, t: Transfer, index: int) -> None:
        """A claimed stream's sender thread: it owns `conn` until the stream ends."""
        failed = True
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _blocking(conn, SEND_TIMEOUT_S)  # the listener left it non-blocking
            conn.sendall(ACCEPTED)
            t0 = time.monotonic()
            if t.positions is not None:
                self._send_stream(t, conn)
            else:
                self._send(t, index, conn)
            log.debug("KV data stream %d/%d of %s: claimed %.2f ms after the offer, sent in %.2f ms",
                      index, t.plan.streams, t.request_id, (t0 - (t.claim_by - CLAIM_S)) * 1e3,
                      (time.monotonic() - t0) * 1e3)
            failed = False
        except Exception as e:  # the reader hung up or stalled, or the pin went: this stream ends
            log.debug("KV data stream ended early: %s", e)
        finally:
            conn.close()
            # Before the stream is given back: a new grant's connection from this address must
            # not find it still counted against the address's bound.
            self.listener.closed(peer)
            with self._cond:
                self._connections -= 1
                if failed:
                    # The reader fails its whole pull on any stream's failure, and a stream it had
                    # not connected by then never will (it may have hung up before its hello, which
                    # names no ticket): waiting out CLAIM_S for those would hold the pin's read and
                    # MAX_SEND_STREAMS slots for a transfer that is already over.
                    self._expire(t)
                self._stream_ended(t)
                self._cond.notify_all()

    def _send(self, t: Transfer, index: int, conn: socket.socket) -> None:
        chunks, bb = t.plan.chunks(index), self.block_bytes
        if not chunks:
            return
        # Granted at offer(): the pool has room for every granted stream's buffers.
        bufs = self.pool.take(t.plan.chunk_bytes, t.plan.buffers(index), SEND_TIMEOUT_S)
        stream = torch.cuda.Stream(self.blocks.device) if self.blocks.device.type == "cuda" else None
        try:
            pending = None  # (buffer, event, bytes): copied out, not yet sent
            for k, (first, count) in enumerate(chunks):
                # Still ours? A released or cancelled pin ends the transfer before its blocks are read.
                self.pins.check(t.request_id, t.token, t.digest)
                buf = bufs[k % len(bufs)]
                event = _gather(buf, self.blocks, t.ids[first:first + count], stream)
                if pending is not None:
                    self._put(t, conn, *pending)
                pending = (buf, event, count * bb)
            self._put(t, conn, *pending)
        finally:
            if stream is not None:
                stream.synchronize()  # no copy may still write a buffer that goes back
            self.pool.give_back(bufs)

    def _send_stream(self, t: Transfer, conn: socket.socket) -> None:
        """A stream read's stream: pieces of computed blocks (or layers), taken from the shared
        cursor, each copied out while the one before is on the wire; then the end. A released or
        cancelled pin ends it (PinError), as a hung-up reader does."""
        bufs = self.pool.take(t.plan.chunk_bytes, 2, SEND_TIMEOUT_S)
        stream = torch.cuda.Stream(self.blocks.device) if self.blocks.device.type == "cuda" else None
        try:
            pending, k = None, 0  # (buffer, event, (first, count, lo, hi)): copied out, not yet sent
            while True:
                piece = self._take_piece(t)
                if piece is None:
                    break
                if isinstance(piece, _Wait):  # nothing more is written yet: send what we hold, then wait
                    if pending is not None:
                        self._put_piece(t, conn, *pending)
                        pending = None
                    self._wait(t, conn, piece)
                    continue
                first, count, lo, hi = piece
                buf = bufs[k % 2]
                span = (lo, hi, t.layers) if t.layers else None
                event = _gather(buf, self.blocks, t.ids[first:first + count], stream, span)
                if pending is not None:
                    self._put_piece(t, conn, *pending)
                pending, k = (buf, event, piece), k + 1
            if pending is not None:
                self._put_piece(t, conn, *pending)
            conn.sendall(LAYER_PIECE.pack(0, 0, 0, 0) if t.layers else PIECE.pack(0, 0))
        finally:
            if stream is not None:
                stream.synchronize()  # no copy may still write a buffer that goes back
            self.pool.give_back(bufs)

    def _take_piece(self, t: Transfer) -> "tuple[int, int, int, int] | _Wait | None":
        """The next piece to send, at most a chunk: (first, count, lo, hi), the read's blocks
        first.. first + count - 1, their layers lo.. hi - 1 (0.. layers: whole blocks). First the
        next layers of blocks whose first layers went, then computed blocks from the cursor, then
        (layered) blocks a launched step is computing: the first layers of those of the step that
        ends the prompt, whole ones of an earlier step once it is through. A _Wait when nothing
        more is written; None when everything is taken."""
        whole = t.layers or 1
        group = -(-whole // LAYER_GROUPS)
        with t.lock:
            # PinError: released or cancelled
            ready, computing, total = self.pins.readiness(t.request_id, t.token, t.digest)
            wait = None
            for run in t.open_runs:
                first, count, taken = run
                written, clock = _written(t.positions[first + count - 1], ready, computing, whole)
                if written >= min(whole, taken + group):
                    run[2] = written
                    if written >= whole:
                        t.open_runs.remove(run)
                    return first, count, taken, written
                wait = wait or _Wait(t.positions[first + count - 1] + 1, clock, min(whole, taken + group))
            first, n = t.cursor, len(t.ids)
            if first >= n:
                return wait if t.open_runs else None
            end = min(n, first + t.plan.chunk_blocks)
            count = bisect.bisect_left(t.positions, ready, first, end) - first
            if count:
                t.cursor += count
                return first, count, 0, whole
            if t.layers:
                for upto, clock in computing:
                    if t.positions[first] < upto:
                        # The step that ends the prompt: a group of layers at a time; an earlier
                        # one: its blocks whole, once its forward is through (before it is collected).
                        need = min(whole, group) if upto >= total else whole
                        written = clock.done()
                        if written < need:
                            return wait or _Wait(t.positions[first] + 1, clock, need)
                        count = bisect.bisect_left(t.positions, upto, first, end) - first
                        t.cursor += count
                        if written < whole:
                            t.open_runs.append([first, count, written])
                        return first, count, 0, written
            return wait or _Wait(t.positions[first] + 1, None, 0)

    def _wait(self, t: Transfer, conn: socket.socket, wait: "_Wait") -> None:
        """Until more of what `wait` names is written: a layer of a launched step (its clock, or a
        poll's time), or (no step computes it yet) the pin's block (TimeoutError after
        READY_WAIT_S). PinError when the pin goes; ConnectionError when the reader hangs up."""
        if wait.clock is None:
            if not self.pins.wait_ready(t.request_id, t.token, t.digest, wait.upto, READY_WAIT_S,
                                        lambda: _hung_up(conn), computing_ok=bool(t.layers)):
                raise TimeoutError(f"the prefill computed no block of {t.request_id} in {READY_WAIT_S:.0f}s")
            return
        # A step's forward passes its layers within the step's time; meanwhile the pin may have
        # moved on (collected, finished): look again after a short wait either way. A step that
        # never ends is the reader's stall timeout, which hangs up.
        if not wait.clock.wait(wait.layers, HANG_UP_POLL_S):
            self.pins.check(t.request_id, t.token, t.digest)
            if _hung_up(conn):
                raise ConnectionError("the reader hung up")

    def _put_piece(self, t: Transfer, conn: socket.socket, buf: torch.Tensor, event, piece) -> None:
        first, count, lo, hi = piece
        if t.layers:
            conn.sendall(LAYER_PIECE.pack(first, count, lo, hi))
            self._put(t, conn, buf, event, count * (hi - lo) * (self.block_bytes // t.layers))
        else:
            conn.sendall(PIECE.pack(first, count))
            self._put(t, conn, buf, event, count * self.block_bytes)

    def _put(self, t: Transfer, conn: socket.socket, buf: torch.Tensor, event, nbytes: int) -> None:
        if event is not None:
            event.synchronize()
        _send_all(conn, memoryview(buf.numpy())[:nbytes], SEND_TIMEOUT_S)
        with self._cond:
            t.sent += nbytes

    def _stream_ended(self, t: Transfer) -> None:
        """Under the lock: one of `t`'s streams is over; the last one ends the transfer."""
        t.open -= 1
        self._streams -= 1
        if t.open > 0:
            return
        self._transfers.pop(t.ticket, None)
        self.pins.close_read(t.request_id, t.token)  # opened by the read that granted this transfer
        if not t.keep:  # a plain read is the release (of a pin this reader alone holds)
            self.pins.release(t.request_id, t.token)
        self.on_sent(t.sent)
        self._cond.notify_all()


@dataclasses.dataclass(frozen=True)
class _Wait:
    """What a stream read's sender waits for: `clock` passing `layers` layers, or (no clock)
    the pin's first `upto` blocks computed or being computed."""

    upto: int
    clock: object | None
    layers: int


def _written(position: int, ready: int, computing: list, whole: int) -> tuple[int, object | None]:
    """(layers of the pin's block at `position` written now, the clock of the step computing it)."""
    if position < ready:
        return whole, None
    for upto, clock in computing:
        if position < upto:
            return clock.done(), clock
    return 0, None


def _by_layer(blocks: torch.Tensor, span: tuple[int, int, int] | None):
    """(the blocks as [blocks, span's layers, layer bytes] or as [blocks, bytes], bytes per
    block in the span). `span`: (lo, hi, layers) of a layer piece; None: whole blocks."""
    if span is None or span[1] - span[0] == span[2]:
        return blocks, blocks.shape[1]
    lo, hi, layers = span
    lb = blocks.shape[1] // layers
    return blocks.view(blocks.shape[0], layers, lb)[:, lo:hi], (hi - lo) * lb


def _gather(buf: torch.Tensor, blocks: torch.Tensor, ids: list[int], stream,
            span: tuple[int, int, int] | None = None) -> "torch.cuda.Event | None":
    """Device -> host: blocks `ids` (their layers in `span`), in order, into `buf`, asynchronously
    on `stream` (one copy per run of consecutive ids). Returns the event after which `buf` holds
    them (None: on the CPU, done)."""
    src_view, w = _by_layer(blocks, span)
    with _stream_ctx(stream):
        for pos, src, n in _runs(ids):
            part = src_view[src:src + n]
            buf[pos * w:(pos + n) * w].view(part.shape).copy_(part, non_blocking=True)
        return _recorded(stream)


def _scatter(buf: torch.Tensor, blocks: torch.Tensor, ids: list[int], stream,
             span: tuple[int, int, int] | None = None) -> "torch.cuda.Event | None":
    """Host -> device: `buf`'s blocks (their layers in `span`), in order, into blocks `ids` (the
    reverse of _gather). Returns the event after which `buf` may be reused (None: on the CPU, done)."""
    dst_view, w = _by_layer(blocks, span)
    with _stream_ctx(stream):
        for pos, dst, n in _runs(ids):
            part = dst_view[dst:dst + n]
            part.copy_(buf[pos * w:(pos + n) * w].view(part.shape), non_blocking=True)
        return _recorded(stream)


def _recorded(stream) -> "torch.cuda.Event | None":
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _hung_up(conn: socket.socket) -> bool:
    """Whether the reader closed its end (it never sends after its hello: readable means EOF)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


# -- decode side ---------------------------------------------------------------------------------------

class Cancel:
    """Ends a read from another thread: `receive` registers how to stop its streams."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stops: list = []
        self.cancelled = False

    def on_cancel(self, stop) -> None:
        with self._lock:
            if not self.cancelled:
                self._stops.append(stop)
                return
        stop()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled, stops = True, list(self._stops)
        for stop in stops:
            stop()


_pools: dict[bool, HostBufferPool] = {}
_pools_lock = threading.Lock()


def receive_pool(pinned: bool) -> HostBufferPool:
    with _pools_lock:
        pool = _pools.get(pinned)
        if pool is None:
            pool = _pools[pinned] = HostBufferPool(MAX_RECV_BYTES, pinned)
        return pool


def receive(host: str, port: int, ticket: bytes, plan: Plan, dst_blocks: list[int], blocks: torch.Tensor,
            deadline: float, auth: SideChannelAuth, stall_s: float | None = None, cancel: Cancel | None = None,
            framed: bool = False, layers: int = 0) -> int:
    """Read a granted transfer into `blocks[dst_blocks]` over its streams. Returns bytes. Every
    stream's thread has ended and every device copy is done when this returns or raises.
    `stall_s` (a stream read): each chunk within this of the one before, however long the whole
    read takes; `deadline` then bounds the connections' set-up only. `framed`: the prefill side
    granted a stream read (pieces with headers, any stream any block); `layers`: a layered one
    (LAYER_PIECE headers, each of a block's `layers` layers once)."""
    if len(dst_blocks) != plan.nblocks or blocks.shape[1] != plan.block_bytes:
        raise side_channel.SideChannelError("the KV data plan does not match the pull")
    pool = receive_pool(blocks.device.type == "cuda")
    counts = [2 if framed else plan.buffers(s) for s in range(plan.streams)]
    landed = bytearray(plan.nblocks * max(1, layers))  # framed: each block (each layer of it) once
    bufs = pool.take(plan.chunk_bytes, sum(counts), max(0.0, deadline - time.monotonic()))
    socks: list[socket.socket | None] = [None] * plan.streams
    errors: list[BaseException] = []
    lock = threading.Lock()
    nbytes = [0]

    def abort() -> None:  # wake every stream blocked in recv: the pull has failed
        with lock:
            if cancel is not None and cancel.cancelled and not errors:
                errors.append(ConnectionAbortedError("the pull was cancelled"))
            for s in socks:
                if s is not None:
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def run(index: int, mine: list[torch.Tensor]) -> None:
        try:
            t0 = time.monotonic()
            sock = socket.create_connection((host, port), timeout=_left(deadline))
            with lock:
                socks[index] = sock
                if errors or (cancel is not None and cancel.cancelled):  # failed or cancelled meanwhile
                    raise ConnectionAbortedError("the pull failed on another stream or was cancelled")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _blocking(sock, stall_s if stall_s is not None else _left(deadline))
            sock.sendall(HELLO.pack(MAGIC, ticket, index, plan.streams, auth.sign_data(ticket, index)))
            ack = bytearray(1)
            _recv_exact(sock, memoryview(ack))
            if bytes(ack) != ACCEPTED:
                raise side_channel.SideChannelError(f"KV peer {host}:{port} refused the data connection (ticket "
                                                    f"unknown, expired or already used)")
            accepted = time.monotonic()
            if framed:
                got = _receive_pieces(sock, plan, mine, dst_blocks, blocks, stall_s or _left(deadline), landed, lock,
                                      layers)
            else:
                got = _receive_stream(sock, plan, index, mine, dst_blocks, blocks, deadline)
            log.debug("KV data stream %d/%d: accepted in %.2f ms, %d bytes in %.2f ms", index, plan.streams,
                      (accepted - t0) * 1e3, got, (time.monotonic() - accepted) * 1e3)
            with lock:
                nbytes[0] += got
        except BaseException as e:
            with lock:
                errors.append(e)
            abort()

    if cancel is not None:
        cancel.on_cancel(abort)
    threads, start = [], 0
    for s in range(1, plan.streams):
        start += counts[s - 1]
        threads.append(threading.Thread(target=run, args=(s, bufs[start:start + counts[s]]), name="kv-tcp-recv",
                                         daemon=True))
    try:
        for t in threads:
            t.start()
        run(0, bufs[:counts[0]])
    finally:
        for t in threads:
            t.join()
        for s in socks:
            if s is not None:
                s.close()
        pool.give_back(bufs)
    if errors:
        first = errors[0]  # the cause; the others are the abort it triggered
        if isinstance(first, (socket.timeout, TimeoutError, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO
            raise side_channel.PeerTimeout(f"KV peer {host}:{port}: the data transfer did not finish in time")
        if isinstance(first, side_channel.SideChannelError):
            raise first
        raise side_channel.SideChannelError(f"KV peer {host}:{port}: data transfer failed ({first})") from first
    if framed and not all(landed):
        missing = sum(not all(landed[b * max(1, layers):(b + 1) * max(1, layers)]) for b in range(plan.nblocks))
        raise side_channel.SideChannelError(f"KV peer {host}:{port} ended a stream read without "
                                            f"{missing} of its {plan.nblocks} blocks")
    return nbytes[0]


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the KV pull ran out of time")
    return left


def _receive_stream(sock: socket.socket, plan: Plan, index: int, bufs: list[torch.Tensor], dst_blocks: list[int],
                    blocks: torch.Tensor, deadline: float) -> int:
    bb, nbytes = plan.block_bytes, 0
    stream = torch.cuda.Stream(blocks.device) if blocks.device.type == "cuda" else None
    events: list = [None] * len(bufs)
    try:
        for k, (first, count) in enumerate(plan.chunks(index)):
            b = k % len(bufs)
            if events[b] is not None:
                events[b].synchronize()  # its previous chunk's copy to the device has read it
            view = memoryview(bufs[b].numpy())[:count * bb]
            _left(deadline)
            _recv_exact(sock, view, deadline)
            events[b] = _scatter(bufs[b], blocks, dst_blocks[first:first + count], stream)
            nbytes += count * bb
    finally:
        if stream is not None:
            stream.synchronize()
    return nbytes


def _receive_pieces(sock: socket.socket, plan: Plan, bufs: list[torch.Tensor], dst_blocks: list[int],
                    blocks: torch.Tensor, stall_s: float, landed: bytearray, lock: threading.Lock,
                    layers: int = 0) -> int:
    """A stream read's stream: pieces (header, bytes) until the zero-count header, each within
    `stall_s` of the one before; each placed by its header into `dst_blocks`, each block (each
    layer of a block, `layers`) once."""
    fmt, whole = (LAYER_PIECE, layers) if layers else (PIECE, 1)
    nbytes, header, lb = 0, bytearray(fmt.size), plan.block_bytes // whole
    stream = torch.cuda.Stream(blocks.device) if blocks.device.type == "cuda" else None
    events: list = [None] * len(bufs)
    try:
        for k in itertools.count():
            deadline = time.monotonic() + stall_s  # the prefill's next step may be what this waits for
            _recv_exact(sock, memoryview(header), deadline)
            first, count, lo, hi = fmt.unpack(header) + ((0, 1) if not layers else ())
            if count == 0:
                return nbytes
            with lock:
                marks = [(first + j) * whole + layer for j in range(count) for layer in range(lo, hi)] \
                    if count <= plan.chunk_blocks and first + count <= plan.nblocks and 0 <= lo < hi <= whole else None
                if marks is None or any(landed[m] for m in marks):
                    raise side_channel.SideChannelError(
                        f"the KV peer sent a piece ({first}, {count}, layers {lo}-{hi}) "
                        f"outside its read of {plan.nblocks} blocks, or twice"
                    )
                for m in marks:
                    landed[m] = 1
            b, size = k % len(bufs), count * (hi - lo) * lb
            if events[b] is not None:
                events[b].synchronize()  # its previous piece's copy to the device has read it
            _recv_exact(sock, memoryview(bufs[b].numpy())[:size], deadline)
            events[b] = _scatter(bufs[b], blocks, dst_blocks[first:first + count], stream,
                                 (lo, hi, whole) if layers else None)
            nbytes += size
    finally:
        if stream is not None:
            stream.synchronize()
