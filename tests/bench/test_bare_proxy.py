"""The router benchmark's floor (bench/bare_proxy.py) really does the hops it is measured for: a
real proxy process in front of real sockets; its workers are recording stand-ins (the bench's
own mocks cannot say what they were sent)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

from pdserve.bench import router_mock as rb
from pdserve.bench.mock_sse_server import chunked, read_request
from pdserve.cli.stack import free_port

PARAMS = {"remote_host": "10.0.0.1", "remote_port": 7, "blocks": [3, 4]}


class RecordingWorker:
    """A worker on its own event loop thread that keeps every body it was sent."""

    def __init__(self, answer):
        self.port, self.bodies, self._answer = free_port(), [], answer
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def handle(reader, writer):
            try:
                while True:
                    _, _, body = await read_request(reader)
                    self.bodies.append(json.loads(body))
                    writer.write(self._answer(self.bodies[-1]))
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = self._loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", self.port))
        started.set()
        self._loop.run_forever()
        server.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def _sized(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def _decode_answer(req: dict) -> bytes:
    if not req.get("stream"):
        return _sized({"choices": [{"text": " a b"}]})
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + chunked(b'data: {"t": 1}\n\n') + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"


@pytest.fixture
def workers():
    prefill = RecordingWorker(lambda req: _sized({"choices": [{"text": " a"}], "kv_transfer_params": PARAMS}))
    decode = RecordingWorker(_decode_answer)
    yield prefill, decode
    prefill.stop()
    decode.stop()


def _proxy(decode_port: int, prefill_port: int | None):
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.bench.bare_proxy", "--port", str(port),
            "--decode", f"http://127.0.0.1:{decode_port}"]
    if prefill_port:
        argv += ["--prefill", f"http://127.0.0.1:{prefill_port}"]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 30
    async def connect() -> None:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        writer.close()

    try:
        while True:  # up once it accepts a connection
            try:
                asyncio.run(connect())
                return proc, port
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not come up"
                time.sleep(0.1)
    except BaseException:
        proc.kill()  # not left running when the test gives up on it
        raise


async def _post(port: int, body: dict) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(raw), raw))
    head = await reader.readuntil(b"\r\n\r\n")
    if b"chunked" in head:
        out = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            out += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)
    else:
        out = await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
    writer.close()
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_pass_through_forwards_the_body_and_relays_the_answer(workers, stream):
    _, decode = workers
    proc, port = _proxy(decode.port, None)
    try:
        body = json.loads(rb._body(stream))
        out = asyncio.run(asyncio.wait_for(_post(port, body), 30))
    finally:
        proc.kill()
    assert decode.bodies == [body]
    assert out == (b'data: {"t": 1}\n\ndata: [DONE]\n\n' if stream else b'{"choices": [{"text": " a b"}]}')


@pytest.mark.parametrize("stream", [False, True])
def test_pd_prefills_then_sends_the_decode_the_prefill_params(workers, stream):
    prefill, decode = workers
    proc, port = _proxy(decode.port, prefill.port)
    try:
        body = json.loads(rb._body(stream))
        out = asyncio.run(asyncio.wait_for(_post(port, body), 30))
    finally:
        proc.kill()
    asked = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    assert prefill.bodies == [asked]
    assert decode.bodies == [{**body, "kv_transfer_params": PARAMS}]
    assert out.startswith(b"data: " if stream else b'{"choices"')
