"""The least a Python router can spend on a request (not a product; a benchmark's floor).

    python -m pdserve.bench.bare_proxy --port P --decode URL [--prefill URL]

What `pdserve bench router --peers --routers ...,bare-python` measures beside pdserve and the Rust
routers: a proxy on the same event loop (uvloop) and HTTP parser (httptools) as pdserve's router,
with nothing of a router's own but the hops. Its request and its workers' answers go through
asyncio protocol callbacks only (no task, no framework, no validation, no metrics, no retries);
pass-through forwards the client's body as it came, P/D parses it once to send the prefill
(`max_tokens: 1`, `kv_transfer_params.do_remote_decode`) and once more to send the decode the
prefill's `kv_transfer_params`; the decode worker's answer is relayed as it arrives (a stream
re-chunked event batch by event batch). Whatever pdserve's router spends above this proxy is its
own choice; what this proxy spends, CPython spends for any router written in it.

It serves the bench's mock workers (bench/router_mock.py): sized or chunked answers, keep-alive,
no pipelining, no errors to speak of.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from urllib.parse import urlsplit

import httptools


class Upstream(asyncio.Protocol):
    """One kept-alive connection to a worker; its answer's pieces go to the caller's callbacks."""

    def __init__(self, pool: list) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport = None
        self.on_head = self.on_data = self.on_end = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        self.on_head(self.parser.get_status_code(), self.content_type)

    def on_body(self, body: bytes) -> None:
        self.on_data(body)

    def on_message_complete(self) -> None:
        on_end = self.on_end
        self.pool.append(self)  # free again before the caller's next request can want it
        on_end()


class Worker:
    """A worker's address and its idle connections."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.idle: list[Upstream] = []

    def post(self, loop, path: bytes, body: bytes, on_head, on_data, on_end) -> None:
        head = b"POST %s HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        data = head % (path, len(body)) + body

        def send(conn: Upstream) -> None:
            conn.on_head, conn.on_data, conn.on_end, conn.content_type = on_head, on_data, on_end, b""
            conn.transport.write(data)

        if self.idle:
            send(self.idle.pop())
            return
        connecting = loop.create_task(loop.create_connection(lambda: Upstream(self.idle), self.host, self.port))
        connecting.add_done_callback(lambda t: send(t.result()[1]))


class Client(asyncio.Protocol):
    """One client connection: each request parsed, sent on, its answer relayed."""

    def __init__(self, decode: Worker, prefill: Worker | None) -> None:
        self.decode, self.prefill = decode, prefill
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.parts: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.path = url

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        body, self.parts = b"".join(self.parts), []
        if self.prefill is None:
            self.relay(body)
            return
        request = json.loads(body)
        prefill = {**request, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        answer: list[bytes] = []

        def prefilled() -> None:
            request["kv_transfer_params"] = json.loads(b"".join(answer))["kv_transfer_params"]
            self.relay(json.dumps(request).encode())

        self.prefill.post(self.loop, self.path, json.dumps(prefill).encode(), lambda *_: None, answer.append,
                          prefilled)

    def relay(self, body: bytes) -> None:
        """The decode worker's answer to the client: sized in one write, a stream chunk by chunk."""
        write, parts, streamed = self.transport.write, [], [False]

        def head(status: int, content_type: bytes) -> None:
            if content_type.startswith(b"text/event-stream"):
                streamed[0] = True
                write(b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"
                      % (status, content_type))
            self.status, self.content_type = status, content_type

        def data(piece: bytes) -> None:
            if streamed[0]:
                write(b"%x\r\n%s\r\n" % (len(piece), piece))
            else:
                parts.append(piece)

        def end() -> None:
            if streamed[0]:
                write(b"0\r\n\r\n")
                return
            whole = b"".join(parts)
            write(b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                  % (self.status, self.content_type, len(whole), whole))

        self.decode.post(self.loop, self.path, body, head, data, end)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--decode", required=True, help="the decode (or only) worker's URL")
    p.add_argument("--prefill", help="a prefill worker's URL: P/D")
    # A router's other flags (the benches pass pdserve's --probe-interval and such) mean nothing here.
    args, _ = p.parse_known_args(argv)
    import uvloop

    async def serve() -> None:
        decode, prefill = Worker(args.decode), Worker(args.prefill) if args.prefill else None
        server = await asyncio.get_running_loop().create_server(lambda: Client(decode, prefill), args.host,
                                                                 args.port, backlog=4096)
        async with server:
            await server.serve_forever()

    # Stopped by a signal, at once: nothing here is worth a graceful close (and under valgrind a
    # graceful one takes long enough for a bench to give up on it).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: os._exit(0))
    uvloop.run(serve())


if __name__ == "__main__":
    main()
