"""A stream is counted before its client can see the end: a scrape of the router's /metrics made
right after a client read `[DONE]` includes that request, every time, and no stream is counted
twice (issue 23, CI determinism: `pdserve bench serve` scraped 15 of 16 right after its run).

The ordering is checked where it is decided, driving the router's stream response as an ASGI
app and reading the counter at the moment each body message is handed to the transport: that
fails on every run where the count waits for the stream's close. The real-process loop then
checks the same thing the way a client sees it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pdserve.protocol.requests import CompletionRequest
from pdserve.protocol.responses_api import from_chat
from pdserve.protocol.sse import DONE
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.call import Call
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.policies import RoutingRequest
from pdserve.router.upstream import Upstream
from pdserve.router.workers import WorkerSet
from tests.helpers.metrics import metric_value

COUNTER = "pdserve_router_requests_total"


def orchestrator() -> Orchestrator:
    metrics = RouterMetrics()
    upstream = Upstream(session=None, workers=WorkerSet(3, 1.0, 30.0), metrics=metrics)
    return Orchestrator(RouterConfig(decode_urls=("http://127.0.0.1:1",)), upstream, selector=None)


def call(route: str = "completions") -> Call:
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    request = CompletionRequest.model_validate(body)
    return Call(route, request, json.dumps(body).encode(), "rid", RoutingRequest(request, None, None), time.monotonic())


def counts(o: Orchestrator, route: str = "completions") -> tuple[float, float]:
    """(requests counted as 200, e2e observations)."""
    r = o.metrics.registry
    return (r.get_sample_value(COUNTER, {"route": route, "status": "200", "disaggregated": "no"}) or 0.0,
            r.get_sample_value("pdserve_router_e2e_latency_seconds_count") or 0.0)


def chunk(text: str, finish: str | None = None) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]}).encode() + b"\n\n"


async def events(parts: list[bytes], then_wait: asyncio.Event | None = None):
    for p in parts:
        yield p
    if then_wait is not None:  # a decode worker that goes quiet mid-stream
        await then_wait.wait()


async def serve(response, o: Orchestrator, route: str = "completions", leave_after: int | None = None):
    """Run the response as an ASGI app. Returns [(body, counts at the moment it was sent)]; with
    `leave_after`, the client disconnects once that many body messages were sent."""
    sent: list[tuple[bytes, tuple[float, float]]] = []
    gone = asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.body":
            sent.append((message.get("body", b""), counts(o, route)))
            if leave_after is not None and len(sent) >= leave_after:
                gone.set()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    await response({"type": "http", "method": "POST", "path": "/", "headers": []}, receive, send)
    return sent


def test_a_stream_is_counted_before_its_done_is_handed_to_the_transport():
    o = orchestrator()
    response = o.stream_response(call(), events([chunk("a"), chunk("b", "length") + DONE]))
    sent = asyncio.run(serve(response, o))
    bodies = [b for b, _ in sent if b]
    assert bodies[-1].endswith(DONE)
    at_done = next(c for b, c in sent if b.endswith(DONE))
    assert at_done == (1, 1)  # on base 3b536ee: (0, 0), counted only after the last byte went out
    assert [c for b, c in sent if b and not b.endswith(DONE)] == [(0, 0)]  # not before the end
    assert counts(o) == (1, 1)  # and not again when the response closes


def test_a_responses_stream_is_counted_before_its_last_event():
    """/v1/responses maps the chat stream: its closing events come after the chat [DONE] was read."""
    o = orchestrator()
    body = {"model": "tiny", "input": "hi", "stream": True}
    chat = [b'data: {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "length"}]}\n\n', DONE]
    response = from_chat(o.stream_response(call("chat"), events(chat)), body)
    sent = asyncio.run(serve(response, o, route="chat"))
    last = [(b, c) for b, c in sent if b][-1]
    assert b"response.incomplete" in last[0] and last[1] == (1, 1)
    assert counts(o, "chat") == (1, 1)


def test_a_client_that_leaves_mid_stream_is_counted_once():
    o = orchestrator()
    quiet = asyncio.Event()  # never set: the stream would wait forever without the hang-up
    response = o.stream_response(call(), events([chunk("a")], then_wait=quiet))
    sent = asyncio.run(asyncio.wait_for(serve(response, o, leave_after=1), 30))
    assert sent[0][1] == (0, 0)
    assert counts(o) == (1, 1)  # counted at close, as the 200 it was sent


# ---- the same, as a client sees it ------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(module_launch):
    prefill = module_launch.fake_worker("--delay", "0")
    decode = module_launch.fake_worker("--delay", "0")
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url)
    return router


def _router_count(text: str) -> float:
    return metric_value(text, COUNTER, status="200")


def test_a_scrape_right_after_done_counts_every_stream(stack):
    """Each stream is read to [DONE], then /metrics is scraped at once: the count is exact every
    time. (Streams through the P/D path and straight to a decode worker alike.)"""
    router = stack
    with httpx.Client(base_url=router.url, timeout=30) as client:
        base = _router_count(client.get("/metrics").text)
        for i in range(30):
            route, body = (("/v1/completions", {"prompt": "the quick brown fox " * 4}) if i % 2 == 0 else
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a fox"}]}))
            with client.stream("POST", route, json={"model": "tiny", "max_tokens": 4, "stream": True, **body}) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert _router_count(client.get("/metrics").text) == base + i + 1, f"stream {i}"
