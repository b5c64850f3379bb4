"""The router against its peers (not a test): pdserve's router, a baseline checkout of it, and the
Rust routers users would put in front instead (vllm-router, sglang-router) when installed, each in
front of the same mock workers (bench/router.py's), in alternating rounds.

    pdserve bench router --peers [--routers pdserve,baseline,bare-python,vllm-router,sglang-router]
                                 [--baseline-src DIR] [--workers N] [--rounds 3]

For each router and flow (pass-through: router -> decode; P/D: prefill then decode), measured:
  - CPU per request (µs): the router's processes' user+system CPU over a saturation run of
    streamed requests, divided by the requests; also for non-streamed ones;
  - streamed requests/s at --concurrency and relayed events per second per router core;
  - added TTFT: first byte through the router minus first byte direct, p50, at concurrency 1, and
    the p50 first byte at 32 concurrent streams (mocks with --delay-ms between tokens).
The machine's load moves between rounds, so the routers take turns and medians are reported;
only ratios measured in one run mean anything.

`bare-python` (bench/bare_proxy.py) is the floor: a proxy on pdserve's event loop and HTTP parser
that does nothing but the hops, so what any router written in CPython spends at least.

`baseline` is pdserve's router from another source tree (`--baseline-src`, a directory holding
the `pdserve` package: e.g. `git archive main | tar -x -C DIR/pdserve`), run by this interpreter.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pdserve.bench import router_mock as rb
from pdserve.cli.stack import free_port

PEERS = ("vllm-router", "sglang-router")
# The least a Python router can spend (bench/bare_proxy.py): the floor under pdserve's router.
BARE = "bare-python"


@dataclass
class Result:
    cpu_us_stream: list[float] = field(default_factory=list)
    cpu_us_unary: list[float] = field(default_factory=list)
    rps_stream: list[float] = field(default_factory=list)
    events_per_core_s: list[float] = field(default_factory=list)
    ttft1_added_ms: list[float] = field(default_factory=list)
    ttft32_ms: list[float] = field(default_factory=list)


def _argv(name: str, port: int, prefill: int | None, decode: int, args) -> tuple[list[str], dict]:
    url = "http://127.0.0.1:%d"
    env = dict(os.environ)
    if name in ("pdserve", "baseline") or name.startswith("pdserve-w"):
        argv = [
            sys.executable,
            "-m",
            "pdserve.cli.main",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--decode",
            url % decode,
            "--log-level",
            "warning",
            "--policy",
            "round-robin",
        ]
        if prefill:
            argv += ["--prefill", url % prefill]
        if name.startswith("pdserve-w"):
            argv += ["--workers", name.removeprefix("pdserve-w")]
        if name == "baseline":
            env["PYTHONPATH"] = os.path.abspath(args.baseline_src)
        return argv, env
    if name == BARE:
        argv = [sys.executable, "-m", "pdserve.bench.bare_proxy", "--port", str(port), "--decode", url % decode]
        return argv + (["--prefill", url % prefill] if prefill else []), env
    # sglang-router's console script wants a subcommand; its module is the plain launcher, run by
    # the interpreter of the environment it is installed in (its script's, when that is on PATH),
    # isolated (-I): run from this repository's root, its `operator` package would shadow the stdlib's.
    script = shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)
    exe = (
        [os.path.join(os.path.dirname(script), "python"), "-I", "-m", "sglang_router.launch_router"]
        if name == "sglang-router"
        else [script]
    )
    argv = [
        *exe,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--log-level",
        "warn" if name == "sglang-router" else "warning",
    ]
    if prefill:
        flag = "--vllm-pd-disaggregation" if name == "vllm-router" else "--pd-disaggregation"
        argv += [flag, "--prefill", url % prefill, "--decode", url % decode]
    else:
        argv += ["--worker-urls", url % decode]
    return argv, env


def _start(name: str, prefill: int | None, decode: int, args) -> tuple[subprocess.Popen, int]:
    port = free_port()
    argv, env = _argv(name, port, prefill, decode, args)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:  # ready once it answers a request (the routers' health routes differ)
        try:
            asyncio.run(rb.Conn(port).post("/v1/completions", rb._body(True)))
            return proc, port
        except (OSError, RuntimeError, asyncio.IncompleteReadError):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{name} did not come up ({argv})")
            time.sleep(0.2)


def _cpu_s(proc: subprocess.Popen) -> float:
    """User + system CPU seconds of the router and its children (--workers), from /proc (Linux)."""
    total, todo = 0.0, [proc.pid]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


async def _load(port: int, n: int, concurrency: int, stream: bool) -> list[float]:
    """`n` requests by `concurrency` keep-alive connections; their first-byte times (s)."""
    remaining, ttfb = [n], []
    body = rb._body(stream)

    async def one() -> None:
        c = rb.Conn(port)
        while remaining[0] > 0:
            remaining[0] -= 1
            ttfb.append((await c.post("/v1/completions", body))[0])

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return ttfb


def _saturate(proc: subprocess.Popen, port: int, n: int, concurrency: int, stream: bool) -> tuple[float, float]:
    """(requests/s, router CPU µs per request)."""
    asyncio.run(_load(port, min(200, n), concurrency, stream))  # warm pools
    cpu0, t0 = _cpu_s(proc), time.perf_counter()
    asyncio.run(_load(port, n, concurrency, stream))
    wall, cpu = time.perf_counter() - t0, _cpu_s(proc) - cpu0
    return n / wall, cpu / n * 1e6


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _direct_ttft(ports: dict, pd: bool, n: int, concurrency: int) -> float:
    """The first byte's p50 without a router (P/D: the client prefills, then decodes)."""
    if concurrency == 1:
        pair = (ports["prefill"], ports["decode"]) if pd else None
        return _p50([x[0] for x in asyncio.run(rb._sequential(ports["decode"], n, pair))])
    return _p50(asyncio.run(_load(ports["decode"], n, concurrency, True)))


def run(args) -> int:
    rb.PROMPT_WORDS[0] = args.prompt_words
    names = [r for r in args.routers.split(",") if r]
    if args.workers > 1:
        names.append(f"pdserve-w{args.workers}")
    for peer in PEERS:
        if peer in names and not (
            shutil.which(peer) or os.path.exists(os.path.join(os.path.dirname(sys.executable), peer))
        ):
            print(f"{peer} is not installed (pip install {peer}): left out")
            names.remove(peer)
    if "baseline" in names and not args.baseline_src:
        print("baseline needs --baseline-src: left out")
        names.remove("baseline")
    ctx = multiprocessing.get_context("spawn")
    ports = {n: free_port() for n in ("prefill", "decode", "fast_prefill", "fast_decode")}
    delays = {"prefill": args.delay_ms / 1e3, "decode": args.delay_ms / 1e3, "fast_prefill": 0.0, "fast_decode": 0.0}
    mocks = [ctx.Process(target=rb._mock_worker, args=(ports[n], args.tokens, delays[n]), daemon=True) for n in ports]
    for m in mocks:
        m.start()
    for port in ports.values():
        rb._wait(port)
    results = {(n, flow): Result() for n in names for flow in ("pass-through", "P/D")}
    direct = {}
    try:
        for rnd in range(args.rounds):
            for flow in ("pass-through", "P/D"):
                pd = flow == "P/D"
                direct[flow, 1] = _direct_ttft(ports, pd, args.requests, 1)
                for name in names if rnd % 2 == 0 else reversed(names):
                    r = results[name, flow]
                    proc, port = _start(name, ports["fast_prefill"] if pd else None, ports["fast_decode"], args)
                    try:
                        rps, cpu = _saturate(proc, port, args.saturation_requests, args.concurrency, True)
                        r.rps_stream.append(rps)
                        r.cpu_us_stream.append(cpu)
                        r.events_per_core_s.append(args.tokens / (cpu / 1e6))
                        r.cpu_us_unary.append(
                            _saturate(proc, port, args.saturation_requests, args.concurrency, False)[1]
                        )
                    finally:
                        rb._stop(proc)
                    proc, port = _start(name, ports["prefill"] if pd else None, ports["decode"], args)
                    try:
                        ttft1 = [x[0] for x in asyncio.run(rb._sequential(port, args.requests))]
                        r.ttft1_added_ms.append(_p50(ttft1) - direct[flow, 1])
                        r.ttft32_ms.append(_p50(asyncio.run(_load(port, args.requests, 32, True))))
                    finally:
                        rb._stop(proc)
                    print(
                        f"round {rnd + 1} {flow:12} {name:14} cpu/req stream {cpu:7.0f} µs  "
                        f"{rps:6.0f} req/s  ttft1 added {r.ttft1_added_ms[-1]:5.2f} ms  "
                        f"ttft@32 {r.ttft32_ms[-1]:6.1f} ms",
                        flush=True,
                    )
    finally:
        for m in mocks:
            m.terminate()
    print(
        f"\n{args.tokens} tokens per stream, saturation at concurrency {args.concurrency} "
        f"({args.saturation_requests} requests), TTFT with {args.delay_ms} ms mock token delay; "
        f"{os.cpu_count()} cores shared by routers, mocks and load generator; medians of {args.rounds} rounds\n"
    )
    print(
        "| flow | router | CPU/req streamed (µs) | CPU/req non-streamed (µs) | streamed req/s | "
        "events/s per router core | added TTFT p50 @1 (ms) | TTFT p50 @32 (ms) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    med = statistics.median
    for flow in ("pass-through", "P/D"):
        for name in names:
            r = results[name, flow]
            print(
                f"| {flow} | {name} | {med(r.cpu_us_stream):,.0f} | {med(r.cpu_us_unary):,.0f} | "
                f"{med(r.rps_stream):,.0f} | {med(r.events_per_core_s):,.0f} | {med(r.ttft1_added_ms):.2f} | "
                f"{med(r.ttft32_ms):.1f} |"
            )
    return 0
