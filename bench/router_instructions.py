"""pdserve's router against a baseline tree in instructions per request (not a test).

    pdserve bench router --instructions 300 [--baseline-src DIR] [--rounds 2] [--unary]

CPU time on a shared machine moves by 1.5x between runs of identical code, so a change of a few
percent never shows in `--peers`. Instructions do not move with the load: each router runs under
callgrind (valgrind, which this needs) with instrumentation off, takes warm-up requests, then
counts its user-space instructions over N streamed requests (non-streamed ones with --unary) at
concurrency 16 against the same mock workers (bench/router_mock.py, no token delay), with no
health probes meanwhile; the floor (bench/bare_proxy.py) is counted beside it. System calls are
not counted. The Rust peers are left out: their CPU is in threads and the kernel more than in
user-space instructions.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from pdserve.bench import router_mock as rb
from pdserve.bench import router_peers as rp
from pdserve.cli.stack import free_port

WARM_UP = 100
CONCURRENCY = 16


def _count(name: str, pd: bool, ports: dict, n: int, args, out_dir: str) -> float:
    """Instructions per request of one router process (`name`: pdserve, baseline or bare-python)."""
    port = free_port()
    argv, env = rp._argv(name, port, ports["prefill"] if pd else None, ports["decode"], args)
    # No health probes in the counted window: they are not per request, and under valgrind a
    # probe can outlast its timeout and take a worker out of the pool mid-count.
    argv += ["--probe-interval", "3600", "--connect-timeout", "30"]
    out = os.path.join(out_dir, f"{name}-{'pd' if pd else 'pass'}-{time.monotonic_ns()}.out")
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300  # slower to start under valgrind
        while True:
            try:
                asyncio.run(rb.Conn(port).post("/v1/completions", rb._body(True)))
                break
            except (OSError, RuntimeError, asyncio.IncompleteReadError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not come up under valgrind ({argv})")
                time.sleep(0.5)
        stream = not args.unary
        asyncio.run(rp._load(port, WARM_UP, CONCURRENCY, stream))
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        asyncio.run(rp._load(port, n, CONCURRENCY, stream))
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
    finally:
        proc.send_signal(2)  # callgrind writes its counts as the process exits
        proc.wait(timeout=120)
    with open(out) as f:
        for line in f:
            if line.startswith("totals:"):
                return int(line.split()[1]) / n
    raise RuntimeError(f"no totals in {out}")


def run(args) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("--instructions needs valgrind (callgrind): not installed")
        return 2
    names = ["pdserve"] + (["baseline"] if args.baseline_src else []) + [rp.BARE]
    ctx = multiprocessing.get_context("spawn")
    ports = {n: free_port() for n in ("prefill", "decode")}
    mocks = [ctx.Process(target=rb._mock_worker, args=(ports[n], args.tokens, 0.0), daemon=True) for n in ports]
    for m in mocks:
        m.start()
    for port in ports.values():
        rb._wait(port)
    counts: dict[tuple[str, str], list[float]] = {}
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            for rnd in range(args.rounds):
                for flow in ("pass-through", "P/D"):
                    for name in names if rnd % 2 == 0 else reversed(names):
                        ipr = _count(name, flow == "P/D", ports, args.instructions, args, out_dir)
                        counts.setdefault((flow, name), []).append(ipr)
                        print(f"round {rnd + 1} {flow:12} {name:9} {ipr:12,.0f} instructions/request", flush=True)
    finally:
        for m in mocks:
            m.terminate()
    print(
        f"\n{args.instructions} {'non-streamed' if args.unary else 'streamed'} requests at concurrency {CONCURRENCY}, "
        f"{args.tokens} events each; "
        f"user-space instructions (callgrind), medians of {args.rounds} rounds\n"
    )
    baseline = "baseline" in names
    print("| flow | " + " | ".join(names) + (" | pdserve / baseline |" if baseline else " |"))
    print("|---|" + "---:|" * (len(names) + baseline))
    med = statistics.median
    for flow in ("pass-through", "P/D"):
        cells = [f"{med(counts[flow, n]):,.0f}" for n in names]
        if baseline:
            cells.append(f"{med(counts[flow, 'pdserve']) / med(counts[flow, 'baseline']):.3f}")
        print(f"| {flow} | " + " | ".join(cells) + " |")
    return 0
