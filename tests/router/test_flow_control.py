"""Flow control (router/flow_control/) with real processes: one router with one slot
(`--flow-control-max-inflight 1`) in front of a fake worker that holds every answer until told
(its "answer" gate), so what waits in the router's queue, and in which order it reaches the
worker once released, is seen from outside: the worker's request log and the router's metrics."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from tests.helpers.metrics import metric
from tests.router.test_failures import eventually

MAX_QUEUE = 4
# Per tenant: the tests' anonymous requests stay far below it (3 tokens each, plus the prompt).
TOKENS_PER_MINUTE = 1000


@pytest.fixture(scope="module")
def stack(module_launch):
    worker = module_launch.fake_worker("--model", "tiny")
    router = module_launch.router("--decode", worker.url, "--flow-control-max-inflight", "1",
                                  "--flow-control-max-queue", str(MAX_QUEUE), "--flow-control-queue-timeout", "120",
                                  "--flow-control-bands", "-1", "0", "1",
                                  "--flow-control-tenant-tokens-per-minute", str(TOKENS_PER_MINUTE))
    return worker, router


def body(prompt: str, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}


class Client:
    """Requests sent on threads, their answers kept by prompt."""

    def __init__(self, router) -> None:
        self.router, self.answers, self.threads = router, {}, []

    def send(self, prompt: str, headers: dict | None = None, **extra) -> None:
        def run() -> None:
            self.answers[prompt] = httpx.post(self.router.url + "/v1/completions", json=body(prompt, **extra),
                                              headers=headers or {}, timeout=120)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads)


def queued(router) -> float:
    return metric(router, "pdserve_router_flow_queue_depth")


def arrived(worker, since: int) -> list[str]:
    """Prompts the worker received after its first `since` requests, in order."""
    return [r["body"]["prompt"] for r in worker.requests()[since:]]


def occupy(worker, router, client: Client, prompt: str, headers: dict | None = None) -> int:
    """Hold the worker's answers and take the router's one slot with `prompt`; returns the
    worker's request count before it."""
    worker.control(hold="answer")
    before = len(worker.requests())
    client.send(prompt, headers)
    eventually(lambda: arrived(worker, before) == [prompt])
    return before


def test_a_more_urgent_band_overtakes_queued_requests(stack):
    worker, router = stack
    client = Client(router)
    before = occupy(worker, router, client, "band-first")
    client.send("band-low-1", priority=1)
    eventually(lambda: queued(router) == 1)
    client.send("band-low-2", priority=1)
    eventually(lambda: queued(router) == 2)
    client.send("band-urgent", {"x-pdserve-priority": "-1"})  # by header: the workers are sent it too
    eventually(lambda: queued(router) == 3)
    worker.control(release=True)
    client.join()
    assert all(r.status_code == 200 for r in client.answers.values())
    assert arrived(worker, before) == ["band-first", "band-urgent", "band-low-1", "band-low-2"]
    sent = {r["body"]["prompt"]: r["body"] for r in worker.requests()[before:]}
    assert sent["band-urgent"]["priority"] == -1 and sent["band-low-1"]["priority"] == 1
    assert metric(router, "pdserve_router_flow_dispatched_total", band="-1") >= 1
    assert metric(router, "pdserve_router_flow_queue_wait_seconds_count", band="1") >= 2


def test_a_flooding_tenant_does_not_starve_a_quiet_one(stack):
    worker, router = stack
    client = Client(router)
    noisy, quiet = {"x-gateway-inference-fairness-id": "noisy"}, {"x-gateway-inference-fairness-id": "quiet"}
    before = occupy(worker, router, client, "fair-noisy-0", noisy)
    for i in range(1, 4):
        client.send(f"fair-noisy-{i}", noisy)
        eventually(lambda: queued(router) == i)
    client.send("fair-quiet", quiet)  # last in, but its tenant has had nothing yet
    eventually(lambda: queued(router) == 4)
    assert metric(router, "pdserve_router_flow_queue_depth", tenant="noisy") == 3
    worker.control(release=True)
    client.join()
    order = arrived(worker, before)
    assert order == ["fair-noisy-0", "fair-noisy-1", "fair-quiet", "fair-noisy-2", "fair-noisy-3"]


def test_a_full_queue_refuses_with_429_and_retry_after(stack):
    worker, router = stack
    client = Client(router)
    before = occupy(worker, router, client, "full-first")
    for i in range(MAX_QUEUE):
        client.send(f"full-{i}", priority=0)
        eventually(lambda: queued(router) == i + 1)
    over = httpx.post(router.url + "/v1/completions", json=body("full-over", priority=0), timeout=30)
    assert over.status_code == 429 and over.headers["retry-after"].isdigit()
    assert over.json()["error"]["code"] == "queue_full" and over.json()["error"]["type"] == "rate_limit_error"
    # A more urgent request takes the place of the newest of the least urgent band.
    client.send("full-urgent", priority=-1)
    eventually(lambda: "full-3" in client.answers)
    displaced = client.answers["full-3"]
    assert displaced.status_code == 429 and displaced.json()["error"]["code"] == "displaced"
    assert "retry-after" in displaced.headers
    assert queued(router) == MAX_QUEUE
    worker.control(release=True)
    client.join()
    assert arrived(worker, before) == ["full-first", "full-urgent", "full-0", "full-1", "full-2"]
    assert metric(router, "pdserve_router_flow_rejected_total", reason="queue_full") == 1
    assert metric(router, "pdserve_router_flow_rejected_total", reason="displaced") == 1
    eventually(lambda: metric(router, "pdserve_router_flow_inflight") == 0)


def test_a_client_that_leaves_while_queued_leaves_the_queue(stack):
    worker, router = stack
    client = Client(router)
    before = occupy(worker, router, client, "gone-first")
    payload = httpx.Request("POST", router.url + "/v1/completions", json=body("gone-left"))
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in payload.headers.items())
        s.sendall(f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode() + payload.read())
        eventually(lambda: queued(router) == 1)
    eventually(lambda: queued(router) == 0)
    client.send("gone-after")
    eventually(lambda: queued(router) == 1)
    worker.control(release=True)
    client.join()
    assert arrived(worker, before) == ["gone-first", "gone-after"]


def test_a_tenant_over_its_token_rate_gets_429(stack):
    worker, router = stack
    heavy = {"x-gateway-inference-fairness-id": "heavy"}
    first = httpx.post(router.url + "/v1/completions", json=body("rate-1", max_tokens=2 * TOKENS_PER_MINUTE),
                       headers=heavy, timeout=30)
    assert first.status_code == 200  # a full bucket lets one large request through; it owes a minute
    second = httpx.post(router.url + "/v1/completions", json=body("rate-2"), headers=heavy, timeout=30)
    assert second.status_code == 429 and second.json()["error"]["code"] == "tenant_token_rate"
    assert int(second.headers["retry-after"]) >= 1
    other = httpx.post(router.url + "/v1/completions", json=body("rate-3"), timeout=30)
    assert other.status_code == 200  # another tenant's bucket is its own
    assert metric(router, "pdserve_router_flow_rejected_total", tenant="heavy", reason="tenant_token_rate") == 1


@pytest.mark.parametrize("extra,headers,param", [
    ({"priority": 7}, {}, "priority"),
    ({"priority": "1"}, {}, "priority"),
    ({}, {"x-pdserve-priority": "urgent"}, "x-pdserve-priority"),
    ({}, {"x-pdserve-priority": "5"}, "x-pdserve-priority"),
    ({}, {"x-gateway-inference-fairness-id": "has space"}, "x-gateway-inference-fairness-id"),
    ({}, {"x-gateway-inference-fairness-id": "x" * 129}, "x-gateway-inference-fairness-id"),
])
def test_bad_priority_or_tenant_is_a_400(stack, extra, headers, param):
    _, router = stack
    r = httpx.post(router.url + "/v1/completions", json=body("bad", **extra), headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_stream_holds_its_slot_until_it_ends(stack):
    worker, router = stack
    worker.control(release=True, delay=0.05)
    try:
        with httpx.stream("POST", router.url + "/v1/completions", json=body("stream-1", stream=True, max_tokens=200),
                          headers={"x-gateway-inference-fairness-id": "streamer"}, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert metric(router, "pdserve_router_flow_inflight") == 1  # mid-stream: still held
        # The client left mid-stream: the slot comes back.
        eventually(lambda: metric(router, "pdserve_router_flow_inflight") == 0)
        done = httpx.post(router.url + "/v1/completions", json=body("stream-2", stream=True), timeout=30)
        assert done.status_code == 200 and done.text.rstrip().endswith("[DONE]")
        eventually(lambda: metric(router, "pdserve_router_flow_inflight") == 0)
    finally:
        worker.control(delay=0.005)
