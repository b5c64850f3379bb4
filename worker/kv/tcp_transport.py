"""TCP transport: the side channel authorizes a read, data connections carry the bytes.

A decode worker's `read` (on the side channel, signed, naming a live transfer token and its
prompt's digest) leases the blocks and gets a one-time ticket, the port of the prefill worker's
data listener and the transfer's plan; the bytes then move over that many plain TCP
connections, chunked and pipelined through page-locked buffers (tcp_stream.py). The side
channel's thread never copies or sends a block. A read is also the release of the pin (one
reader, once) unless it says `keep` (tensor-parallel and streamed readers: the pin stays until
the decode worker's explicit release); the release happens when the transfer ends.

A read without `data` (a decode worker of an earlier release) is answered inline as before:
one reply frame per run of blocks, a copy made on the side channel's thread, the pin released
at once. `tcp_pull(..., data_path=False)` still asks that way (the bench compares the two).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import torch

from pdserve.protocol.kv_transfer import BASE_TRANSPORT
from pdserve.worker.kv import side_channel, tcp_stream
from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.block_runs import check_indices, merge_runs
from pdserve.worker.kv.data_listener import DataListenerConfig
from pdserve.worker.kv.messages import MalformedReply, ReadReply, ReadRequest
from pdserve.worker.kv.pins import PinTable
from pdserve.worker.kv.shared_clocks import ClockRing
from pdserve.worker.kv.child_link import ChildGone
from pdserve.worker.kv.tcp_receiver_process import ReceiverProcess
from pdserve.worker.kv.tcp_sender_process import SenderProcess
from pdserve.worker.kv.transport import KVTransport
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.protocol.kv_transfer import KVTransferParams

log = logging.getLogger(__name__)

BUSY_RETRY_S = 0.01
STREAMS = 4  # data connections a pull asks for (the prefill side may grant fewer)
MAX_LAYERS = 1024  # a peer's layer count we accept (the reader keeps a flag per block and layer)


class TcpTransport(KVTransport):
    """The base transport: every prefill worker serves `read` (TcpServer), whatever its own
    transport, so any decode worker can pull from it."""

    name = BASE_TRANSPORT
    streams = True
    # A link about as fast as the prefill makes KV: each chunk's bytes move while the next,
    # half as large, is computed (measured: docs/tcp-kv-gpu-results.md, docs/handoff-gpu-results.md).
    stream_split = "taper"

    def __init__(self):
        self.server: TcpServer | None = None

    def serve(self, conn) -> dict:
        self.server = TcpServer(conn.blocks, conn.pins, lambda n: conn.metrics.bytes.labels("send", self.name).inc(n),
                                conn.bind_host, conn.auth, num_layers=conn.cache.shape[1], senders=conn.tcp_senders,
                                ring=conn.clock_ring)
        return {"read": self.server.handle_read}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def pull(self, conn, host, port, params, indices, dst_blocks, digest, release) -> int:
        return tcp_pull(host, port, params, indices, dst_blocks, conn.blocks, conn.timeout, conn.auth, digest,
                        keep=not release, receiver=conn.tcp_receiver)

    def open_stream(self, conn, host, port, params, indices, dst_blocks, digest) -> "StreamedRead":
        return StreamedRead(host, port, params, indices, dst_blocks, conn.blocks, conn.timeout, conn.auth, digest,
                            conn.tcp_receiver)

    def pull_shard(self, conn, host, port, remote_rank, params, indices, dst_blocks, digest) -> int:
        return tcp_pull(host, port, params, indices, dst_blocks, conn.blocks, conn.timeout, conn.auth, digest,
                        keep=True, receiver=conn.tcp_receiver)

    def pull_staged(self, conn, slot, host, params, indices, digest, staged, regions) -> int:
        # Frames land with index_copy_, so a fresh tensor (torch's caching allocator on CUDA)
        # needs no registration: the default staging area.
        return sum(tcp_pull(host, params.remote_port + s.remote_rank, params, indices, list(range(len(region))),
                            region, conn.timeout, conn.auth, digest, keep=True) for s, region in zip(staged, regions))


class TcpServer:
    """Prefill side: the `read` op."""

    def __init__(self, blocks: torch.Tensor, pins: PinTable, on_sent, bind_host: str = "127.0.0.1",
                 auth: SideChannelAuth | None = None, num_layers: int = 1,
                 data_listener: DataListenerConfig = DataListenerConfig(), senders: str = "thread", ring=None):
        """`senders`: "thread", the data port and its senders in this process (started by the
        first read); "process", in a child started now (tcp_sender_process.py), whose layered
        reads follow the clocks made with `ring` (a shared_clocks.ClockRing; one is made if None)."""
        self.blocks = blocks  # [num_blocks, block_bytes] uint8 view of the KV cache
        self.num_layers = num_layers  # each block: num_layers equal slices (a layered stream read sends them)
        self.pins = pins
        self.on_sent = on_sent  # (num_bytes) -> None, for metrics
        self.bind_host, self.auth = bind_host, auth or SideChannelAuth(None)
        self.data_listener = data_listener  # bounds on the data port's connections before they authenticate
        self.data: tcp_stream.DataServer | SenderProcess | None = None  # started by the first read that asks for it
        self.ring = ring
        if senders == "process":
            self.ring = ring or ClockRing(num_layers, blocks.device)
            self.data = SenderProcess(bind_host, blocks, pins, self.auth, on_sent, num_layers, data_listener,
                                      self.ring)

    def handle_read(self, body: dict):
        req = ReadRequest.from_body(body)
        if not req.data:
            return self._read_inline(req)
        rid, token, digest, keep = req.request_id, req.token, req.prompt_digest, req.keep
        # A streamed pin defers a plain read until its blocks are computed; a `stream` read is
        # granted at once and its senders follow the prefill, chunk by chunk (tcp_stream.py).
        streamed = req.stream
        # Held from here until the transfer's last stream ends (tcp_stream.DataServer closes the read).
        pinned = self.pins.open_read(rid, token, digest, req.waits_for, streamed)
        try:
            positions = check_indices(req.indices, len(pinned))
            if streamed and any(a >= b for a, b in zip(positions, positions[1:])):
                raise ValueError("a stream read's indices must be ascending")
            ids = [pinned[i] for i in positions]
            args = (rid, token, digest, ids, keep, req.streams, positions if streamed else None,
                    streamed and req.layers)
            if self.data is None:
                self.data = self._threads()
            try:
                offer = self.data.offer(*args)
            except ChildGone:  # logged there; this read and later ones are served here
                gone, self.data = self.data, self._threads()
                gone.close()
                offer = self.data.offer(*args)
        except side_channel.Busy:
            self.pins.close_read(rid, token)
            raise  # the reader retries: its pin stays
        except BaseException:
            self.pins.close_read(rid, token)
            if not keep:  # a read is the release, even one that fails
                self.pins.release(rid, token)
            raise
        return {"prompt_digest": digest, **offer, **({"stream": True} if streamed else {})}, []

    def close(self) -> None:
        if self.data is not None:
            self.data.close()

    def _threads(self) -> tcp_stream.DataServer:
        return tcp_stream.DataServer(self.bind_host, self.blocks, self.pins, self.auth, self.on_sent,
                                     self.num_layers, self.data_listener)

    def _read_inline(self, req: ReadRequest):
        rid, token = req.request_id, req.token
        pinned = self.pins.open_read(rid, token, req.prompt_digest, req.waits_for)
        try:
            ids = [pinned[i] for i in check_indices(req.indices, len(pinned))]
            frames, runs, nbytes = [], [], 0
            for src, _, count in merge_runs(ids, ids):
                chunk = self.blocks[src:src + count]
                chunk = chunk.cpu() if chunk.device.type != "cpu" else chunk.clone()  # our own copy
                frames.append(memoryview(chunk.numpy()).cast("B"))
                runs.append(count)
                nbytes += chunk.numel()
        finally:
            self.pins.close_read(rid, token)
            if not req.keep:  # a read is also the release: one reader, once
                self.pins.release(rid, token)
            # "keep": tensor-parallel readers (several decode ranks may read this rank's shard);
            # the pin stays until the decode worker's rank 0 releases it (kv/tp_transfer.py).
        self.on_sent(nbytes)
        return {"runs": runs, "prompt_digest": req.prompt_digest}, frames


def tcp_pull(host: str, port: int, params: KVTransferParams, indices: list[int], dst_blocks: list[int],
             blocks: torch.Tensor, timeout_s: float, auth: SideChannelAuth, digest: str, keep: bool = False,
             data_path: bool = True, stream: bool = False, cancel: tcp_stream.Cancel | None = None,
             receiver: ReceiverProcess | None = None) -> int:
    """Decode side: read the remote blocks at `indices` into local `dst_blocks`. Returns bytes.
    `keep`: leave the pin for an explicit release (tensor-parallel readers). `data_path`: over
    data connections (else inline in the side channel's reply, as earlier releases did).
    `stream`: the blocks of a streamed pin, granted at once and sent as the prefill computes
    them; `timeout_s` then bounds each chunk's wait (as the streamed pull's stall timeout), not
    the whole read. `cancel`: ends the read from another thread (its streams are shut).
    `receiver`: the data streams are received by that process (tcp_receiver_process.py), when
    it runs and `blocks` is its cache."""
    # A prefill worker of an earlier release defers a `stream` read until all are computed (or,
    # for `layers`, sends whole blocks only); its reply then says which it did.
    body = ReadRequest(params.remote_request_id, params.transfer_token, digest, indices, keep, data_path, STREAMS,
                       stream, stream).to_body()
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        try:
            reply, frames = side_channel.call(host, port, "read", body, max(0.1, deadline - time.monotonic()), auth,
                                              params.remote_engine_id)
            break
        except side_channel.PeerBusy:
            if time.monotonic() + BUSY_RETRY_S >= deadline or (cancel is not None and cancel.cancelled):
                raise
            time.sleep(BUSY_RETRY_S)
    try:
        read = ReadReply.parse(reply, [len(f.buffer) for f in frames], f"KV peer {host}:{port}", digest,
                               len(dst_blocks), blocks.shape[1], tcp_stream.MAX_STREAMS_PER_TRANSFER,
                               tcp_stream.MAX_RECV_BYTES, MAX_LAYERS)
    except MalformedReply as e:
        raise side_channel.SideChannelError(str(e)) from None
    grant = read.grant
    if grant is not None:  # a prefill worker of an earlier release answers inline (below)
        plan = tcp_stream.Plan(grant.nblocks, grant.block_bytes, grant.chunk_blocks, grant.streams)
        granted = time.monotonic()
        args = (host, grant.data_port, grant.ticket, plan, dst_blocks)
        kw = dict(stall_s=timeout_s if stream else None, cancel=cancel, framed=grant.stream, layers=grant.layers)
        n = None
        if receiver is not None and receiver.blocks is blocks and not receiver.gone:
            try:
                n = receiver.receive(*args, deadline, **kw)
            except ChildGone:  # not running (logged when it went): received here
                pass
        if n is None:
            n = tcp_stream.receive(*args, blocks, deadline, auth, **kw)
        if log.isEnabledFor(logging.DEBUG):  # the hand-off's latency chain, read by read (docs/tcp-kv-gpu-results.md)
            done = time.monotonic()
            log.debug("KV read of %s: %d blocks (%.1f MB) over %d streams: granted in %.2f ms, bytes in %.2f ms "
                      "(%.2f GB/s)", params.remote_request_id, len(dst_blocks), n / 1e6, plan.streams,
                      (granted - t0) * 1e3, (done - granted) * 1e3, n / max(done - granted, 1e-9) / 1e9)
        return n
    pos, nbytes = 0, 0
    for frame, count in zip(frames, read.runs):
        data = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(count, blocks.shape[1])
        idx = torch.tensor(dst_blocks[pos:pos + count], device=blocks.device)
        blocks.index_copy_(0, idx, data.to(blocks.device, non_blocking=False))
        pos += count
        nbytes += data.numel()
    return nbytes


class StreamedRead:
    """A stream read (`tcp_pull(..., stream=True)`) on its own thread: started when the prefill's
    first chunk is computed, it lands each later chunk as the prefill computes it while the
    streamed pull follows the pin's progress (connector.py)."""

    def __init__(self, host: str, port: int, params: KVTransferParams, indices: list[int], dst_blocks: list[int],
                 blocks: torch.Tensor, stall_s: float, auth: SideChannelAuth, digest: str,
                 receiver: ReceiverProcess | None = None):
        self.cancel = tcp_stream.Cancel()
        self._done = Future()
        self._receiver = receiver
        args = (host, port, params, indices, dst_blocks, blocks, stall_s, auth, digest)
        self._thread = threading.Thread(target=self._run, args=args, name="kv-tcp-stream-read", daemon=True)
        self._thread.start()

    def _run(self, *args) -> None:
        try:
            self._done.set_result(tcp_pull(*args, keep=True, stream=True, cancel=self.cancel,
                                           receiver=self._receiver))
        except BaseException as e:
            self._done.set_exception(e)

    def raise_if_failed(self) -> None:
        if self._done.done() and self._done.exception() is not None:
            raise self._done.exception()

    def result(self) -> int:
        """Its bytes, once every chunk landed (each chunk's wait is bounded by `stall_s`)."""
        return self._done.result()

    def stop(self) -> None:
        """End it if it still runs, and wait until its threads have (no byte lands after this)."""
        if not self._done.done():
            self.cancel.cancel()
        self._thread.join()
