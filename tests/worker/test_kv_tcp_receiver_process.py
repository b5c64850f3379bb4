"""The TCP receivers in a process of their own (--kv-tcp-io process, decode side): a real
spawned child receives the data streams into the engine's cache (shared memory here), the
engine's pull thread only asks and waits; a cancel stops the child's read; a child that dies
fails its read and later pulls are received in the engine's process."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pdserve.worker.kv import side_channel, tcp_stream, tcp_transport
from pdserve.worker.kv.tcp_receiver_process import ReceiverProcess
from tests.worker.test_kv_tcp_stream import (small_chunks,  # noqa: F401  a fixture
                                             AUTH, BLOCK_BYTES, DIGEST, Prefill, as_params, streamed_pin,
                                             wait_until)


@pytest.fixture
def prefill(small_chunks):  # 3-block chunks, 3 streams (set before the prefill side starts)
    p = Prefill()
    yield p
    p.close()


@pytest.fixture
def receiver():
    cache = torch.zeros(96, BLOCK_BYTES, dtype=torch.uint8)
    r = ReceiverProcess(cache, AUTH)
    yield r
    r.close()


@pytest.fixture
def no_receive_here(monkeypatch):
    """The engine's process must not run tcp_stream.receive: the child does."""
    def refuse(*args, **kw):
        raise AssertionError("received in the engine's process")
    monkeypatch.setattr(tcp_stream, "receive", refuse)


def pull(p: Prefill, params: dict, n: int, receiver: ReceiverProcess, **kw) -> int:
    return tcp_transport.tcp_pull("127.0.0.1", p.port, as_params(params), list(range(n)), list(range(n)),
                                  receiver.blocks, 10, AUTH, DIGEST, receiver=receiver, **kw)


def test_a_pull_is_received_by_the_child_into_the_engines_cache(prefill, receiver, no_receive_here):
    src = [5, 6, 7, 30, 31, 2, 40, 41, 42, 43, 44, 60, 11, 12, 13, 14, 70, 71, 90, 3]
    assert pull(prefill, prefill.pin("p", src), 20, receiver) == 20 * BLOCK_BYTES
    assert torch.equal(receiver.blocks[:20], prefill.cache[src])  # written when the pull returned
    assert not receiver.blocks[20:].any()
    assert receiver.pid != os.getpid()


def test_a_stopped_stream_read_ends_the_childs_streams(prefill, receiver, no_receive_here):
    params = streamed_pin(prefill, "a", list(range(10, 30)), ready=3)
    read = tcp_transport.StreamedRead("127.0.0.1", prefill.port, as_params(params), list(range(20)),
                                      list(range(20)), receiver.blocks, 10, AUTH, DIGEST, receiver)
    assert wait_until(lambda: torch.equal(receiver.blocks[:3], prefill.cache[10:13]))
    read.stop()  # the request was aborted: the child's streams are shut
    with pytest.raises(side_channel.SideChannelError):
        read.result()
    assert prefill.tcp.data.wait_idle(10)  # the prefill side saw the hang-up
    assert prefill.pins.release("a", params["transfer_token"])


def test_a_receiver_that_dies_fails_its_read_and_later_pulls_are_received_here(prefill, receiver):
    params = streamed_pin(prefill, "k", list(range(10, 30)), ready=3)
    read = tcp_transport.StreamedRead("127.0.0.1", prefill.port, as_params(params), list(range(20)),
                                      list(range(20)), receiver.blocks, 10, AUTH, DIGEST, receiver)
    assert wait_until(lambda: torch.equal(receiver.blocks[:3], prefill.cache[10:13]))
    os.kill(receiver.pid, signal.SIGKILL)
    with pytest.raises(side_channel.SideChannelError, match="gone"):
        read.result()
    read.stop()
    assert receiver.gone
    assert pull(prefill, prefill.pin("after", [50, 51, 52, 53]), 4, receiver) == 4 * BLOCK_BYTES
    assert torch.equal(receiver.blocks[:4], prefill.cache[50:54])
    assert prefill.pins.release("k", params["transfer_token"])
