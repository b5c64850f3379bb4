"""Router overhead benchmark (not a test): the router in front of mock OpenAI workers.

    python -m pdserve.bench.router [--tokens 8] [--delay-ms 1] [--requests 400] [--saturation-requests 4000]
                                   [--concurrency 64] [--profile router.prof]

Mock workers are raw-asyncio HTTP/1.1 servers in their own processes that answer the worker
contract cheaply (prefill: one JSON with kv_transfer_params; decode: an SSE stream of `--tokens`
chunks, `--delay-ms` apart), so the router is what is measured. The load generator is a raw
keep-alive HTTP/1.1 client for the same reason. Reported:
  1. concurrency 1, streaming: e2e and time-to-first-byte p50/p99, direct vs through the router,
     for pass-through (router -> decode) and for the two-hop P/D flow (direct = the client doing
     prefill then decode itself); "added" is router minus direct.
  2. saturation: P/D streaming requests/s at `--concurrency` with no token delay.
With --profile, the router runs under cProfile during the saturation run and the top functions
by own time are printed. With --peers, the comparison against a baseline tree and the Rust
routers (bench/router_peers.py) runs instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

from pdserve.bench.mock_sse_server import chunked, read_request, serve_forever
from pdserve.cli.stack import free_port

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
    prefill = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                          "choices": [{"index": 0, "text": " t0", "logprobs": None, "finish_reason": "length"}],
                          "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
                          "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": 1, "blocks": [1]}}).encode()
    # A non-streamed request's answer (the whole completion in one JSON).
    whole = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                        "choices": [{"index": 0, "text": "".join(f" t{i}" for i in range(tokens)), "logprobs": None,
                                     "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 8, "completion_tokens": tokens,
                                  "total_tokens": 8 + tokens}}).encode()
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


# ---- orchestration -----------------------------------------------------------------------

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


def _start_router(prefill: int | None, decode: int, profile: str | None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    args = ["router", "--host", "127.0.0.1", "--port", str(port), "--decode", f"http://127.0.0.1:{decode}",
            "--log-level", "warning"]
    if prefill:
        args += ["--prefill", f"http://127.0.0.1:{prefill}"]
    if profile:
        code = ("import cProfile; from pdserve.cli.main import main; "
                f"cProfile.run({f'main({args!r})'!r}, {profile!r})")
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-m", "pdserve.cli.main", *args]
    proc = subprocess.Popen(cmd)
    _wait(port)
    return proc, port


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly, so cProfile writes its file
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=8, help="chunks per decode stream")
    p.add_argument("--delay-ms", type=float, default=1.0, help="mock inter-token delay (latency runs)")
    p.add_argument("--requests", type=int, default=400, help="requests per latency run")
    p.add_argument("--saturation-requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--profile", default=None, metavar="FILE", help="cProfile the router during saturation")
    p.add_argument("--prompt-words", type=int, default=16, help="words in each request's prompt (e.g. 3000: "
                                                                   "what the router's prompt handling costs)")
    # The peers' comparison (bench/router_peers.py): vllm-router and sglang-router when installed.
    p.add_argument("--peers", action="store_true", help="compare against a baseline tree and the Rust routers")
    p.add_argument("--routers", default="pdserve,baseline,vllm-router,sglang-router",
                   help="with --peers: which routers, comma-separated")
    p.add_argument("--baseline-src", default=None, metavar="DIR",
                   help="with --peers: a directory holding another checkout's `pdserve` package")
    p.add_argument("--workers", type=int, default=1, help="with --peers: also pdserve with --workers N")
    p.add_argument("--rounds", type=int, default=3, help="with --peers: alternating rounds")


def run(args: argparse.Namespace) -> int:
    if args.peers:
        from pdserve.bench import router_peers

        return router_peers.run(args)
    PROMPT_WORDS[0] = args.prompt_words
    ctx = multiprocessing.get_context("spawn")
    ports = {name: free_port() for name in ("prefill", "decode", "fast_prefill", "fast_decode")}
    delays = {"prefill": args.delay_ms / 1e3, "decode": args.delay_ms / 1e3, "fast_prefill": 0.0, "fast_decode": 0.0}
    mocks = [ctx.Process(target=_mock_worker, args=(ports[n], args.tokens, delays[n]), daemon=True) for n in ports]
    for m in mocks:
        m.start()
    for port in ports.values():
        _wait(port)
    procs = []
    try:
        rows = []
        direct = asyncio.run(_sequential(ports["decode"], args.requests))
        via, via_port = _start_router(None, ports["decode"], None)
        procs.append(via)
        routed = asyncio.run(_sequential(via_port, args.requests))
        direct2 = asyncio.run(_sequential(0, args.requests, (ports["prefill"], ports["decode"])))
        pd, pd_port = _start_router(ports["prefill"], ports["decode"], None)
        procs.append(pd)
        routed2 = asyncio.run(_sequential(pd_port, args.requests))
        for name, d, r in (("pass-through", direct, routed), ("P/D two-hop", direct2, routed2)):
            for metric, i in (("first byte", 0), ("e2e", 1)):
                dd, rr = [x[i] for x in d], [x[i] for x in r]
                rows.append((name, metric, _pct(dd, .5), _pct(rr, .5), _pct(rr, .5) - _pct(dd, .5),
                             _pct(dd, .99), _pct(rr, .99), _pct(rr, .99) - _pct(dd, .99)))
        print(f"\nconcurrency 1, streaming, {args.tokens} tokens x {args.delay_ms} ms, {args.requests} requests (ms)")
        print(
            f"{'flow':14} {'metric':10} {'p50 dir':>8} {'p50 rtr':>8} {'added':>7} {'p99 dir':>8} {'p99 rtr':>8} {'added':>7}"  # noqa: E501
        )
        for row in rows:
            print(f"{row[0]:14} {row[1]:10} " + " ".join(f"{v:8.2f}" if j % 3 != 2 else f"{v:7.2f}"
                                                         for j, v in enumerate(row[2:])))
        for p in procs:
            _stop(p)
        procs.clear()
        sat, sat_port = _start_router(ports["fast_prefill"], ports["fast_decode"], args.profile)
        procs.append(sat)
        asyncio.run(_saturate(sat_port, 200, args.concurrency))  # warm the connection pools
        rps = asyncio.run(_saturate(sat_port, args.saturation_requests, args.concurrency))
        print(f"\nsaturation: P/D two-hop streaming, {args.tokens} tokens, concurrency {args.concurrency}: "
              f"{rps:,.0f} requests/s ({os.cpu_count()} cores shared by router, mocks and load generator)")
        direct_rps = asyncio.run(_saturate(ports["fast_decode"], args.saturation_requests, args.concurrency))
        print(f"reference: the mock decode worker alone answers {direct_rps:,.0f} requests/s")
    finally:
        for p in procs:
            _stop(p)
        for m in mocks:
            m.terminate()
    if args.profile:
        import pstats

        print(f"\nrouter profile (saturation run), top 25 by own time; full profile in {args.profile}")
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.router", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
