"""A minimal OpenAI completions server with known timings, for measuring the load generator.

    python -m pdserve.bench.mock_sse_server --port 9000 [--ttft-ms 20] [--itl-ms 5]

Raw asyncio HTTP/1.1 (keep-alive, chunked SSE), so it costs far less per token than the client
it measures. Each `/v1/completions` stream sleeps --ttft-ms, then sends `max_tokens` text chunks
--itl-ms apart, a usage chunk and `[DONE]`. Sleeps are to absolute due times, so the delays a
correct client measures are exactly those asked for (plus scheduling noise). Prompts steer
failures for tests: one containing `MOCK_429` is answered 429 with an OpenAI error body, one
containing `MOCK_CUT` stops mid-stream without `[DONE]`. `GET /stats` reports requests served
and the most ever in flight at once; `GET /v1/models` lists --model, with --root as its card's
`root`. Its raw-HTTP plumbing (read_request, chunked, serve_forever) also runs bench/router_mock.py's
mock workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

_CHUNK = b'data: {"id":"cmpl-m","object":"text_completion","created":0,"model":"mock","choices":[{"index":0,"text":" t","logprobs":null,"finish_reason":null}]}\n\n'  # noqa: E501
_DONE = b"data: [DONE]\n\n"
_429 = json.dumps({"error": {"message": "mock overload", "type": "rate_limit_exceeded", "param": None,
                             "code": "rate_limit_exceeded"}}).encode()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes, bytes]:
    """One HTTP/1.1 request off a keep-alive connection -> (method, path, body). Minimal on
    purpose (Content-Length bodies only): the mocks must cost the load generator nothing."""
    head = await reader.readuntil(b"\r\n\r\n")
    line, _, rest = head.partition(b"\r\n")
    method, path, _ = line.split(b" ", 2)
    length = 0
    for h in rest.split(b"\r\n"):
        if h[:15].lower() == b"content-length:":
            length = int(h[15:])
    return method, path, await reader.readexactly(length) if length else b""


def chunked(data: bytes) -> bytes:
    """One chunk of a `transfer-encoding: chunked` body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def serve_forever(handle, host: str, port: int) -> None:
    """Serve `handle(reader, writer)` per connection until the process is killed, on uvloop when
    installed: a mock must cost far less than the client or router it is there to measure."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        server = await asyncio.start_server(handle, host, port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _plain(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


class MockServer:
    def __init__(self, ttft_s: float, itl_s: float, model: str = "mock", root: str | None = None):
        self.ttft_s, self.itl_s = ttft_s, itl_s
        card = {"id": model, "object": "model", "owned_by": "mock", **({"root": root} if root else {})}
        self.models = json.dumps({"object": "list", "data": [card]}).encode()
        self.served = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def _stream(self, writer: asyncio.StreamWriter, req: dict) -> None:
        n = int(req.get("max_tokens") or 16)
        cut = "MOCK_CUT" in str(req.get("prompt", ""))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        due = time.perf_counter() + self.ttft_s
        for i in range(n):
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunked(_CHUNK))
            if cut and i == n // 2:
                raise ConnectionResetError  # drop the connection mid-stream
            due += self.itl_s
        usage = {"id": "cmpl-m", "object": "text_completion", "created": 0, "model": "mock", "choices": [],
                 "usage": {"prompt_tokens": len(str(req.get("prompt", "")).split()), "completion_tokens": n,
                           "total_tokens": n}}
        writer.write(chunked(b"data: " + json.dumps(usage).encode() + b"\n\n") + chunked(_DONE) + b"0\r\n\r\n")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, body = await read_request(reader)
                if method == b"GET":
                    stats = {"served": self.served, "max_in_flight": self.max_in_flight}
                    body = {b"/stats": json.dumps(stats).encode(), b"/v1/models": self.models}.get(path, b"{}")
                    writer.write(_plain(b"200 OK", body))
                    continue
                req = json.loads(body)
                if "MOCK_429" in str(req.get("prompt", "")):
                    writer.write(_plain(b"429 Too Many Requests", _429))
                    continue
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    await self._stream(writer, req)
                finally:
                    self.in_flight -= 1
                    self.served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="mock_sse_server", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--model", default="mock", help="the model its /v1/models lists")
    p.add_argument("--root", default=None, help="that model card's root (vLLM's: what the model was loaded from)")
    args = p.parse_args(argv)
    serve_forever(MockServer(args.ttft_ms / 1000, args.itl_ms / 1000, args.model, args.root).handle,
                  args.host, args.port)


if __name__ == "__main__":
    main()
