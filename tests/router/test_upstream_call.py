"""The upstream call context in isolation: every worker it acquires is released exactly once,
on success, on retry, when every worker failed, and when the task is cancelled mid-call (a
client hanging up). The HTTP call itself is replaced by a scripted `post`; the real-process
version of the hang-up case is test_failures.py::test_client_gone_during_handoff_releases_every_worker."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.metrics import RouterMetrics
from pdserve.router.upstream import Attempt, Upstream, timeout
from pdserve.router.upstream_call import UpstreamCall
from pdserve.router.workers import Worker, WorkerSet

LIMITS = timeout(10.0, 1.0)


class FakeResponse:
    def __init__(self, status: int):
        self.status = status
        self.closed = False

    def close(self):
        self.closed = True

    release = close

    class content:  # noqa: N801 (mimics aiohttp's attribute)
        @staticmethod
        def at_eof() -> bool:
            return False


class ScriptedUpstream(Upstream):
    """`post` answers from a script: worker URL -> status, or "hang" (waits forever)."""

    def __init__(self, script: dict[str, int | str]):
        super().__init__(session=None, workers=WorkerSet(3, 1.0, 30.0), metrics=RouterMetrics())
        self.script = script
        self.posted: list[str] = []

    async def post(self, worker, path, body, headers, limits, phase) -> Attempt:
        self.posted.append(worker.url)
        outcome = self.script[worker.url]
        if outcome == "hang":
            await asyncio.Event().wait()
        if outcome >= 500:
            self.failed(worker, phase, str(outcome))
            return Attempt(worker, response=FakeResponse(outcome), retryable=True, reason=str(outcome))
        return Attempt(worker, response=FakeResponse(outcome))


def pool(n: int) -> list[Worker]:
    return [Worker(f"http://w{i}:1", "decode") for i in range(n)]


def first(ws):
    return ws[0]


def test_retries_past_a_5xx_and_releases_both():
    workers = pool(2)
    up = ScriptedUpstream({"http://w0:1": 500, "http://w1:1": 200})

    async def run():
        async with UpstreamCall(up, "decode", workers, first, max_retries=2) as call:
            response = await call.open("/p", b"", {}, LIMITS)
            assert response.status == 200 and call.worker is workers[1]
            assert [w.inflight for w in workers] == [0, 1]
            call.succeeded()
        return response

    response = asyncio.run(run())
    assert [w.inflight for w in workers] == [0, 0] and response.closed
    assert up.posted == ["http://w0:1", "http://w1:1"]
    assert workers[0].consecutive_failures == 1 and workers[1].consecutive_failures == 0


@pytest.mark.parametrize("retries,posted", [(0, 1), (1, 2), (5, 3)])
def test_gives_up_after_max_retries_or_when_no_worker_is_left(retries, posted):
    workers = pool(3)
    up = ScriptedUpstream({w.url: 503 for w in workers})

    async def run():
        async with UpstreamCall(up, "prefill", workers, first, max_retries=retries) as call:
            assert await call.open("/p", b"", {}, LIMITS) is None
            return call

    call = asyncio.run(run())
    assert len(up.posted) == posted and call.last_status == 503 and call.attempts == posted
    assert all(w.inflight == 0 for w in workers)


def test_retry_elsewhere_counts_a_failure_and_moves_on():
    workers = pool(2)
    up = ScriptedUpstream({w.url: 200 for w in workers})

    async def run():
        async with UpstreamCall(up, "prefill", workers, first, max_retries=1) as call:
            await call.open("/p", b"", {}, LIMITS)
            call.retry_elsewhere("malformed answer")
            assert [w.inflight for w in workers] == [0, 0]
            await call.open("/p", b"", {}, LIMITS)
            assert call.worker is workers[1] and workers[1].inflight == 1
            assert await call.open("/p", b"", {}, LIMITS) is None  # retries spent

    asyncio.run(run())
    assert workers[0].consecutive_failures == 1 and [w.inflight for w in workers] == [0, 0]


def test_cancelled_mid_call_releases_the_worker():
    workers = pool(1)
    up = ScriptedUpstream({"http://w0:1": "hang"})

    async def run():
        async def handoff():
            async with UpstreamCall(up, "decode", workers, first, max_retries=0) as call:
                await call.open("/p", b"", {}, LIMITS)

        task = asyncio.create_task(handoff())
        while not up.posted:
            await asyncio.sleep(0)
        assert workers[0].inflight == 1
        task.cancel()  # what the app does when the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert workers[0].inflight == 0


def test_non_streaming_decode_gets_what_is_left_of_the_request_budget():
    import time

    from pdserve.router.config import RouterConfig
    from pdserve.router.call import Call
    from pdserve.router.orchestrator import Orchestrator
    from pdserve.protocol.requests import CompletionRequest
    from pdserve.router.policies import RoutingRequest

    config = RouterConfig(decode_urls=("http://d:1",), request_timeout_s=10.0)
    orch = Orchestrator(config, ScriptedUpstream({}), selector=None)
    request = CompletionRequest(model="m", prompt="x")
    call = Call("completions", request, b"", "id", RoutingRequest(request), started=time.monotonic() - 4.0)
    assert orch.prefill_limits.total == 10.0
    assert 5.0 < orch.unary_limits(call).total <= 6.0  # 10 s for the whole request, 4 already spent
    assert orch.stream_limits.total is None  # streams: first-byte and idle bounds instead
