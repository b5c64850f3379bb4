"""A server whose responses' heads are held for their bodies' first writes (protocol/held_head.py),
streams sent coalesced (SSEResponse(coalesce=True)): every answer arrives whole and in order on a
real socket, kept-alive, pipelined, to HEAD and to an `Expect: 100-continue` upload."""

from __future__ import annotations

import asyncio
import http.client
import socket

import pytest
from starlette.responses import Response

from pdserve.protocol.http_limits import ClientLimits
from pdserve.protocol.sse import DONE, SSEResponse
from tests.protocol.server_thread import serving


async def _events(late: bool, after_done: bool):
    if late:
        await asyncio.sleep(0.05)  # the head waits for the first event, whatever comes first
    yield b"data: 1\n\n"
    await asyncio.sleep(0)
    yield b"data: 2\n\n" + DONE
    if after_done:
        yield b": after\n\n"


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/upload":
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        response = Response(body, media_type="text/plain")
    elif path.startswith("/stream"):
        response = SSEResponse(_events("late" in path, "after" in path), coalesce=True)
    else:
        response = Response(b"hello", media_type="text/plain")
    await response(scope, receive, send)


@pytest.fixture(scope="module")
def port():
    with serving(app, **ClientLimits().uvicorn_options(hold_head=True)) as port:
        yield port


def test_answers_arrive_whole_on_one_kept_alive_connection(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for path, body in [
        ("/unary", b"hello"),
        ("/stream", b"data: 1\n\ndata: 2\n\n" + DONE),
        ("/stream-late", b"data: 1\n\ndata: 2\n\n" + DONE),
        ("/stream-after", b"data: 1\n\ndata: 2\n\n" + DONE + b": after\n\n"),
        ("/unary", b"hello"),
    ]:
        conn.request("POST" if path != "/unary" else "GET", path)
        r = conn.getresponse()
        assert (r.status, r.read()) == (200, body), path
    conn.request("HEAD", "/unary")
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-length") == "5" and r.read() == b""
    conn.request("GET", "/unary")  # the connection is still in step after a HEAD
    assert conn.getresponse().read() == b"hello"
    conn.close()


def test_pipelined_requests_get_their_answers_in_order(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"GET /unary HTTP/1.1\r\nhost: x\r\n\r\nPOST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
            b"GET /unary HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 3
    first, second, third = (data.index(b"hello"), data.index(b"data: 1"), data.rindex(b"hello"))
    assert first < second < third and data.endswith(b"hello")


def test_an_expect_continue_upload_is_answered(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nexpect: 100-continue\r\n"
            b"connection: close\r\n\r\n"
        )
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")  # not held back for good
        s.sendall(b"abc")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK") and data.endswith(b"\r\n\r\nabc")
