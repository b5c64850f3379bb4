"""The header deadline (protocol/http_limits.py), one timer per connection: a kept-alive
connection whose requests keep coming whole is never cut off however long it lives, and a
request whose headers stop coming is, at its own deadline, on a fresh connection or after
answered requests. Real uvicorn server, real sockets."""

from __future__ import annotations

import socket
import time

import pytest
from starlette.responses import Response

from pdserve.protocol.http_limits import ClientLimits
from tests.protocol.server_thread import serving

# 1 s: the lapsed-deadline test sends its second request's rest half a deadline before that
# deadline, a margin a loaded CI machine's scheduling cannot eat (0.3 s left it 150 ms).
HEADER_TIMEOUT_S = 1.0
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def app(scope, receive, send):
    if scope["type"] == "http":
        await Response(b"ok")(scope, receive, send)


@pytest.fixture(scope="module")
def port():
    with serving(app, **ClientLimits(header_timeout_s=HEADER_TIMEOUT_S).uvicorn_options()) as port:
        yield port


def _answered(s: socket.socket) -> None:
    data = b""
    while not data.endswith(b"ok"):
        chunk = s.recv(4096)
        assert chunk, "closed before the answer"
        data += chunk
    assert data.startswith(b"HTTP/1.1 200")


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_busy_connection_outlives_many_deadlines_then_a_stalled_request_is_cut_off(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        until = time.monotonic() + 5 * HEADER_TIMEOUT_S
        while time.monotonic() < until:
            s.sendall(REQUEST)
            _answered(s)
            time.sleep(HEADER_TIMEOUT_S / 6)  # idle between requests: keep-alive's, not the deadline's
        s.sendall(b"GET / HTTP/1.1\r\nHo")  # headers that stop coming
        assert _closed_within(s, 5 * HEADER_TIMEOUT_S)


def test_a_request_started_just_before_a_lapsed_deadline_gets_its_own(port):
    """The connection's timer, armed for the first request, fires during the second one's
    headers: the second request is not cut off before its own deadline."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(REQUEST)
        _answered(s)
        time.sleep(HEADER_TIMEOUT_S * 0.8)
        s.sendall(b"GET / HTTP/1.1\r\n")  # its deadline: one HEADER_TIMEOUT_S from here, after the first timer fires
        time.sleep(HEADER_TIMEOUT_S * 0.5)
        s.sendall(b"Host: x\r\n\r\n")
        _answered(s)


def test_a_connection_that_sends_nothing_is_cut_off(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        assert _closed_within(s, 5 * HEADER_TIMEOUT_S)


# The keep-alive bound rides the same timer: shorter than the header deadline here, so an idle
# connection's close must come from a timer wound earlier than the one its request armed.
KEEP_ALIVE_S, LONG_HEADER_TIMEOUT_S = 2.0, 30.0


@pytest.fixture(scope="module")
def keep_alive_port():
    limits = ClientLimits(header_timeout_s=LONG_HEADER_TIMEOUT_S, keep_alive_s=KEEP_ALIVE_S)
    with serving(app, **limits.uvicorn_options()) as port:
        yield port


def test_an_idle_kept_alive_connection_closes_at_the_keep_alive_bound(keep_alive_port):
    with socket.create_connection(("127.0.0.1", keep_alive_port)) as s:
        s.sendall(REQUEST)
        _answered(s)
        assert _closed_within(s, LONG_HEADER_TIMEOUT_S / 2)  # long before the header deadline


def test_each_answer_gives_its_connection_a_new_keep_alive_bound(keep_alive_port):
    with socket.create_connection(("127.0.0.1", keep_alive_port)) as s:
        for _ in range(25):  # 25 x 0.2 s: more than two keep-alive bounds of a busy connection
            s.sendall(REQUEST)
            _answered(s)
            time.sleep(KEEP_ALIVE_S / 10)
        s.sendall(REQUEST)
        _answered(s)
