"""Fault tests with real processes: the children of `pdserve up` (1 prefill, 2 decode, router;
default model, CPU, TCP KV transfer) started one by one so each fault hits one process.

Every scenario checks the same promises: each request completes or ends with a typed error
(HTTP error JSON, or an SSE error event then [DONE]); none is still open when the client's
60 s timeout fires (that would count as broken); the stack serves afterwards; every live
worker's free blocks return to their start value with nothing pinned. The table of results is
printed at the end of the module (run with -s, or see the terminal summary).
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.net import free_port
from e2e.outcomes import Outcome, stream_request, unary_request
from e2e.processes import Stack, eventually
from pdserve.cli.stack import StackConfig

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
# Router timeouts short enough that a hung (SIGSTOPped) worker costs seconds, yet long enough
# for a decode worker's first byte on 2 busy CPU cores (--first-byte-timeout): when the prefill
# worker is gone, that byte waits for the KV pull to time out and a local prefill. A short pin TTL releases KV that
# a lost decode never pulls within the test; a short pull timeout bounds a dead prefill's cost.
ROUTER_ARGS = ("--request-timeout", "30", "--first-byte-timeout", "30", "--stream-idle-timeout", "15",
               "--connect-timeout", "1",
               "--probe-interval", "0.2", "--eject-backoff", "0.5")
WORKER_ARGS = ("--kv-cache-memory", str(256 << 20), "--max-model-len", "1024", "--kv-pin-ttl", "10",
               "--kv-pull-timeout", "3")


@pytest.fixture(scope="module")
def results(request):
    rows: list[tuple] = []
    yield rows
    header = ("scenario", "requests", "faults injected", "completed", "typed errors", "broken", "blocks leaked")
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    lines += [" | ".join(str(c) for c in row) for row in rows]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\nfault-test results:\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def stack(default_model_dir, served_name, tmp_path_factory):
    config = StackConfig(prefill=1, decode=2, host="127.0.0.1", port=free_port(), device="cpu", kv_transfer="tcp",
                         worker_args=WORKER_ARGS, router_args=ROUTER_ARGS)
    s = Stack(config, default_model_dir, served_name, tmp_path_factory.mktemp("fault-stack"))
    try:
        yield s.start_all()
    finally:
        s.stop_all()


@pytest.fixture(autouse=True)
def whole_stack(stack):
    """Each scenario starts from the whole stack: a worker an earlier (failed) scenario left dead
    is restarted, so one failure does not cascade into the next scenarios."""
    dead = [n for n in stack.workers if not stack.alive(n)]
    for name in dead:
        stack.restart(name)
    if dead:
        roles = [c.role for c in stack.children.values()]
        stack.wait_router_sees(prefill=roles.count("prefill"), decode=roles.count("decode"))
    yield


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url("router") + "/v1", api_key="none", max_retries=0, timeout=60)


def record(results, stack, scenario: str, faults: str, outcomes: list[Outcome]) -> dict[str, int]:
    """Check the promises shared by every scenario and add the scenario's row to the table."""
    broken = [o for o in outcomes if o.kind == "broken"]
    assert not broken, broken
    leaks = eventually(stack.no_leaks, 40, "every live worker back to its starting free blocks, none pinned")
    counts = {k: sum(o.kind == k for o in outcomes) for k in ("completed", "error")}
    results.append((scenario, len(outcomes), faults, counts["completed"], counts["error"], len(broken),
                    sum(leaks.values())))
    return counts


def still_serves(client, served_name, n: int = 2) -> None:
    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda _: unary_request(client, served_name, QUESTION), range(n)))
    assert answers == [Outcome("completed", ANSWER)] * n


# Streams long enough to be still decoding when the test looks for a busy worker: with 24 tokens
# a starved test process (CI under load) once found every stream already finished.
LONG_STREAM = 128


def busy(stack, role: str) -> str:
    """The first worker of `role` that is decoding something right now."""
    def find():
        return next((n for n in stack.workers if stack.children[n].role == role and stack.alive(n)
                     and stack.kv(n)["num_running"] > 0), None)

    return eventually(find, 30, f"a {role} worker with running requests")


def start_streams(client, served_name, n: int, pool: ThreadPoolExecutor, **kw):
    progress = [threading.Event() for _ in range(n)]
    futures = [pool.submit(stream_request, client, served_name, i, progress=progress[i], **kw) for i in range(n)]
    return progress, futures


def test_kill_prefill_worker_with_requests_in_flight(stack, client, served_name, results):
    with ThreadPoolExecutor(8) as pool:
        # Long prompts keep the prefill worker busy; kill it the moment it holds requests.
        futures = [pool.submit(stream_request, client, served_name, i, 16, None, 60) for i in range(8)]
        deadline = time.monotonic() + 60
        while stack.kv("prefill-0")["num_running"] + stack.kv("prefill-0")["num_waiting"] == 0:
            assert time.monotonic() < deadline, "the prefill worker never had requests in flight"
        stack.signal("prefill-0", signal.SIGKILL)
        outcomes = [f.result() for f in futures]
    stack.wait_router_sees(prefill=0, decode=2)
    still_serves(client, served_name)  # no prefill worker: the decode workers prefill locally
    record(results, stack, "kill -9 prefill, requests in flight", "1 SIGKILL", outcomes)
    stack.restart("prefill-0")
    stack.wait_router_sees(prefill=1, decode=2)


def signal_a_busy_decoder(stack, client, served_name, pool, n: int, sig: int):
    """`n` long streams on `pool`; once every one streams, `sig` to a decode worker serving some.
    -> (that worker, the streams' futures)."""
    streaming, futures = start_streams(client, served_name, n, pool, max_tokens=LONG_STREAM)
    for e in streaming:
        assert e.wait(60)
    victim = busy(stack, "decode")
    stack.signal(victim, sig)
    return victim, futures


def test_kill_decode_worker_mid_stream(stack, client, served_name, results):
    with ThreadPoolExecutor(8) as pool:
        victim, futures = signal_a_busy_decoder(stack, client, served_name, pool, 8, signal.SIGKILL)
        outcomes = [f.result() for f in futures]
    # Its streams move to the other decode worker mid-answer (router/migration.py): every one ends
    # whole, at max_tokens, none with an error event.
    assert all(o.kind == "completed" and o.detail == "length" for o in outcomes), (victim, outcomes)
    stack.wait_router_sees(prefill=1, decode=1)  # the router ejects the dead worker
    still_serves(client, served_name, 4)
    record(results, stack, f"kill -9 {victim} mid-stream", "1 SIGKILL", outcomes)
    stack.restart(victim)
    stack.wait_router_sees(prefill=1, decode=2)


def test_bulk_client_disconnects(stack, client, served_name, results):
    body = {"model": served_name, "max_tokens": 24, "ignore_eos": True, "stream": True}

    def leave_early(i: int) -> Outcome:
        url = stack.url("router") + ("/v1/chat/completions" if i % 2 else "/v1/completions")
        req = (
            dict(body, messages=[{"role": "user", "content": f"story {i}"}])
            if i % 2
            else dict(body, prompt=f"story {i}")
        )
        if i % 8 == 7:  # a non-streamed request the client abandons before the answer
            req["stream"] = False
            try:
                httpx.post(url, json=req, timeout=httpx.Timeout(60, read=0.5))
            except httpx.ReadTimeout:
                return Outcome("completed", "client left (unary)")
            return Outcome("completed", "answered before the client left")
        with httpx.stream("POST", url, json=req, timeout=60) as r:
            assert r.status_code == 200
            for seen, _ in enumerate(r.iter_lines()):
                if seen >= i % 5:
                    break
        return Outcome("completed", "client left (stream)")

    with ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(leave_early, range(32)))
    record(results, stack, "32 clients disconnect mid-request", "32 disconnects", outcomes)
    assert all(stack.kv(n)["num_running"] == 0 for n in stack.workers)
    still_serves(client, served_name)


def test_sigstopped_decode_worker(stack, client, served_name, results):
    with ThreadPoolExecutor(10) as pool:
        victim, futures = signal_a_busy_decoder(stack, client, served_name, pool, 6, signal.SIGSTOP)
        try:
            # While it hangs, new requests still complete (retried elsewhere after a timeout, or
            # sent elsewhere once the prober ejects it).
            later = [pool.submit(unary_request, client, served_name, QUESTION) for _ in range(4)]
            outcomes = [f.result() for f in futures]
            assert [f.result() for f in later] == [Outcome("completed", ANSWER)] * 4
        finally:
            stack.signal(victim, signal.SIGCONT)
    # Stalled past --stream-idle-timeout, its streams move to the other decode worker: each ends whole.
    assert all(o.kind == "completed" and o.detail == "length" for o in outcomes), (victim, outcomes)
    stack.wait_router_sees(prefill=1, decode=2)  # back in the pool once it answers probes again
    record(
        results, stack, f"SIGSTOP {victim} mid-stream, then SIGCONT", "1 SIGSTOP", outcomes + [Outcome("completed")] * 4
    )
    still_serves(client, served_name, 4)
