"""Which requests pdserve's own HTTP path takes (protocol/native_http.py) and which it leaves to
uvicorn and the app, on a real uvicorn server and real sockets: the handler is told by its
`Incoming` (no ASGI `receive` on the native path) and answers with the path it was called on.
The router's answers on both paths are compared byte for byte in tests/router/test_native_routes.py."""

from __future__ import annotations

import socket

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

from pdserve.protocol.errors import APIError
from pdserve.protocol.http_limits import ClientLimits
from pdserve.protocol.incoming import Incoming
from pdserve.protocol.native_http import NATIVE_BODY_BYTES, NativeProtocol, NativeRoutes, _plain
from pdserve.protocol.sse import SSEResponse
from tests.protocol.server_thread import serving


async def handler(request: Incoming) -> Response:
    path = "asgi" if request.receive is not None else "native"
    try:
        body = await request.body(1000, 5)
    except APIError as e:  # (as the router's handlers answer every error themselves)
        return e.response()
    if body == b"stream":
        async def events():
            yield b"data: " + path.encode() + b"\n\n"
        return SSEResponse(events())
    return JSONResponse({"path": path, "body": body.decode(), "x": request.header(b"x")})


async def app(scope, receive, send):
    """The ASGI side: the same handler, for what the native path leaves to uvicorn."""
    if scope["type"] != "http":
        return
    response = await handler(Incoming.of_asgi(scope, receive))
    await response(scope, receive, send)


@pytest.fixture(scope="module")
def port():
    native = NativeRoutes({"/gen": handler}, max_body_bytes=1000, body_timeout_s=5)
    with serving(app, **ClientLimits().uvicorn_options(hold_head=True, protocol=NativeProtocol, native=native)) as p:
        yield p


def _answers(port: int, data: bytes, n: int = 1) -> list[bytes]:
    """`n` answers to `data` (requests written at once), each read whole by its content-length
    or its chunked end."""
    out, buf = [], b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        while len(out) < n:
            chunk = s.recv(65536)
            assert chunk, (out, buf)
            buf += chunk
            while b"\r\n\r\n" in buf:
                head, _, rest = buf.partition(b"\r\n\r\n")
                if b"transfer-encoding: chunked" in head:
                    if b"0\r\n\r\n" not in rest:
                        break
                    end = rest.index(b"0\r\n\r\n") + 5
                elif head.startswith(b"HTTP/1.1 100 "):
                    end = 0
                else:
                    end = int(head.lower().partition(b"content-length: ")[2].partition(b"\r\n")[0])
                    if len(rest) < end:
                        break
                out.append(head + b"\r\n\r\n" + rest[:end])
                buf = rest[end:]
    return out


def post(path: str = "/gen", body: bytes = b"hi", extra: bytes = b"", length: bool = True) -> bytes:
    size = b"Content-Length: %d\r\n" % len(body) if length else b""
    return b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nX: 1\r\n" + size + extra + b"\r\n" + body


def test_a_plain_post_to_a_native_route_is_served_natively(port):
    (answer,) = _answers(port, post())
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b'{"path":"native","body":"hi","x":"1"}')


def test_a_stream_is_served_natively_with_chunked_framing(port):
    (answer,) = _answers(port, post(body=b"stream"))
    assert b"transfer-encoding: chunked\r\n" in answer
    assert answer.endswith(b"\r\n\r\ne\r\ndata: native\n\n\r\n0\r\n\r\n")


@pytest.mark.parametrize("request_bytes", [
    post(extra=b"Origin: https://app.example\r\n"),  # CORS is the app's
    post(path="/g%65n"),  # percent-encoded: uvicorn decodes it
    post(body=b"x" * 1001),  # declared over the limit: the app's 413
    post(length=False, extra=b"Transfer-Encoding: chunked\r\n", body=b"2\r\nhi\r\n0\r\n\r\n"),
    post(path="/other"),
    b"PUT /gen HTTP/1.1\r\nHost: x\r\nX: 1\r\nContent-Length: 2\r\n\r\nhi",
], ids=["origin", "percent", "too-large", "chunked", "other-route", "put"])
def test_anything_unusual_takes_the_asgi_path(port, request_bytes):
    (answer,) = _answers(port, request_bytes)
    assert b'"path":"asgi"' in answer or answer.startswith(b"HTTP/1.1 413")


def test_expect_100_continue_takes_the_asgi_path(port):
    cont, answer = _answers(port, post(extra=b"Expect: 100-continue\r\n"), 2)
    assert cont == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert b'"path":"asgi"' in answer


def test_pipelined_requests_queue_behind_a_native_one(port):
    answers = _answers(port, post(body=b"a") + post(body=b"b") + post(body=b"c"), 3)
    assert [a.rpartition(b'"body":')[2][:3] for a in answers] == [b'"a"', b'"b"', b'"c"']
    assert b'"path":"native"' in answers[0]


def test_a_body_past_a_mebibyte_takes_the_asgi_path_within_the_limit():
    """uvicorn reads a large body in step with its handler; the native path would take it all in
    at once (protocol/native_http.py NATIVE_BODY_BYTES)."""
    limit = 4 * NATIVE_BODY_BYTES

    async def sized(request: Incoming) -> Response:
        body = await request.body(limit, 5)
        return JSONResponse({"path": "asgi" if request.receive is not None else "native", "size": len(body)})

    async def sized_app(scope, receive, send):
        if scope["type"] == "http":
            await (await sized(Incoming.of_asgi(scope, receive)))(scope, receive, send)

    native = NativeRoutes({"/gen": sized}, max_body_bytes=limit, body_timeout_s=5)
    with serving(sized_app, **ClientLimits().uvicorn_options(hold_head=True, protocol=NativeProtocol,
                                                             native=native)) as p:
        (at_bound,) = _answers(p, post(body=b"x" * NATIVE_BODY_BYTES))
        (past,) = _answers(p, post(body=b"x" * (NATIVE_BODY_BYTES + 1)))
    assert at_bound.endswith(b'{"path":"native","size":%d}' % NATIVE_BODY_BYTES)
    assert past.endswith(b'{"path":"asgi","size":%d}' % (NATIVE_BODY_BYTES + 1))


def _per_header(headers: list) -> bytes | None:
    """What uvicorn's loop writes for `headers` (none of them `connection`), or None if it refuses one."""
    lines = b""
    for name, value in headers:
        if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
            return None
        lines += name.lower() + b": " + value + b"\r\n"
    return lines


_BYTES = st.binary(max_size=6) | st.sampled_from([b"content-type", b"X-Id", b"a\r\nb: c", b"a b", b"\t v", b"x:", b": ",
                                                  b""])


@settings(max_examples=500, deadline=None)
@given(headers=st.lists(st.tuples(_BYTES, _BYTES), max_size=4))
@example(headers=[(b": ", b"")])  # a name that splits as an empty one and a value
@example(headers=[(b"a", b"x\r\ny: z")])  # a value that splits as two lines
@example(headers=[(b"a: b", b"c")])  # a name that splits as a name and a value
@example(headers=[(b"a", b"x\ry")])  # a lone CR
def test_head_lines_taken_as_they_are_only_when_uvicorn_writes_them_so(headers):
    """`_plain` (one search over all names, one match over all the lines) passes only headers
    uvicorn's per-header loop writes unchanged, and passes every such list of lowercase names."""
    block = _plain(headers)
    expected = _per_header(headers)
    if any(name.lower() == b"connection" for name, _ in headers):
        assert block is None
        return
    if block is not None:
        assert block == expected
    elif expected is not None:
        assert any(name != name.lower() for name, _ in headers)
