"""The TCP transport's data connections (worker/kv/tcp_stream.py), in process on real sockets:
a real side channel (ZMQ, HMAC under a secret), the real pin table and TcpServer, the real
decode-side tcp_pull. CPU caches (the device copies are plain copies here; the GPU path is
the same code with page-locked buffers and events, measured by tools/gpu/tcp_kv.sh)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from pdserve.protocol.kv_layout import KVLayout
from pdserve.protocol.kv_transfer import KVTransferParams
from pdserve.worker.kv import side_channel, tcp_stream, tcp_transport
from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.data_listener import DataListenerConfig
from pdserve.worker.kv.layer_clock import LayerClock
from pdserve.worker.kv.nixl_transport import nixl_available
from pdserve.worker.kv.pins import PinTable
from pdserve.worker.kv.prompt_binding import prompt_digest
from pdserve.worker.kv.tcp_transport import TcpServer, tcp_pull
from tests.net import free_port
from tests.worker.data_port_flood import Flood, is_closed, source

SECRET = "tcp-stream-test-secret"
AUTH = SideChannelAuth(SECRET)
DIGEST = prompt_digest([1, 2, 3, 4, 5])
BLOCK_BYTES = 64 << 10
ENGINE = "prefill-engine"
LAYERS = 4


class Prefill:
    """A prefill worker's KV serving half: cache, pins, side channel, TcpServer."""

    def __init__(self, num_blocks: int = 96, auth: SideChannelAuth = AUTH, ttl: float = 300, num_layers: int = 1,
                 data_listener: DataListenerConfig = DataListenerConfig(), senders: str = "thread",
                 device: str = "cpu"):
        self.cache = torch.randint(0, 256, (num_blocks, BLOCK_BYTES), dtype=torch.uint8).to(device)
        self.pins = PinTable(ttl=ttl)
        self.sent = 0
        self.port = free_port()
        self.tcp = TcpServer(self.cache, self.pins, self._on_sent, "127.0.0.1", auth, num_layers=num_layers,
                             data_listener=data_listener, senders=senders)
        self.channel = side_channel.SideChannelServer(
            "127.0.0.1", self.port, {"read": self.tcp.handle_read, "describe": lambda b: ({"ok": True}, [])}, auth,
            identity=side_channel.destination(ENGINE, "127.0.0.1", self.port))
        self.pins.on_change = self.channel.wake
        self.channel.start()

    def _on_sent(self, n: int) -> None:
        self.sent += n

    def pin(self, rid: str, ids: list[int]) -> dict:
        token, _ = self.pins.add(rid, ids, DIGEST)
        return {"remote_request_id": rid, "transfer_token": token, "remote_engine_id": ENGINE,
                "remote_block_ids": ids}

    def grant(self, params: dict, indices: list[int], streams: int = 1, keep: bool = False) -> dict:
        """A signed data read, as tcp_pull sends it: the grant (ticket, port, plan)."""
        reply, _ = side_channel.call("127.0.0.1", self.port, "read",
                                     {"request_id": params["remote_request_id"], "token": params["transfer_token"],
                                      "indices": indices, "prompt_digest": DIGEST, "data": True, "streams": streams,
                                      "keep": keep}, 5, AUTH, ENGINE)
        return reply

    def wrap_reads(self, monkeypatch, wrap) -> None:
        """Serve `read` as wrap(the real handler, body): a worker of another release, a bad peer."""
        handle = self.tcp.handle_read
        monkeypatch.setattr(self.tcp, "handle_read", lambda body: wrap(handle, body))
        self.channel.handlers["read"] = self.tcp.handle_read

    def close(self) -> None:
        self.channel.stop()
        self.tcp.close()


@pytest.fixture
def prefill():
    p = Prefill()
    yield p
    p.close()


@pytest.fixture
def layered_prefill():
    """Blocks of LAYERS layers (a block is that many equal slices, as in the KV cache's layout)."""
    p = Prefill(num_layers=LAYERS)
    yield p
    p.close()


@pytest.fixture
def big_prefill():
    p = Prefill(num_blocks=512)
    yield p
    p.close()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 blocks, 3 streams: a 20-block pull is 7 chunks over every stream."""
    monkeypatch.setattr(tcp_stream, "CHUNK_BYTES", 3 * BLOCK_BYTES)
    monkeypatch.setattr(tcp_transport, "STREAMS", 3)


def as_params(d: dict) -> KVTransferParams:
    """The parsed params a decode worker carries; tcp_pull reads the request id, token and engine."""
    return KVTransferParams(**{"remote_host": "127.0.0.1", "remote_port": 0,
                               "num_prompt_tokens": 1, "first_token_id": 0, "transport": "tcp",
                               "kv_layout": KVLayout(1, 1, 1, "uint8", 1),
                               **{k: v for k, v in d.items() if k in KVTransferParams.__dataclass_fields__},
                               "remote_block_ids": tuple(d.get("remote_block_ids", ()))})


def pull(p: Prefill, params: dict, indices: list[int], dst: list[int], cache: torch.Tensor, **kw) -> int:
    return tcp_pull("127.0.0.1", p.port, as_params(params), indices, dst, cache, 10, AUTH, DIGEST, **kw)


def wait_until(predicate, timeout: float = 10.0) -> bool:
    """A condition polled with a bound (for counters that have no condition variable)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.01)
    return True


def connect(p: Prefill, grant: dict, index: int = 0, auth: SideChannelAuth = AUTH, ticket: bytes | None = None,
            slow: bool = False, source_address: str = "127.0.0.1"):
    """A raw data connection that presents the grant's ticket: (socket, the server's answer
    byte). `slow`: a 4 KiB receive window (set before connecting, so it is what the sender sees)."""
    ticket = ticket if ticket is not None else bytes.fromhex(grant["ticket"])
    sock = socket.socket()
    sock.settimeout(10)
    sock.bind((source_address, 0))
    if slow:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", grant["data_port"]))
    sock.sendall(tcp_stream.HELLO.pack(tcp_stream.MAGIC, ticket, index, grant["streams"],
                                       auth.sign_data(ticket, index)))
    return sock, sock.recv(1)


def test_a_multi_chunk_pull_equals_the_single_shot_bytes(prefill, small_chunks):
    src = [5, 6, 7, 30, 31, 2, 40, 41, 42, 43, 44, 60, 11, 12, 13, 14, 70, 71, 90, 3]  # runs and strays
    dst = [1, 2, 3, 4, 9, 10, 11, 12, 20, 21, 22, 23, 24, 25, 50, 51, 52, 80, 81, 82]
    chunked, inline = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8), torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    n = pull(prefill, prefill.pin("a", src), list(range(len(src))), dst, chunked)
    pull(prefill, prefill.pin("b", src), list(range(len(src))), dst, inline, data_path=False)
    assert n == len(src) * BLOCK_BYTES
    assert torch.equal(chunked, inline)
    assert torch.equal(chunked[dst], prefill.cache[src])
    untouched = [i for i in range(96) if i not in dst]
    assert not chunked[untouched].any()
    # A read is the release: both pins are gone (the data path's once its transfer ended).
    assert prefill.tcp.data.wait_idle(10)
    assert sorted(rid for rid, _, expired in prefill.pins.collect() if not expired) == ["a", "b"]
    assert prefill.sent == 2 * n


def test_a_kept_pin_serves_several_chunked_reads_of_a_subset(prefill, small_chunks):
    """Tensor-parallel and streamed readers read parts of a pin with `keep`; the pin stays."""
    src = list(range(40, 60))
    params = prefill.pin("kept", src)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    pull(prefill, params, list(range(0, 8)), list(range(0, 8)), cache, keep=True)
    pull(prefill, params, list(range(8, 20)), list(range(8, 20)), cache, keep=True)
    assert torch.equal(cache[:20], prefill.cache[40:60])
    assert prefill.tcp.data.wait_idle(10)
    assert prefill.pins.collect() == []  # still pinned: the reader releases it explicitly
    assert prefill.pins.release("kept", params["transfer_token"])


def test_a_read_of_blocks_not_yet_computed_waits_for_them(prefill, small_chunks):
    """The streamed hand-off: a read of a chunk the prefill has not computed is deferred by the
    side channel and granted once `advance` makes it readable."""
    token = prefill.pins.add_streamed("s", list(range(10, 30)), DIGEST, ready=4)
    params = {"remote_request_id": "s", "transfer_token": token, "remote_engine_id": ENGINE}
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    result = {}
    reader = threading.Thread(target=lambda: result.setdefault(
        "n", pull(prefill, params, list(range(4, 12)), list(range(4, 12)), cache, keep=True)))
    reader.start()
    prefill.pins.advance("s", 12)
    reader.join(15)
    assert result.get("n") == 8 * BLOCK_BYTES
    assert torch.equal(cache[4:12], prefill.cache[14:22])


def streamed_pin(prefill: Prefill, rid: str, ids: list[int], ready: int) -> dict:
    token = prefill.pins.add_streamed(rid, ids, DIGEST, ready=ready)
    return {"remote_request_id": rid, "transfer_token": token, "remote_engine_id": ENGINE}


def start_stream_read(prefill: Prefill, params: dict, indices: list[int], dst: list[int], cache: torch.Tensor,
                      stall_s: float = 10) -> tcp_transport.StreamedRead:
    return tcp_transport.StreamedRead("127.0.0.1", prefill.port, as_params(params), indices, dst, cache, stall_s, AUTH,
                                      DIGEST)


def test_a_stream_read_lands_each_block_once_computed_and_never_before(prefill, small_chunks):
    """One read for the whole streamed pin, granted with the first blocks computed: every block
    the prefill computes reaches the reader with no further request, and no block moves before
    it is computed (the cache holds other bytes there until then: they would show)."""
    params = stream_read_following_the_pin(prefill, "s")
    assert prefill.tcp.data.wait_idle(10) and tcp_stream.receive_pool(False).in_use == 0
    assert prefill.pins.collect() == []  # kept: the streamed pull releases it after its last read
    assert prefill.pins.release("s", params["transfer_token"])


def stream_read_following_the_pin(prefill: Prefill, rid: str) -> dict:
    """A stream read of a 20-block streamed pin whose prefill advances in four steps: each step's
    blocks land, no later block moves before its step; the read ends with the prefill. Its params."""
    src = list(range(40, 60))
    params = streamed_pin(prefill, rid, src, ready=2)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(prefill, params, list(range(20)), list(range(20)), cache)
    for ready in (2, 7, 8, 16):  # pieces cut across the 3-block chunks
        prefill.pins.advance(rid, ready)
        assert wait_until(lambda: torch.equal(cache[:ready], prefill.cache[40:40 + ready])), f"blocks 0..{ready}"
        assert not cache[ready:].any(), f"a block past {ready} moved before it was computed"
        read.raise_if_failed()
    prefill.pins.finish(rid, first_token_id=7)
    assert read.result() == 20 * BLOCK_BYTES
    read.stop()
    assert torch.equal(cache[:20], prefill.cache[40:60])
    return params


def layer_slices(cache: torch.Tensor, blocks, lo: int, hi: int) -> torch.Tensor:
    """Layers lo..hi-1 of `blocks` (each block LAYERS equal slices)."""
    return cache[list(blocks)].view(len(blocks), LAYERS, -1)[:, lo:hi]


def test_a_layered_stream_read_sends_the_last_steps_layers_once_written_and_never_before(
        layered_prefill, small_chunks):
    """Two launched steps compute the pin's blocks 2..11 and 12..19 (async scheduling: the last
    one, which ends the prompt, is queued behind the first), each announced with its layer clock.
    The first step's blocks leave whole once its forward is through, before it is collected (no
    advance); the last step's leave layer by layer as its clock passes each, while it runs; no
    byte moves before its clock passed it (the reader's cache holds zeros there until then)."""
    p = layered_prefill
    src = list(range(40, 60))
    params = streamed_pin(p, "l", src, ready=2)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(p, params, list(range(20)), list(range(20)), cache)
    first, last = LayerClock(LAYERS, torch.device("cpu")), LayerClock(LAYERS, torch.device("cpu"))
    p.pins.computing("l", 12, first)
    p.pins.computing("l", 20, last)
    assert wait_until(lambda: torch.equal(cache[:2], p.cache[40:42]))
    for layer in range(LAYERS - 1):
        first.after_layer(layer)
    assert not cache[2:20].any(), "a block of a step still running moved (only the last step sends layers)"
    first.after_layer(LAYERS - 1)  # through: its blocks are whole (it is collected later)
    assert wait_until(lambda: torch.equal(cache[2:12], p.cache[42:52])), "the first step's blocks"
    assert not cache[12:20].any(), "the last step's blocks moved before it wrote a layer"
    for layer in range(LAYERS):
        last.after_layer(layer)  # the last step's forward wrote this layer of blocks 12..19
        assert wait_until(lambda: torch.equal(layer_slices(cache, range(12, 20), 0, layer + 1),
                                              layer_slices(p.cache, range(52, 60), 0, layer + 1))), f"layer {layer}"
        assert not layer_slices(cache, range(12, 20), layer + 1, LAYERS).any(), f"a layer past {layer} moved"
        read.raise_if_failed()
    p.pins.advance("l", 12)  # the steps are collected; the prefill ends
    p.pins.finish("l", first_token_id=7)
    assert read.result() == 20 * BLOCK_BYTES
    read.stop()
    assert torch.equal(cache[:20], p.cache[40:60])
    assert p.tcp.data.wait_idle(10) and tcp_stream.receive_pool(False).in_use == 0
    assert p.pins.release("l", params["transfer_token"])


def test_layer_pieces_carry_a_group_of_layers(layered_prefill, small_chunks, monkeypatch):
    """With LAYER_GROUPS 2 a piece of the last step carries two of the four layers: one layer
    written sends nothing, two send both."""
    monkeypatch.setattr(tcp_stream, "LAYER_GROUPS", 2)
    p = layered_prefill
    params = streamed_pin(p, "g", list(range(40, 50)), ready=0)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(p, params, list(range(10)), list(range(10)), cache)
    clock = LayerClock(LAYERS, torch.device("cpu"))
    p.pins.computing("g", 10, clock)
    clock.after_layer(0)
    clock.after_layer(1)
    assert wait_until(
        lambda: torch.equal(layer_slices(cache, range(10), 0, 2), layer_slices(p.cache, range(40, 50), 0, 2))
    )
    clock.after_layer(2)
    assert not layer_slices(cache, range(10), 2, LAYERS).any(), "a piece of one layer, under a group of two"
    clock.after_layer(3)
    p.pins.finish("g", first_token_id=1)
    assert read.result() == 10 * BLOCK_BYTES
    read.stop()
    assert torch.equal(cache[:10], p.cache[40:50])
    assert p.pins.release("g", params["transfer_token"])


def test_a_reader_without_layer_pieces_gets_whole_blocks_once_their_step_ends(layered_prefill, small_chunks,
                                                                             monkeypatch):
    """A decode worker of an earlier release does not ask for layer pieces: a block whose step is
    still running reaches it only once the step was collected, whole, however many layers are written."""
    p = layered_prefill
    p.wrap_reads(monkeypatch, lambda handle, body: handle({k: v for k, v in body.items() if k != "layers"}))
    params = streamed_pin(p, "w", list(range(40, 60)), ready=2)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(p, params, list(range(20)), list(range(20)), cache)
    clock = LayerClock(LAYERS, torch.device("cpu"))
    p.pins.computing("w", 20, clock)
    for layer in range(LAYERS - 1):
        clock.after_layer(layer)
    p.pins.advance("w", 5)  # an earlier step's blocks, collected meanwhile
    assert wait_until(lambda: torch.equal(cache[:5], p.cache[40:45]))
    assert not cache[5:20].any(), "a block of the running step moved before its step was collected"
    p.pins.finish("w", first_token_id=7)
    assert read.result() == 20 * BLOCK_BYTES
    read.stop()
    assert torch.equal(cache[:20], p.cache[40:60])
    assert p.pins.release("w", params["transfer_token"])


@pytest.mark.parametrize("layers", [3, 2048, "4", -1])
def test_a_grant_of_layers_that_do_not_fit_the_block_is_refused(layered_prefill, monkeypatch, layers):
    """A peer's layer count decides how the reader cuts every piece and what it allocates: one that
    does not divide the block, is too large or is not a count fails the pull, and it ends on both sides."""
    p = layered_prefill
    monkeypatch.setattr(tcp_stream, "CLAIM_S", 1.0)  # the ticket the reader does not use expires soon
    p.wrap_reads(monkeypatch, lambda handle, body: ({**handle(body)[0], "layers": layers}, []))
    params = streamed_pin(p, "bad", list(range(40, 44)), ready=4)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(p, params, list(range(4)), list(range(4)), cache, stall_s=2)
    with pytest.raises(side_channel.SideChannelError, match="layers per"):
        read.result()
    read.stop()
    assert not cache.any()
    assert p.tcp.data.wait_idle(10)  # its streams were never claimed: the ticket expires
    assert p.pins.release("bad", params["transfer_token"])


def test_a_stream_read_of_a_cancelled_prefill_fails_and_frees_both_sides(prefill, small_chunks):
    params = streamed_pin(prefill, "c", list(range(10, 30)), ready=4)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(prefill, params, list(range(20)), list(range(20)), cache)
    assert wait_until(lambda: torch.equal(cache[:4], prefill.cache[10:14]))
    prefill.pins.cancel("c")  # the prefill was aborted: its other blocks will never be computed
    # Any of the ways the cancel meets the read: short streams, a broken transfer, or a stream whose
    # hello lands after the cancel refused (its ticket went with the pin; a loaded machine's race).
    with pytest.raises(side_channel.SideChannelError,
                       match="without 16 of its 20 blocks|data transfer failed|refused the data connection"):
        read.result()
    read.stop()
    assert prefill.tcp.data.wait_idle(10) and tcp_stream.receive_pool(False).in_use == 0
    assert [rid for rid, _, _ in prefill.pins.collect()] == ["c"]  # no read holds it: freed


def test_a_stopped_stream_read_ends_on_both_sides_while_the_prefill_runs(prefill, small_chunks):
    """The decode request was aborted mid hand-off: stop() returns once its streams ended, and
    the prefill side's senders, waiting for the next chunk, see the hang-up and let the pin go."""
    params = streamed_pin(prefill, "a", list(range(10, 30)), ready=3)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(prefill, params, list(range(20)), list(range(20)), cache)
    assert wait_until(lambda: torch.equal(cache[:3], prefill.cache[10:13]))
    read.stop()
    with pytest.raises(side_channel.SideChannelError):
        read.result()
    assert tcp_stream.receive_pool(False).in_use == 0
    assert prefill.tcp.data.wait_idle(10)  # the pin still runs: the senders left on the hang-up
    assert prefill.pins.release("a", params["transfer_token"])
    assert [rid for rid, _, _ in prefill.pins.collect()] == ["a"]


def test_a_stream_read_of_a_prefill_that_stops_computing_times_out(prefill, small_chunks):
    """The reader's bound is per piece (its stall timeout), so a prefill that stops computing
    fails the read; both sides then hold nothing."""
    params = streamed_pin(prefill, "t", list(range(10, 30)), ready=3)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    # 2 s: the three computed blocks must land before the stall bound fires, also on a loaded
    # machine (0.5 s once timed out before the first piece arrived, leaving them unread).
    read = start_stream_read(prefill, params, list(range(20)), list(range(20)), cache, stall_s=2.0)
    with pytest.raises(side_channel.PeerTimeout):
        read.result()
    read.stop()
    assert torch.equal(cache[:3], prefill.cache[10:13])
    assert prefill.tcp.data.wait_idle(10) and tcp_stream.receive_pool(False).in_use == 0
    assert prefill.pins.release("t", params["transfer_token"])


def test_a_stream_read_from_a_prefill_worker_without_them_waits_and_reads_plainly(prefill, small_chunks,
                                                                                  monkeypatch):
    """A prefill worker of an earlier release ignores `stream`: the read is deferred until every
    block is computed and then served unframed, which the reader follows (the same bytes)."""
    prefill.wrap_reads(monkeypatch, lambda handle, body: handle({k: v for k, v in body.items() if k != "stream"}))
    params = streamed_pin(prefill, "old", list(range(10, 30)), ready=3)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(prefill, params, list(range(20)), list(range(20)), cache)
    prefill.pins.advance("old", 12)
    prefill.pins.finish("old", first_token_id=1)
    assert read.result() == 20 * BLOCK_BYTES
    read.stop()
    assert torch.equal(cache[:20], prefill.cache[10:30])
    prefill.pins.release("old", params["transfer_token"])


def test_a_stream_read_must_ask_for_ascending_blocks(prefill):
    params = streamed_pin(prefill, "o", list(range(10, 30)), ready=20)
    with pytest.raises(side_channel.SideChannelError, match="ascending"):
        side_channel.call("127.0.0.1", prefill.port, "read",
                          {"request_id": "o", "token": params["transfer_token"], "indices": [3, 2],
                           "prompt_digest": DIGEST, "data": True, "streams": 1, "stream": True, "keep": True}, 5, AUTH,
                          ENGINE)
    assert prefill.pins.collect() == []  # refused before any transfer: the pin is still there
    assert prefill.pins.release("o", params["transfer_token"])


def test_the_reader_holds_only_bounded_buffers_whatever_the_pull_size(prefill, monkeypatch):
    """Decode side: a 90-block pull over 2 streams of 2-block chunks takes 2 buffers per
    stream from its pool while it runs, and gives all of them back."""
    monkeypatch.setattr(tcp_stream, "CHUNK_BYTES", 2 * BLOCK_BYTES)
    monkeypatch.setattr(tcp_transport, "STREAMS", 2)
    pool = tcp_stream.receive_pool(False)
    peak = []
    take = pool.take

    def watched(size, count, timeout_s):
        bufs = take(size, count, timeout_s)
        peak.append(pool.in_use)
        return bufs

    monkeypatch.setattr(pool, "take", watched)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    pull(prefill, prefill.pin("big", list(range(90))), list(range(90)), list(range(90)), cache)
    assert torch.equal(cache[:90], prefill.cache[:90])
    assert peak == [2 * 2 * 2 * BLOCK_BYTES]  # 2 streams x 2 buffers x a 2-block chunk, not 90 blocks
    assert pool.in_use == 0


def stalled_reader(prefill: Prefill, rid: str):
    """A pin of 512 blocks (32 MiB: more than loopback buffers take), granted, its one stream
    claimed by a reader with a 4 KiB window that never reads: (socket, the server's answer)."""
    grant = prefill.grant(prefill.pin(rid, list(range(512))), list(range(512)))
    return connect(prefill, grant, slow=True)


def test_a_reader_that_stops_draining_holds_only_its_bounded_buffers(big_prefill, monkeypatch):
    """Prefill side: a reader that claims a stream and never reads ties up that stream's two
    chunk buffers, not a copy of the transfer, and the side channel serves others meanwhile."""
    monkeypatch.setattr(tcp_stream, "CHUNK_BYTES", 4 * BLOCK_BYTES)
    monkeypatch.setattr(tcp_stream, "SEND_TIMEOUT_S", 60.0)  # the stall outlasts this test's checks
    prefill = big_prefill
    sock, answer = stalled_reader(prefill, "stalled")
    with contextlib.closing(sock):
        assert answer == tcp_stream.ACCEPTED
        data = prefill.tcp.data
        assert wait_until(lambda: data.pool.in_use > 0)  # its sender runs, blocked on our window
        assert data.pool.in_use == 2 * 4 * BLOCK_BYTES  # two 4-block chunks, of a 512-block transfer
        assert data.in_flight == 1
        reply, _ = side_channel.call("127.0.0.1", prefill.port, "describe", {}, 5, AUTH, ENGINE)
        assert reply == {"ok": True}  # the side channel is not the sender
        assert prefill.sent < 512 * BLOCK_BYTES


def test_a_reader_that_stops_draining_loses_its_stream_and_then_holds_nothing(big_prefill, monkeypatch):
    """Once a chunk is not taken within SEND_TIMEOUT_S the stream ends: the pin is released
    (a read is the release) and every buffer and count is back, the reader's socket still open."""
    monkeypatch.setattr(tcp_stream, "CHUNK_BYTES", 4 * BLOCK_BYTES)
    monkeypatch.setattr(tcp_stream, "SEND_TIMEOUT_S", 0.5)
    prefill = big_prefill
    sock, answer = stalled_reader(prefill, "stalled")
    with contextlib.closing(sock):
        assert answer == tcp_stream.ACCEPTED
        data = prefill.tcp.data
        assert data.wait_idle(15)
        assert data.in_flight == 0 and data.pool.in_use == 0
        assert [rid for rid, _, _ in prefill.pins.collect()] == ["stalled"]
        assert prefill.sent < 512 * BLOCK_BYTES


def test_a_reader_that_hangs_up_mid_transfer_frees_everything(big_prefill, small_chunks, monkeypatch):
    """A failed stream fails the transfer: its stream the reader never connected ends with it,
    not with its ticket (CLAIM_S, here longer than the waits below)."""
    monkeypatch.setattr(tcp_stream, "CLAIM_S", 300.0)
    prefill = big_prefill
    params = prefill.pin("gone", list(range(512)))
    grant = prefill.grant(params, list(range(512)), streams=3)
    socks = [connect(prefill, grant, i, slow=True) for i in range(2)]  # the third stream never connects
    assert all(answer == tcp_stream.ACCEPTED for _, answer in socks)
    first = bytearray(BLOCK_BYTES)
    tcp_stream._recv_exact(socks[0][0], memoryview(first))
    assert bytes(first) == prefill.cache[0].numpy().tobytes()
    for sock, _ in socks:
        sock.close()
    data = prefill.tcp.data
    assert data.wait_idle(15)  # the unclaimed stream ends with the failed ones
    assert data.in_flight == 0 and data.pool.in_use == 0
    assert prefill.sent < 512 * BLOCK_BYTES
    assert [rid for rid, _, _ in prefill.pins.collect()] == ["gone"]
    assert len(prefill.pins) == 0


def test_a_kept_read_whose_reader_dies_holds_the_pin_only_while_it_runs(small_chunks):
    """A read that keeps its pin (a streamed hand-off's chunk, a tensor-parallel rank's shard)
    whose reader is killed mid-transfer: the pin outlives its TTL while the transfer runs (its
    blocks are being copied), and once the transfer ended it is freed at its TTL, not held by a
    lease on the dead reader's behalf (a 60 s lease left pins behind in the load-with-faults test)."""
    prefill = Prefill(num_blocks=512, ttl=0.5)
    try:
        params = prefill.pin("killed", list(range(512)))
        grant = prefill.grant(params, list(range(512)), keep=True)
        sock, answer = connect(prefill, grant, slow=True)
        assert answer == tcp_stream.ACCEPTED
        first = bytearray(BLOCK_BYTES)
        tcp_stream._recv_exact(sock, memoryview(first))
        threading.Event().wait(0.6)  # past the TTL, the transfer still running (the window is full)
        assert prefill.tcp.data.in_flight == 1
        assert prefill.pins.collect() == []  # its blocks are on the wire
        sock.close()
        assert prefill.tcp.data.wait_idle(15)
        freed = prefill.pins.collect()  # the TTL has passed and nothing holds the pin now
        assert freed == [("killed", list(range(512)), True)]
    finally:
        prefill.close()


def test_a_prefill_that_hangs_up_fails_the_pull_and_frees_the_readers_buffers(monkeypatch):
    """Decode side: the data connection closes mid-chunk (the prefill worker died): the pull
    raises a side-channel error, its threads are joined and its buffers are back."""
    listener = socket.create_server(("127.0.0.1", 0))
    plan = {"nblocks": 12, "block_bytes": BLOCK_BYTES, "chunk_blocks": 2, "streams": 2}

    def grant(body):
        return {"prompt_digest": body["prompt_digest"], "ticket": "ab" * 16, "data_port": listener.getsockname()[1],
                **plan}, []

    def serve():
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(tcp_stream.HELLO.size)
            conn.sendall(tcp_stream.ACCEPTED + b"x" * (BLOCK_BYTES // 2))
            conn.close()

    port = free_port()
    channel = side_channel.SideChannelServer("127.0.0.1", port, {"read": grant}, AUTH,
                                             identity=side_channel.destination(ENGINE, "127.0.0.1", port))
    channel.start()
    dying = threading.Thread(target=serve, daemon=True)
    dying.start()
    try:
        params = {"remote_request_id": "r", "transfer_token": "t", "remote_engine_id": ENGINE}
        cache = torch.zeros(16, BLOCK_BYTES, dtype=torch.uint8)
        with pytest.raises(side_channel.SideChannelError, match="closed the data connection"):
            tcp_pull("127.0.0.1", port, as_params(params), list(range(12)), list(range(12)), cache, 10, AUTH, DIGEST)
        assert tcp_stream.receive_pool(False).in_use == 0
        dying.join(10)
    finally:
        channel.stop()
        listener.close()


def test_a_data_connection_needs_a_live_ticket_and_the_secret(prefill):
    params = prefill.pin("t", list(range(8)))
    grant = prefill.grant(params, list(range(8)))
    ticket = bytes.fromhex(grant["ticket"])
    for kw in ({"auth": SideChannelAuth("another secret")}, {"auth": SideChannelAuth(None)},
               {"ticket": bytes(16)}, {"index": 1}):
        sock, answer = connect(prefill, grant, **kw)
        sock.close()
        assert answer == tcp_stream.REFUSED, kw
    sock, answer = connect(prefill, grant)  # the genuine one, still unclaimed
    with contextlib.closing(sock):
        assert answer == tcp_stream.ACCEPTED
        data = bytearray(8 * BLOCK_BYTES)
        tcp_stream._recv_exact(sock, memoryview(data))
        assert bytes(data) == prefill.cache[:8].numpy().tobytes()
    again, answer = connect(prefill, grant, ticket=ticket)  # a ticket opens its stream once
    again.close()
    assert answer in (tcp_stream.REFUSED, b"")
    # No ticket without an authenticated read: a wrong transfer token gets an error, not a grant.
    with pytest.raises(side_channel.SideChannelError, match="transfer token"):
        prefill.grant({**prefill.pin("u", [1]), "transfer_token": "forged"}, [0])
    assert prefill.tcp.data.wait_idle(10)


def test_a_hello_in_pieces_is_accepted_once_whole_within_its_deadline(prefill):
    """The listener keeps what each read brings: a genuine hello split over several sends (a
    slow link, a small window) claims its stream once whole."""
    grant = prefill.grant(prefill.pin("pieces", list(range(4))), list(range(4)))
    ticket = bytes.fromhex(grant["ticket"])
    hello = tcp_stream.HELLO.pack(tcp_stream.MAGIC, ticket, 0, grant["streams"], AUTH.sign_data(ticket, 0))
    with socket.create_connection(("127.0.0.1", grant["data_port"]), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for part in (hello[:1], hello[1:30], hello[30:]):
            sock.sendall(part)
            threading.Event().wait(0.1)  # separate segments, each read on its own
        assert sock.recv(1) == tcp_stream.ACCEPTED
        data = bytearray(4 * BLOCK_BYTES)
        tcp_stream._recv_exact(sock, memoryview(data))
        assert bytes(data) == prefill.cache[:4].numpy().tobytes()
    assert prefill.tcp.data.wait_idle(10)


def opened_data_port(p: Prefill) -> int:
    """The data port opens with a prefill worker's first data read: one genuine pull opens it."""
    pull(p, p.pin("first", [0, 1]), [0, 1], [0, 1], torch.zeros(2, BLOCK_BYTES, dtype=torch.uint8))
    return p.tcp.data.port


def test_connections_trickling_a_hello_cannot_keep_a_reader_out_and_end_at_their_deadline():
    """80 connections from 10 addresses, each sending its hello a byte every 0.5 s (the whole
    would take 30 s): 64 fill the handshake table, 16 are displaced at once; a genuine pull lands
    meanwhile (its connection displaces a trickler and authenticates), and every trickler is
    closed once its whole-hello deadline passed. Before, each of 64 slots went at accept and a
    byte within 5 s of the last kept it: every pull was refused for 30 s (minutes, at 4 s a byte)."""
    config = DataListenerConfig(hello_timeout_s=4.0)
    p = Prefill(data_listener=config)
    try:
        with Flood("127.0.0.1", opened_data_port(p), addresses=10, per_address=8, trickle_s=0.5) as flood:
            assert flood.wait_closed(80 - config.max_handshakes)
            assert len(flood.open_ones()) == config.max_handshakes  # the table is full
            cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
            src = list(range(20, 40))
            assert pull(p, p.pin("genuine", src), list(range(20)), list(range(20)), cache) == 20 * BLOCK_BYTES
            assert torch.equal(cache[:20], p.cache[20:40])
            assert flood.wait_closed(80, timeout=config.hello_timeout_s + 10)
        assert wait_until(lambda: p.tcp.data.listener.handshakes == 0)
        assert p.tcp.data.wait_idle(10)
    finally:
        p.close()


def test_one_address_holds_at_most_its_share_of_the_data_port(monkeypatch):
    """Per source address, long before any deadline: of 20 silent connections from one address
    the last 4 (its handshake share) stay and the 16 before them are closed at once; an address
    whose 4 connections (its bound) are claimed streams, their reader not draining, gets a new
    connection closed at once. A genuine pull from another address lands meanwhile."""
    monkeypatch.setattr(tcp_stream, "CHUNK_BYTES", 4 * BLOCK_BYTES)
    monkeypatch.setattr(tcp_stream, "SEND_TIMEOUT_S", 60.0)  # the stalled streams outlast this test
    config = DataListenerConfig(hello_timeout_s=60.0, max_handshakes_per_peer=4, max_connections_per_peer=4)
    p = Prefill(num_blocks=512, data_listener=config)
    stalled = []
    try:
        port = opened_data_port(p)
        listener = p.tcp.data.listener
        with Flood("127.0.0.1", port, addresses=1, per_address=20, trickle_s=None) as silent:
            assert silent.wait_closed(16)
            assert silent.open_ones() == [16, 17, 18, 19] and listener.connections(source(0)) == 4
            grant = p.grant(p.pin("stalled", list(range(512))), list(range(512)), streams=4)
            assert grant["streams"] == 4
            stalled = [connect(p, grant, i, slow=True, source_address=source(1)) for i in range(4)]
            assert [answer for _, answer in stalled] == [tcp_stream.ACCEPTED] * 4
            with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source(1), 0)) as extra:
                assert wait_until(lambda: is_closed(extra))
            cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
            assert pull(p, p.pin("genuine", list(range(40, 60))), list(range(20)), list(range(20)), cache) \
                == 20 * BLOCK_BYTES
            assert torch.equal(cache[:20], p.cache[40:60])
            assert silent.open_ones() == [16, 17, 18, 19]  # still within their deadline
        for sock, _ in stalled:
            sock.close()
        assert p.tcp.data.wait_idle(15)
        assert wait_until(lambda: listener.handshakes == 0 and listener.connections(source(1)) == 0)
    finally:
        for sock, _ in stalled:
            sock.close()
        p.close()


@pytest.mark.skipif(not nixl_available(), reason="needs nixl")
def test_a_nixl_prefill_worker_serves_tcp_reads(small_chunks):
    """A decode worker without RDMA (`--kv-transfer tcp`) pulls from a NIXL prefill worker: the
    real KVConnector serves the read over its data connections whatever its own transport."""
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.kv.connector import KVConnector

    port = free_port()
    cache = torch.randint(0, 256, (64, 1, 2, 1, 1, BLOCK_BYTES // 2), dtype=torch.uint8).view(torch.bfloat16)
    config = EngineConfig(role="prefill", kv_transfer="nixl", kv_host="127.0.0.1", kv_port=port, kv_secret=SECRET)
    c = KVConnector(config, cache, "nixl-prefill", KVLayout(1, 1, BLOCK_BYTES // 4, "bfloat16", 1))
    c.start_server()
    try:
        src = [3, 4, 5, 20, 21, 40, 41, 42, 43, 9]
        params = c.pin("r", src, len(src), 0, DIGEST)
        assert params.transport == "nixl"
        mine = torch.zeros(64, BLOCK_BYTES, dtype=torch.uint8)
        n = tcp_pull("127.0.0.1", port, params, list(range(len(src))), list(range(10)), mine,
                     10, AUTH, DIGEST)
        assert n == len(src) * BLOCK_BYTES and torch.equal(mine[:10], c.blocks[src])
        assert c.base.server.data.wait_idle(10)
        assert [rid for rid, _, _ in c.pins.collect()] == ["r"]  # the read released the pin
    finally:
        c.shutdown()


def test_a_layered_progress_reply_is_checked_before_any_layer_is_read():
    """A progress reply's `partial` (the running step's blocks and layers written) decides which
    bytes a layered reader READs: a peer's malformed one is refused as the reply, never read
    from; a well-formed one comes through."""
    replies = iter([[4, 2, 8], [4, 8, 8], [4, 0, 8], [1, 2, 8], "4,2,8", [4, 2]])

    def progress(body):
        assert body["layers"] == 3  # the reader said what it holds
        return {"engine_id": ENGINE, "prompt_digest": body["prompt_digest"], "ready": 2, "state": "running",
                "first_token_id": None, "last": False, "partial": next(replies)}, []

    port = free_port()
    channel = side_channel.SideChannelServer("127.0.0.1", port, {"progress": progress}, AUTH,
                                             identity=side_channel.destination(ENGINE, "127.0.0.1", port))
    channel.start()
    try:
        params = KVTransferParams(remote_engine_id=ENGINE, remote_host="127.0.0.1", remote_port=port,
                                  remote_request_id="r", remote_block_ids=tuple(range(8)), num_prompt_tokens=32,
                                  first_token_id=None, transfer_token="t", kv_layout=KVLayout(8, 1, 8, "bf16", 4))
        ask = lambda: side_channel.progress("127.0.0.1", port, params, DIGEST, 2, 10, AUTH, layers=3)  # noqa: E731
        assert ask().partial == [4, 2, 8]
        for _ in range(5):  # every layer written, none, a step ending before the ready blocks, not a list, short
            with pytest.raises(side_channel.SideChannelError, match="malformed partial"):
                ask()
    finally:
        channel.stop()
