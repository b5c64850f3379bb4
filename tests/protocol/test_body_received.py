"""A body already whole when its app starts is read with no deadline armed (http_limits.py
`BODY_RECEIVED`, protocol/body.py); one still arriving keeps its deadline (408). Real uvicorn server,
real sockets."""

from __future__ import annotations

import queue
import socket
import time

import pytest
from starlette.requests import Request
from starlette.responses import Response

from pdserve.protocol.body import read_body
from pdserve.protocol.errors import APIError
from pdserve.protocol.http_limits import BODY_RECEIVED, ClientLimits
from tests.protocol.server_thread import serving

seen: queue.Queue = queue.Queue()
TIMEOUT_S = 0.5


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    seen.put(bool(scope.get(BODY_RECEIVED)))
    try:
        body = await read_body(Request(scope, receive), 1 << 20, TIMEOUT_S)
        response = Response(body)
    except APIError as e:
        response = e.response()
    await response(scope, receive, send)


@pytest.fixture(scope="module")
def port():
    with serving(app, **ClientLimits().uvicorn_options(hold_head=True)) as port:
        yield port


def _answer(s: socket.socket) -> bytes:
    data = b""
    s.settimeout(10)
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
            data.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0] or 0):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_a_whole_body_is_marked_and_read(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello world")
        answer = _answer(s)
    assert seen.get(timeout=10) is True
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello world")


def test_a_body_in_parts_is_read_whole(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello")
        assert seen.get(timeout=10) is False  # the app started before the rest came
        time.sleep(0.1)
        s.sendall(b" world")
        answer = _answer(s)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello world")


def test_a_body_that_stops_coming_keeps_its_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello")
        assert seen.get(timeout=10) is False
        answer = _answer(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:40]
