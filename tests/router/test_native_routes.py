"""The generation routes on pdserve's own HTTP path (protocol/native_http.py) against the full
ASGI stack, byte for byte on the wire, with a real router and fake worker.

The same request is sent twice: to `/v1/completions` (a plain POST: the native path) and to
`/v1/%63ompletions` (the same route once uvicorn has decoded it; the native path leaves
percent-encoded paths to uvicorn, so this one takes the ASGI stack). Their answers must be the
same bytes but for the `date` header and what a generated answer makes anew (its id, its
creation time)."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest

from tests.helpers.metrics import metric

NATIVE, ASGI = "/v1/completions", "/v1/%63ompletions"
CHAT_NATIVE, CHAT_ASGI = "/v1/chat/completions", "/v1/chat/%63ompletions"


@pytest.fixture(scope="module")
def router(module_launch):
    worker = module_launch.fake_worker("--model", "tiny")
    return module_launch.router("--decode", worker.url, "--max-body-bytes", "4096", "--body-timeout", "1",
                                "--header-timeout", "1")


class Wire:
    """One raw client connection: requests as bytes, answers read whole (by content-length or
    chunked framing), as bytes."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _need(self, n: int) -> None:
        while len(self.buf) < n:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError(self.buf)
            self.buf += data

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            self._need(len(self.buf) + 1)
        i = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def answer(self) -> bytes:
        head = self._until(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 100 "):
            return head + self.answer()
        headers = head.lower()
        if b"transfer-encoding: chunked" in headers:
            body = b""
            while True:
                size_line = self._until(b"\r\n")
                size = int(size_line, 16)
                self._need(size + 2)
                body += size_line + self.buf[:size + 2]
                self.buf = self.buf[size + 2:]
                if size == 0:
                    return head + body
        n = int(re.search(rb"content-length: (\d+)", headers).group(1))
        self._need(n)
        body, self.buf = self.buf[:n], self.buf[n:]
        return head + body

    def closed(self) -> bool:
        """The server closed the connection (waits for it, bounded by the socket's timeout)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def request(path: str, body: bytes, ctype: str = "application/json", version: str = "1.1", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: {ctype}\r\nX-Request-Id: t1\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def dechunked(body: bytes) -> bytes:
    out = b""
    while True:
        size_line, body = body.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return out
        out, body = out + body[:size], body[size + 2:]


def normal(answer: bytes) -> bytes:
    """Without what differs between two answers to one request: the date, a generated answer's
    id and creation time, and how a relayed stream's events fell into chunks (as they came
    from the worker: a matter of timing, not of the path)."""
    answer = re.sub(rb"date: [^\r]*\r\n", b"", answer)
    head, body = answer.split(b"\r\n\r\n", 1)
    if b"transfer-encoding: chunked" in head:
        answer = head + b"\r\n\r\n" + dechunked(body)
    answer = re.sub(rb'"id":\s*"[^"]*"', b'"id":"-"', answer)
    return re.sub(rb'"created":\s*\d+', b'"created":0', answer)


GOOD = [
    (NATIVE, ASGI, {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "seed": 1}),
    (CHAT_NATIVE, CHAT_ASGI, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
]
BAD = [  # (content type, body): refused before any worker is called
    ("application/json", b'{"model": "tiny", "prompt": "hi", "max_tokens": 3'),  # bad JSON
    ("text/plain", b'{"model": "tiny", "prompt": "hi"}'),  # wrong content type
    ("application/json", b'{"model": "nope", "prompt": "hi", "max_tokens": 3}'),  # unknown model
    ("application/json", b'{"model": "tiny", "prompt": "hi", "max_tokens": -1}'),  # invalid parameter
    ("application/json", b"[1, 2]"),
    ("application/json", b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}'),  # over --max-body-bytes
]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("native,asgi,body", GOOD, ids=["completions", "chat"])
def test_good_answers_are_the_stacks_on_one_kept_alive_connection(router, native, asgi, body, stream):
    wire = Wire(router.url)
    raw = json.dumps({**body, "stream": stream}).encode()
    answers = []
    for path in (native, asgi, native):  # kept alive across both paths
        wire.send(request(path, raw))
        answers.append(normal(wire.answer()))
    assert answers[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"vary: Origin\r\n" in answers[0] and b"x-request-id: t1\r\n" in answers[0]
    assert (b"transfer-encoding: chunked" in answers[0]) == stream
    assert answers[0] == answers[1] == answers[2]
    wire.close()


@pytest.mark.parametrize("ctype,body", BAD)
def test_refusals_are_the_stacks(router, ctype, body):
    wire = Wire(router.url)
    native, asgi = [], []
    for path, out in ((NATIVE, native), (ASGI, asgi)):
        wire.send(request(path, body, ctype))
        out.append(normal(wire.answer()))
    assert native == asgi
    assert native[0].split(b" ")[1] in (b"400", b"404", b"413", b"415")
    assert b'"error"' in native[0]
    wire.close()


def test_pipelined_requests_are_answered_in_order(router):
    """Three requests in one write: the first served natively, the others queued by uvicorn
    behind it, their answers in order and each as alone."""
    body = json.dumps(GOOD[0][2]).encode()
    bad = BAD[2][1]
    wire = Wire(router.url)
    wire.send(request(NATIVE, body) + request(NATIVE, bad) + request(NATIVE, body))
    pipelined = [normal(wire.answer()) for _ in range(3)]
    alone = []
    for raw in (body, bad, body):
        wire.send(request(ASGI, raw))
        alone.append(normal(wire.answer()))
    assert pipelined == alone
    wire.close()


@pytest.mark.parametrize("version,extra", [("1.0", ""), ("1.1", "Connection: close\r\n")], ids=["http10", "close"])
def test_a_connection_not_kept_alive_is_closed_after_its_answer(router, version, extra):
    body = json.dumps(GOOD[0][2]).encode()
    answers = []
    for path in (NATIVE, ASGI):
        wire = Wire(router.url)
        wire.send(request(path, body, version=version, extra=extra))
        answers.append(normal(wire.answer()))
        assert wire.closed()
        wire.close()
    assert b"connection: close\r\n" in answers[0]
    assert answers[0] == answers[1]


def test_expect_100_continue_is_answered_as_uvicorn_does(router):
    body = json.dumps(GOOD[0][2]).encode()
    answers = []
    for path in (NATIVE, ASGI):
        wire = Wire(router.url)
        head = request(path, b"", extra="Expect: 100-continue\r\n").replace(b"Content-Length: 0",
                                                                            b"Content-Length: %d" % len(body))
        wire.send(head)
        assert wire._until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        wire.send(body)
        answers.append(normal(wire.answer()))
        wire.close()
    assert answers[0].startswith(b"HTTP/1.1 200 OK") and answers[0] == answers[1]


def test_a_late_body_gets_the_stacks_408(router):
    """--body-timeout 1: half a body, then nothing."""
    answers = []
    for path in (NATIVE, ASGI):
        wire = Wire(router.url)
        wire.send(request(path, b'{"model": "tiny", "prompt": "hi"}')[:-10])
        answers.append(normal(wire.answer()))
        assert wire.closed()
        wire.close()
    assert answers[0].startswith(b"HTTP/1.1 408 ") and b"connection: close\r\n" in answers[0]
    assert answers[0] == answers[1]


def test_the_header_deadline_still_closes_slow_headers(router):
    """--header-timeout 1: a request line and one header, then nothing; and slow headers after
    a natively served request on the same connection."""
    wire = Wire(router.url)
    wire.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert wire.closed()
    wire.close()
    wire = Wire(router.url)
    wire.send(request(NATIVE, json.dumps(GOOD[0][2]).encode()))
    assert wire.answer().startswith(b"HTTP/1.1 200 OK")
    wire.send(b"POST /v1/completions HTTP/1.1\r\n")
    assert wire.closed()
    wire.close()


def test_the_openai_client(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=3).choices[0].text
    assert text
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="hello",
                                                                              max_tokens=3, stream=True) if c.choices)
    assert streamed == text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hello", max_tokens=3)


def test_a_client_leaving_mid_stream_cancels_the_upstream_request(launch):
    decode = launch.fake_worker("--delay", "0.2")
    router = launch.router("--decode", decode.url)
    total = decode.kv()["num_total_blocks"]
    wire = Wire(router.url)
    body = json.dumps({"model": "tiny", "prompt": "hello " * 20, "max_tokens": 200, "stream": True}).encode()
    wire.send(request(NATIVE, body))
    seen = b""
    while seen.count(b"data: ") < 2:
        seen += wire.sock.recv(65536)
    assert decode.kv()["num_free_blocks"] < total  # the decode is streaming
    wire.close()
    deadline = time.monotonic() + 20
    while decode.kv()["num_free_blocks"] != total:
        assert time.monotonic() < deadline, "the decode worker's request was not cancelled"
        time.sleep(0.05)
    events = httpx.get(decode.url + "/debug/events", timeout=10).json()
    assert any(e[0] == "d_abort" if isinstance(e, list) else "d_abort" in json.dumps(e) for e in events)


def test_a_client_leaving_mid_body_is_counted_as_on_the_stack(router):
    """Gone before its body was whole: the hang-up (499) in the route's request count, on both paths."""
    def gone() -> float:
        return metric(router, "pdserve_router_requests_total", route="completions", status="499", disaggregated="no")

    for path in (NATIVE, ASGI):
        before = gone()
        wire = Wire(router.url)
        wire.send(request(path, b'{"model": "tiny", "prompt": "hi"}')[:-10])
        wire.close()
        deadline = time.monotonic() + 20
        while gone() != before + 1:
            assert time.monotonic() < deadline, path
            time.sleep(0.05)
