"""A client's hang-up told by pdserve's HTTP protocol itself (protocol/disconnect.py
`LostConnection`, set by http_limits.py): on a real uvicorn server and real sockets, a client that
leaves before the answer starts, mid-stream or mid-body ends its request's work at once, with no
listener task reading `receive`; without the protocol's object (another server) a listener does."""

from __future__ import annotations

import asyncio
import queue
import socket
import time

import pytest
from starlette.requests import Request
from starlette.responses import Response

from pdserve.protocol.body import read_body
from pdserve.protocol.disconnect import (LOST_CONNECTION, ClientGone, DisconnectWatch, LostConnection,
                                         unless_disconnected, wait_for_disconnect)
from pdserve.protocol.http_limits import ClientLimits
from pdserve.protocol.sse import SSEResponse
from tests.protocol.server_thread import serving

seen: queue.Queue = queue.Queue()


def _listeners() -> int:
    """Tasks reading `receive` for a hang-up: what the protocol's object makes unnecessary."""
    return sum(1 for t in asyncio.all_tasks() if t.get_coro().__qualname__ == wait_for_disconnect.__qualname__)


async def _stream(ended: list):
    try:
        yield b"data: 1\n\n"
        await asyncio.sleep(60)  # a worker that goes quiet: only the hang-up ends this
        yield b"data: 2\n\n"
    finally:
        ended.append("closed")


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    request = Request(scope, receive)
    seen.put(("watched", isinstance(scope.get(LOST_CONNECTION), LostConnection)))
    path = scope["path"]
    if path == "/wait":
        async def work():
            seen.put(("listeners", _listeners()))
            await asyncio.sleep(60)
        try:
            await unless_disconnected(request, work())
        except ClientGone:
            seen.put(("gone", "before the answer"))
        return
    if path == "/stream":
        ended: list = []

        async def events():
            async for event in _stream(ended):
                seen.put(("listeners", _listeners()))
                yield event
        response = SSEResponse(events(), on_close=lambda: seen.put(("gone", "mid-stream " + ",".join(ended))))
        await response(scope, receive, send)
        return
    if path == "/upload":
        try:
            body = await read_body(request, 1 << 20, 60)
        except ClientGone:
            seen.put(("gone", "mid-body"))
            return
        await Response(body)(scope, receive, send)


@pytest.fixture(scope="module")
def port():
    with serving(app, **ClientLimits().uvicorn_options(hold_head=True)) as port:
        yield port


def _next(kind: str) -> object:
    while True:
        got, value = seen.get(timeout=10)  # the hang-up is told at once; 10 s only bounds a failure
        if got == kind:
            return value


def _drain() -> None:
    while not seen.empty():
        seen.get_nowait()


def test_a_client_gone_before_the_answer_ends_the_work_with_no_listener_task(port):
    _drain()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        assert _next("watched") is True
        assert _next("listeners") == 0
    assert _next("gone") == "before the answer"


def test_a_client_gone_mid_stream_closes_the_stream_with_no_listener_task(port):
    _drain()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert _next("listeners") == 0
        assert b"data: 1" in s.recv(4096)
    assert _next("gone") == "mid-stream closed"


def test_a_client_gone_mid_body_is_gone_not_an_error(port):
    _drain()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\":")
        assert _next("watched") is True
    assert _next("gone") == "mid-body"


def test_a_kept_alive_connection_answers_after_a_watched_request(port):
    """The watch of one request does not outlive it: the next request on the connection is
    answered, and closing the connection afterwards tells nobody."""
    _drain()
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(2):
            s.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
            data = b""
            while not data.endswith(b"ok"):
                data += s.recv(4096)
            assert data.startswith(b"HTTP/1.1 200")
    time.sleep(0.2)
    assert ("gone", "mid-body") not in list(seen.queue)


def test_a_connection_already_lost_is_told_on_the_next_turn():
    async def main():
        lost = LostConnection()
        lost.connection_lost()
        told = []
        watch = DisconnectWatch({LOST_CONNECTION: lost}, None, lambda: told.append(1))
        assert told == []  # as a listener task would: not inside the caller's own step
        await asyncio.sleep(0)
        assert told == [1]
        watch.close()

    asyncio.run(main())


def test_a_closed_watch_is_not_told_and_gives_the_previous_one_back():
    async def main():
        lost, told = LostConnection(), []
        outer = DisconnectWatch({LOST_CONNECTION: lost}, None, lambda: told.append("outer"))
        inner = DisconnectWatch({LOST_CONNECTION: lost}, None, lambda: told.append("inner"))
        inner.close()
        lost.connection_lost()
        outer.close()
        assert told == ["outer"]

    asyncio.run(main())


def test_without_the_protocols_object_a_listener_reads_receive():
    async def main():
        messages = asyncio.Queue()

        async def receive():
            return await messages.get()

        told = []
        watch = DisconnectWatch({}, receive, lambda: told.append(1))
        await asyncio.sleep(0)
        assert _listeners() == 1
        await messages.put({"type": "http.disconnect"})
        for _ in range(5):
            await asyncio.sleep(0)
        assert told == [1]
        watch.close()

    asyncio.run(main())
