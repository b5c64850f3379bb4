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
routers (bench/router_peers.py) runs instead; with --instructions N, pdserve's router (and a
baseline tree's) counted in instructions per request under callgrind
(bench/router_instructions.py).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import subprocess
import sys

from pdserve.bench.router_mock import _mock_worker, _saturate, _sequential, _stop, _wait, PROMPT_WORDS
from pdserve.cli.stack import free_port

# ---- orchestration -----------------------------------------------------------------------

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
    p.add_argument("--routers", default="pdserve,baseline,bare-python,vllm-router,sglang-router",
                   help="with --peers: which routers, comma-separated")
    p.add_argument("--baseline-src", default=None, metavar="DIR",
                   help="with --peers: a directory holding another checkout's `pdserve` package")
    p.add_argument("--workers", type=int, default=1, help="with --peers: also pdserve with --workers N")
    p.add_argument("--rounds", type=int, default=3, help="with --peers or --instructions: alternating rounds")
    # Instructions per request (bench/router_instructions.py): what CPU time on a busy machine cannot resolve.
    p.add_argument("--instructions", type=int, default=0, metavar="N",
                   help="count pdserve's (and --baseline-src's) instructions over N streamed requests, "
                        "under callgrind")
    p.add_argument("--unary", action="store_true", help="with --instructions: non-streamed requests instead")


def run(args: argparse.Namespace) -> int:
    if args.instructions:
        from pdserve.bench import router_instructions

        return router_instructions.run(args)
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
