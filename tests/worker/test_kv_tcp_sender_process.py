"""The TCP senders in a process of their own (--kv-tcp-io process): the same reads as the
in-process senders (tests/worker/test_kv_tcp_stream.py), served by a real spawned child that
maps the cache through shared memory and follows the engine's pins and layer clocks; the
engine's process runs no sender thread; a child that dies ends its reads cleanly and later
reads are served in-process."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from pdserve.worker.kv import side_channel, tcp_stream
from pdserve.worker.kv.layer_clock import LayerClock
from pdserve.worker.kv.tcp_sender_process import SenderProcess
from tests.worker.test_kv_tcp_stream import (small_chunks,  # noqa: F401  a fixture
                                             BLOCK_BYTES, LAYERS, Prefill, layer_slices, pull, start_stream_read,
                                             stream_read_following_the_pin, streamed_pin, wait_until)


@pytest.fixture
def prefill(small_chunks):  # the chunks set first: a senders' child takes tcp_stream's settings at start
    p = Prefill(num_layers=LAYERS, senders="process")
    yield p
    p.close()


def sender_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("kv-tcp-send", "kv-tcp-accept")]


def test_a_chunked_pull_is_served_by_the_child_with_the_same_bytes(prefill):
    assert isinstance(prefill.tcp.data, SenderProcess) and prefill.tcp.data.pid != os.getpid()
    src = [5, 6, 7, 30, 31, 2, 40, 41, 42, 43, 44, 60, 11, 12, 13, 14, 70, 71, 90, 3]  # runs and strays
    params = prefill.pin("p", src)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    assert pull(prefill, params, list(range(20)), list(range(20)), cache) == 20 * BLOCK_BYTES
    assert torch.equal(cache[:20], prefill.cache[src])
    assert sender_threads() == [], "a sender thread ran in the engine's process"
    assert wait_until(lambda: prefill.sent == 20 * BLOCK_BYTES)  # the child's count reaches the metric
    assert prefill.tcp.data.wait_idle(10) and prefill.tcp.data.in_flight == 0
    assert [rid for rid, _, _ in prefill.pins.collect()] == ["p"]  # a plain read is the release


def test_a_stream_read_follows_the_engines_pin_across_processes(prefill):
    """Each block leaves the child once the engine's pin says it is computed, never before."""
    params = stream_read_following_the_pin(prefill, "s")
    assert prefill.tcp.data.wait_idle(10)
    assert wait_until(lambda: prefill.pins.snapshot("s") is not None and not prefill.tcp.data._interest)
    assert prefill.pins.collect() == []  # kept: the reader releases it
    assert prefill.pins.release("s", params["transfer_token"])
    assert [rid for rid, _, _ in prefill.pins.collect()] == ["s"]  # the child closed its read


def test_a_layered_stream_read_follows_the_engines_layer_clocks_across_processes(prefill):
    """The clocks' counts reach the child through the shared ring, with no message: the first
    step's blocks leave once its forward is through, the last step's layer by layer."""
    p = prefill
    params = streamed_pin(p, "l", list(range(40, 60)), ready=2)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(p, params, list(range(20)), list(range(20)), cache)
    first = LayerClock(LAYERS, torch.device("cpu"), p.tcp.ring)
    last = LayerClock(LAYERS, torch.device("cpu"), p.tcp.ring)
    p.pins.computing("l", 12, first)
    p.pins.computing("l", 20, last)
    assert wait_until(lambda: torch.equal(cache[:2], p.cache[40:42]))
    for layer in range(LAYERS - 1):
        first.after_layer(layer)
    first.after_layer(LAYERS - 1)
    assert wait_until(lambda: torch.equal(cache[2:12], p.cache[42:52])), "the first step's blocks"
    assert not cache[12:20].any(), "the last step's blocks moved before it wrote a layer"
    for layer in range(LAYERS):
        last.after_layer(layer)
        assert wait_until(lambda: torch.equal(layer_slices(cache, range(12, 20), 0, layer + 1),
                                              layer_slices(p.cache, range(52, 60), 0, layer + 1))), f"layer {layer}"
        assert not layer_slices(cache, range(12, 20), layer + 1, LAYERS).any(), f"a layer past {layer} moved"
    p.pins.advance("l", 12)
    p.pins.finish("l", first_token_id=7)
    assert read.result() == 20 * BLOCK_BYTES
    read.stop()
    assert torch.equal(cache[:20], p.cache[40:60])
    assert sender_threads() == []
    assert p.pins.release("l", params["transfer_token"])


def test_a_cancelled_prefill_ends_the_childs_read_and_frees_the_pin(prefill):
    params = streamed_pin(prefill, "c", list(range(10, 30)), ready=4)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(prefill, params, list(range(20)), list(range(20)), cache)
    assert wait_until(lambda: torch.equal(cache[:4], prefill.cache[10:14]))
    prefill.pins.cancel("c")  # the snapshot saying so reaches the child, whose senders stop
    # The read fails whichever way the cancel meets it: the streams end short, a stream's transfer
    # breaks off, or (several streams) one whose hello arrives after the cancel is refused, its
    # ticket gone with the pin: on a loaded machine that stream may still be connecting here.
    with pytest.raises(side_channel.SideChannelError,
                       match="without 16 of its 20 blocks|data transfer failed|refused the data connection"):
        read.result()
    read.stop()
    assert prefill.tcp.data.wait_idle(10)
    assert wait_until(lambda: [rid for rid, _, _ in prefill.pins.collect()] == ["c"])  # no read holds it


def test_a_child_that_dies_mid_read_ends_its_reads_and_later_reads_are_served_here(prefill):
    """SIGKILL the child while a stream read waits on the prefill: the reader fails, the engine
    closes the read the child held (the pin is freed once released), and the next read is
    served by senders in the engine's process."""
    params = streamed_pin(prefill, "k", list(range(10, 30)), ready=3)
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    read = start_stream_read(prefill, params, list(range(20)), list(range(20)), cache)
    assert wait_until(lambda: torch.equal(cache[:3], prefill.cache[10:13]))
    os.kill(prefill.tcp.data.pid, signal.SIGKILL)
    with pytest.raises(side_channel.SideChannelError):
        read.result()
    read.stop()
    assert wait_until(lambda: prefill.tcp.data.gone)
    assert prefill.pins.release("k", params["transfer_token"])
    # `gone` is set before the link's on_gone closes the child's reads (child_link.py): wait for it.
    assert wait_until(lambda: [rid for rid, _, _ in prefill.pins.collect()] == ["k"]), \
        "the dead child's read still holds the pin"

    params = prefill.pin("after", [50, 51, 52, 53])
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    assert pull(prefill, params, list(range(4)), list(range(4)), cache) == 4 * BLOCK_BYTES
    assert torch.equal(cache[:4], prefill.cache[50:54])
    assert isinstance(prefill.tcp.data, tcp_stream.DataServer)


def test_a_cpu_cache_larger_than_dev_shm_is_refused_naming_the_flag(tmp_path):
    """A tmpfs past its size kills whoever touches the page (SIGBUS): the worker refuses at start."""
    from pdserve.protocol.flags import ConfigError
    from pdserve.worker.kv.connector import _check_shm

    _check_shm(1 << 20, str(tmp_path))  # room: no error
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(ConfigError, match="--kv-tcp-io.*free.*--kv-tcp-io thread"):
        _check_shm(free + (1 << 30), str(tmp_path))
    with pytest.raises(ConfigError, match="--kv-tcp-io.*not usable"):
        _check_shm(1, str(tmp_path / "missing"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: IPC of the VRAM caches, interprocess layer events")
def test_on_cuda_the_children_map_vram_and_wait_for_each_layers_event(small_chunks):
    """Both children on one card: the senders' child maps the prefill cache and sends each layer
    only once its interprocess event completed; the receivers' child lands it in the decode
    cache. Each layer's write runs behind ~30 ms of GPU sleep, so a child that read on the
    launch's count alone, not the event, would send the old bytes (each layer goes once)."""
    from pdserve.worker.kv.tcp_receiver_process import ReceiverProcess
    from pdserve.worker.kv.tcp_transport import StreamedRead
    from tests.worker.test_kv_tcp_stream import AUTH, DIGEST, as_params

    p = Prefill(num_layers=LAYERS, senders="process", device="cuda")
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    receiver = ReceiverProcess(cache, AUTH)
    try:
        src = list(range(40, 50))
        params = streamed_pin(p, "g", src, ready=0)
        read = StreamedRead("127.0.0.1", p.port, as_params(params), list(range(10)), list(range(10)), cache, 30,
                            AUTH, DIGEST, receiver)
        clock = LayerClock(LAYERS, torch.device("cuda"), p.tcp.ring)
        p.pins.computing("g", 10, clock)
        layers = p.cache.view(p.cache.shape[0], LAYERS, -1)
        for layer in range(LAYERS):
            torch.cuda._sleep(50_000_000)
            layers[src, layer] = layer + 1  # the forward writes this layer of the blocks
            clock.after_layer(layer)
        p.pins.finish("g", first_token_id=1)
        assert read.result() == 10 * BLOCK_BYTES
        read.stop()
        got = cache[:10].view(10, LAYERS, -1)
        for layer in range(LAYERS):
            assert bool((got[:, layer] == layer + 1).all()), f"layer {layer} left before its event"
        assert p.pins.release("g", params["transfer_token"])
    finally:
        receiver.close()
        p.close()
