"""The router benchmarks' mock workers and load generator (bench/router.py, bench/router_peers.py).

Mock workers are raw-asyncio HTTP/1.1 servers in their own processes that answer the worker
contract cheaply (prefill: one JSON with kv_transfer_params; decode: an SSE stream of `tokens`
chunks, `delay_s` apart, or one JSON when not streamed), so the router is what is measured. The
load generator is a raw keep-alive HTTP/1.1 client for the same reason.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

from pdserve.bench.mock_sse_server import chunked, read_request, serve_forever

MODEL = "mock"


# ---- mock worker -------------------------------------------------------------------------


def _mock_worker(port: int, tokens: int, delay_s: float) -> None:
    def chunk(i: int) -> bytes:
        return chunked(
            b'data: {"id":"cmpl-1","object":"text_completion","created":0,"model":"mock","choices":[{"index":0,"text":" t%d","logprobs":null,"finish_reason":null}]}\n\n'  # noqa: E501
            % i
        )

    chunks = [chunk(i) for i in range(tokens)]
    done = b"data: [DONE]\n\n"
    tail = chunked(done) + b"0\r\n\r\n"
    prefill = json.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": " t0", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
            "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": 1, "blocks": [1]},
        }
    ).encode()
    # A non-streamed request's answer (the whole completion in one JSON).
    whole = json.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(f" t{i}" for i in range(tokens)),
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
        }
    ).encode()
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    def plain(body: bytes, ctype=b"application/json") -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (ctype, len(body), body)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, body = await read_request(reader)
                if method == b"GET":
                    writer.write(plain(models if path == b"/v1/models" else b"ok" if path == b"/health" else b""))
                    continue
                if b"do_remote_decode" in body:
                    writer.write(plain(prefill))
                    continue
                if b'"stream": false' in body or b'"stream":false' in body:
                    writer.write(plain(whole))
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for c in chunks:
                    if delay_s:
                        await asyncio.sleep(delay_s)
                    writer.write(c)
                writer.write(tail)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, RuntimeError):
            pass  # a peer router's probe the mock does not parse, or a client gone mid-write
        finally:
            writer.close()

    serve_forever(handle, "127.0.0.1", port)


# ---- load generator ----------------------------------------------------------------------


class Conn:
    """One keep-alive HTTP/1.1 connection that POSTs and reads a chunked or sized answer."""

    def __init__(self, port: int):
        self.port = port
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes) -> tuple[float, float]:
        """(seconds to the first body byte, seconds to the end)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        t0 = time.perf_counter()
        self.writer.write(
            b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (path.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace"))
        first = None
        if b"transfer-encoding: chunked" in head.lower():
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                first = first or time.perf_counter()
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await self.reader.readexactly(length)
            first = time.perf_counter()
        return first - t0, time.perf_counter() - t0


PROMPT_WORDS = [8]  # --prompt-words: set once in main (the bodies are built in several places)


def _body(stream: bool, **extra) -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": "hello world " * (PROMPT_WORDS[0] // 2), "max_tokens": 16, "stream": stream, **extra}
    ).encode()


async def _sequential(port: int, n: int, two_hop_direct: tuple[int, int] | None = None) -> list[tuple[float, float]]:
    out = []
    if two_hop_direct:
        p, d = Conn(two_hop_direct[0]), Conn(two_hop_direct[1])
        pre = _body(False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        for _ in range(n):
            t0 = time.perf_counter()
            await p.post("/v1/completions", pre)
            ttfb = time.perf_counter() - t0  # the client has its first token here
            await d.post("/v1/completions", _body(True))
            out.append((ttfb, time.perf_counter() - t0))
        return out
    c = Conn(port)
    for _ in range(n):
        out.append(await c.post("/v1/completions", _body(True)))
    return out


async def _saturate(port: int, n: int, concurrency: int) -> float:
    remaining = [n]

    async def worker() -> None:
        c = Conn(port)
        while remaining[0] > 0:
            remaining[0] -= 1
            await c.post("/v1/completions", _body(True))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0)


# ---- processes ---------------------------------------------------------------------------


def _wait(port: int, path: str = "/health", timeout_s: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} did not come up")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly, so cProfile writes its file
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
