"""A whole answer written to uvicorn's cycle in one go (protocol/whole_answer.py) puts on the wire
the very bytes uvicorn's two `send` calls put there, for every shape it takes (statuses, extra
headers, a connection the client closes, HTTP/1.0, pipelined requests), leaves the connection
in the same state, and refuses what it would not write the same way (HEAD, no length, a
`connection` header of the application's) or a header uvicorn refuses."""

from __future__ import annotations

import gc
import re
import socket
import time

import pytest
from starlette.responses import JSONResponse, Response

from pdserve.protocol.http_limits import ClientLimits
from pdserve.protocol.whole_answer import CYCLE, send_whole, writes_whole
from tests.protocol.server_thread import serving

ANSWERS = {
    "/ok": lambda: Response(b'{"id":"cmpl-1","choices":[]}', media_type="application/json"),
    "/error": lambda: JSONResponse({"error": {"message": "no", "type": "NotFoundError", "code": 404}},
                                   status_code=404, headers={"x-request-id": "abc", "retry-after": "1"}),
    "/empty": lambda: Response(b"", status_code=200),
    "/bad-value": lambda: Response(b"x", headers={"x-request-id": "a\nb"}),
    "/bad-name": lambda: Response(b"x", headers={"x request id": "a"}),
}
refused: list[str] = []
cycles: list = []  # each request's weak reference to its cycle


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    how, path = scope["path"].split("/", 2)[1:]
    response = ANSWERS["/" + path]()
    cycles.append(scope[CYCLE])
    cycle = scope[CYCLE]()  # pdserve's protocol serves this app
    if how == "whole":
        if writes_whole(cycle, response.status_code, response.raw_headers):
            await send_whole(cycle, response.status_code, response.raw_headers, response.body)
            return
        refused.append(scope["method"] + " " + path)
    await response(scope, receive, send)


@pytest.fixture(scope="module", params=[True, False], ids=["held-head", "plain"])
def port(request):
    with serving(app, **ClientLimits().uvicorn_options(hold_head=request.param)) as port:
        yield port


def _exchange(port: int, raw: bytes) -> bytes:
    """Everything the server sends for `raw` until it closes the connection, its `date` header's
    value blanked (it may turn over between two exchanges)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return re.sub(rb"date: [^\r]*\r\n", b"date: -\r\n", data)


def _request(how: str, path: str, method: str = "POST", version: str = "1.1", close: bool = True) -> bytes:
    head = f"{method} /{how}{path} HTTP/{version}\r\nhost: x\r\ncontent-length: 0\r\n"
    return (head + ("connection: close\r\n" if close else "") + "\r\n").encode()


@pytest.mark.parametrize("path", ["/ok", "/error", "/empty"])
@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_whole_answer_is_the_bytes_of_the_asgi_answer(port, path, version):
    whole = _exchange(port, _request("whole", path, version=version))
    asgi = _exchange(port, _request("asgi", path, version=version))
    assert whole == asgi
    assert whole.startswith(b"HTTP/1.1 ") and b"connection: close\r\n" in whole  # the server closed it


def test_kept_alive_and_pipelined_whole_answers_are_those_of_the_asgi_path(port):
    def session(how: str) -> bytes:
        raw = (_request(how, "/ok", close=False) + _request(how, "/error", close=False)
               + _request(how, "/ok", close=False) + _request(how, "/empty"))
        return _exchange(port, raw)

    whole, asgi = session("whole"), session("asgi")
    assert whole == asgi
    assert whole.count(b"HTTP/1.1 ") == 4 and whole.count(b"connection: close") == 1


def test_what_it_would_not_write_alike_takes_the_asgi_path(port):
    refused.clear()
    assert _exchange(port, _request("whole", "/ok", method="HEAD")) == _exchange(port, _request("asgi", "/ok", "HEAD"))
    assert refused == ["HEAD ok"]
    cycle = type("Cycle", (), {"response_started": False, "access_log": False, "scope": {"method": "POST"}})()
    assert writes_whole(cycle, 200, [(b"content-length", b"1")])
    assert not writes_whole(cycle, 200, [(b"content-type", b"text/plain")])  # no length: chunked
    assert not writes_whole(cycle, 200, [(b"content-length", b"1"), (b"connection", b"close")])
    assert not writes_whole(cycle, 200, [(b"content-length", b"1"), (b"Transfer-Encoding", b"chunked")])
    assert not writes_whole(cycle, 204, [(b"content-length", b"0")])
    cycle.access_log = True
    assert not writes_whole(cycle, 200, [(b"content-length", b"1")])


@pytest.mark.parametrize("path", ["/bad-value", "/bad-name"])
def test_a_header_uvicorn_refuses_is_refused_alike(port, path):
    """uvicorn raises before writing anything and closes the connection: so does the whole path."""
    whole = _exchange(port, _request("whole", path))
    assert whole == _exchange(port, _request("asgi", path)) == b""


def test_a_request_leaves_no_reference_cycle(port):
    """The scope holds its cycle weakly (the cycle holds the scope): once its connection is closed
    a request's cycle is freed at once, not at the garbage collector's next pass."""
    gc.disable()
    try:
        cycles.clear()
        _exchange(port, _request("whole", "/ok"))
        deadline = time.monotonic() + 10
        while cycles[-1]() is not None:
            assert time.monotonic() < deadline, "the request's cycle outlived its connection"
            time.sleep(0.01)
    finally:
        gc.enable()
