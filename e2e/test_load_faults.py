"""Load with a fault mix (issue 15): the children of `pdserve up` (1 prefill, 2 decode, router;
tiny random-weight checkpoint, CPU, TCP KV transfer) under 2,000 short requests (4 tokens;
chat and completions, streamed and not) after a 300-request warm-up, 8 at a time, while
decode-1 is SIGKILLed and started again on the same ports (at 10% of the requests), prefill-0
and then decode-0 are SIGSTOPped for 3 s (at 35% and 60%), and every tenth client hangs up
mid-stream; then 100 more requests once decode-1 is back. About a minute on 2 cores.

Promises checked at the end: no request is broken (each completed, or ended with OpenAI's
error JSON / one SSE error event then [DONE]); no 500 from the router; every live worker's
blocks are back (0 leaked) with 0 pinned once the pin TTL has passed; the router's in-flight
count is 0 on every worker (`/debug/workers`); the RSS of the processes that ran throughout
(router, prefill-0, decode-0) grew by less than 10% from after the warm-up to the end. The
figures are printed as a table (run with -s).
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.net import free_port
from e2e.processes import Stack, eventually
from pdserve.cli.stack import StackConfig

pytestmark = pytest.mark.slow

MODEL = "tiny"
WARMUP, REQUESTS, CONCURRENCY = 300, 2000, 8
ROUTER_ARGS = ("--request-timeout", "10", "--first-byte-timeout", "10", "--stream-idle-timeout", "5",
               "--connect-timeout", "1", "--probe-interval", "0.2", "--eject-backoff", "0.5")
WORKER_ARGS = ("--max-model-len", "256", "--kv-cache-memory", str(16 << 20), "--kv-pin-ttl", "5",
               "--kv-pull-timeout", "2")


@pytest.fixture(scope="module")
def stack(tiny_checkpoint, tmp_path_factory):
    config = StackConfig(prefill=1, decode=2, host="127.0.0.1", port=free_port(), device="cpu", kv_transfer="tcp",
                         worker_args=WORKER_ARGS, router_args=ROUTER_ARGS)
    s = Stack(config, tiny_checkpoint("llama"), MODEL, tmp_path_factory.mktemp("load-stack"))
    try:
        yield s.start_all()
    finally:
        s.stop_all()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def one_request(http: httpx.Client, url: str, i: int) -> str:
    """The outcome's kind: "ok", "disconnect" (ours, on purpose), "http <status> <code>",
    "sse-error <code>", or "broken: ..." (never allowed)."""
    chat, stream, hang_up = i % 2 == 0, i % 3 != 0, i % 10 == 7
    words = " ".join(f"w{i}-{k}" for k in range(random.Random(i).randint(3, 12)))
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": stream or hang_up}
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        with http.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                r.read()
                try:
                    err = r.json()["error"]
                    return f"http {r.status_code} {err.get('code') or err['type']}"
                except (ValueError, KeyError, TypeError):
                    return f"broken: untyped {r.status_code} {r.text[:200]!r}"
            if not body["stream"]:
                r.read()
                return "ok" if r.json()["choices"] else "broken: no choices"
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if hang_up:
                        return "disconnect"  # leaving the block closes the connection mid-stream
            if not events or events[-1] != "[DONE]":
                return f"broken: stream without [DONE] ({events[-2:]})"
            for e in events[:-1]:
                obj = json.loads(e)
                if "error" in obj:
                    return f"sse-error {obj['error'].get('code') or obj['error']['type']}"
            return "ok"
    except httpx.HTTPError as e:
        return f"broken: {type(e).__name__}: {e}"


def run_load(stack: Stack, n: int, start: int, faults=None) -> Counter:
    """n requests, CONCURRENCY at a time; `faults(progress)` runs beside them, reading how many
    have finished from the one-element list `progress`."""
    url = stack.url("router")
    outcomes: Counter = Counter()
    progress = [0]
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as http:
        fault_thread = threading.Thread(target=faults, args=(progress,), daemon=True) if faults else None
        if fault_thread:
            fault_thread.start()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            for kind in pool.map(lambda i: one_request(http, url, i), range(start, start + n)):
                outcomes[kind] += 1
                progress[0] += 1
        progress[0] = n
        if fault_thread:
            fault_thread.join(120)
    return outcomes


def leaked(stack: Stack) -> dict[str, int]:
    """Per live worker: blocks not free (a fresh engine's are all free) plus pinned ones."""
    out = {}
    for name in [n for n in stack.workers if stack.alive(n)]:
        kv = stack.kv(name)
        out[name] = kv["num_total_blocks"] - kv["num_free_blocks"] + kv["num_pinned_blocks"]
    return out


def test_load_with_faults_leaks_nothing(stack):
    started = time.monotonic()
    warm = run_load(stack, WARMUP, 0)
    assert warm["ok"] + warm["disconnect"] == WARMUP, warm
    steady = ("router", "prefill-0", "decode-0")
    rss_before = {name: rss_kib(stack.procs[name].pid) for name in steady}
    faults_done: list[str] = []

    def faults(progress: list[int]) -> None:
        """At 10%: kill decode-1 and start it again on the same ports (it loads while the load
        goes on); at 35% and 60%: SIGSTOP prefill-0, then decode-0, for 3 s each."""
        for at, name, action in ((0.10, "decode-1", "kill"), (0.35, "prefill-0", "stop"), (0.60, "decode-0", "stop")):
            while progress[0] < at * REQUESTS:
                time.sleep(0.05)
            if action == "kill":
                stack.signal(name, signal.SIGKILL)
                stack.start(name)
            else:
                stack.signal(name, signal.SIGSTOP)
                time.sleep(3)
                stack.signal(name, signal.SIGCONT)
            faults_done.append(f"{action} {name} at {progress[0]}")

    outcomes = run_load(stack, REQUESTS, WARMUP, faults)
    load_s = time.monotonic() - started
    # The restarted worker is found again at its URL and serves.
    stack.wait_healthy("decode-1")
    stack.wait_router_sees(prefill=1, decode=2)
    after = run_load(stack, 100, WARMUP + REQUESTS)
    assert after["ok"] + after["disconnect"] == 100, after
    # Pins of prefills whose decode never came (killed, stopped, hung up) expire after the TTL.
    deadline = time.monotonic() + 30
    while any((leaks := leaked(stack)).values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    router = stack.url("router")
    eventually(lambda: all(w["inflight"] == 0 for w in httpx.get(router + "/debug/workers").json()), 15,
               "router in-flight counts back to 0")
    inflight = {w["url"]: w["inflight"] for w in httpx.get(router + "/debug/workers").json()}
    rss_after = {name: rss_kib(stack.procs[name].pid) for name in steady}
    metrics = httpx.get(router + "/metrics").text
    router_500 = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("pdserve_router_requests_total{") and 'status="500"' in line)
    kv = {name: stack.kv(name) for name in stack.workers}

    rows = [("requests (after warm-up)", REQUESTS), ("faults (at n requests done)", ", ".join(faults_done)),
            ("wall time, warm-up + load (s)", f"{load_s:.0f}"), ("then, after decode-1 is back", dict(after))]
    rows += [(f"outcome: {k}", v) for k, v in sorted(outcomes.items())]
    rows += [("router 500s", int(router_500)), ("leaked blocks", leaks),
             ("pinned blocks", {n: k["num_pinned_blocks"] for n, k in kv.items()}),
             ("router in-flight", inflight)]
    rows += [
        (
            f"RSS {n} (MiB) before → after",
            f"{rss_before[n] / 1024:.0f} → {rss_after[n] / 1024:.0f} "
            f"({(rss_after[n] / rss_before[n] - 1) * 100:+.1f}%)",
        )
        for n in steady
    ]
    print("\nload with faults (" + time.strftime("%Y-%m-%d") + "):\n" + "\n".join(f"| {a} | {b} |" for a, b in rows))

    assert not any(leaks.values()), (leaks, kv)
    assert len(faults_done) == 3, faults_done
    assert not [k for k in outcomes if k.startswith("broken")], outcomes
    assert router_500 == 0
    assert outcomes["ok"] > REQUESTS // 2, outcomes
    assert all(k["num_pinned_blocks"] == 0 for k in kv.values())
    for n in steady:
        assert rss_after[n] < rss_before[n] * 1.10, (n, rss_before[n], rss_after[n])
    for name in stack.workers:
        assert stack.alive(name), f"{name} died:\n{stack.log(name)[-3000:]}"
