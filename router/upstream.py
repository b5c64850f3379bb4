"""One call to one worker, with the router's failure accounting around it.

`Upstream.open` returns a response whose status is known and whose body is still unread, so the
caller can decide (pass through, retry elsewhere) before a byte goes to the client.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import anyio
import httpx

from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import Worker, WorkerSet

log = logging.getLogger("pdserve.router")

# Connection-level failures: the worker is down or died; another worker may do better.
TRANSPORT_ERRORS = (httpx.TransportError,)


@dataclass
class Attempt:
    """How one call ended: a response to use, or why another worker should be tried."""

    worker: Worker
    response: httpx.Response | None = None
    retryable: bool = False
    reason: str = ""


class Upstream:
    def __init__(self, client: httpx.AsyncClient, workers: WorkerSet, metrics: RouterMetrics):
        self.client = client
        self.workers = workers
        self.metrics = metrics

    @contextlib.contextmanager
    def track(self, worker: Worker):
        worker.inflight += 1
        self.metrics.inflight.labels(worker.url).set(worker.inflight)
        try:
            yield
        finally:
            worker.inflight -= 1
            self.metrics.inflight.labels(worker.url).set(worker.inflight)

    def failed(self, worker: Worker, phase: str, reason: str) -> None:
        self.metrics.upstream_errors.labels(worker.url, phase).inc()
        if self.workers.record_failure(worker):
            log.warning("ejected %r after %d failures (last: %s)", worker, worker.consecutive_failures, reason)

    async def open(self, worker: Worker, path: str, body: bytes, headers: dict[str, str],
                   timeout: httpx.Timeout, phase: str) -> Attempt:
        """POST and wait for the status line. 5xx and transport errors are retryable failures;
        429 is retryable without blaming the worker; other statuses are final answers."""
        request = self.client.build_request("POST", worker.url + path, content=body, headers=headers,
                                            timeout=timeout)
        try:
            response = await self.client.send(request, stream=True)
        except TRANSPORT_ERRORS as e:
            self.failed(worker, phase, repr(e))
            return Attempt(worker, retryable=True, reason=f"{type(e).__name__}: {e}")
        if response.status_code >= 500 or response.status_code == 429:
            content = await self.read_and_close(response)
            reason = f"{response.status_code}: {content[:200].decode(errors='replace')}"
            if response.status_code != 429:
                self.failed(worker, phase, reason)
            return Attempt(worker, response=response, retryable=True, reason=reason)
        return Attempt(worker, response=response)

    @staticmethod
    async def read_and_close(response: httpx.Response) -> bytes:
        try:
            return await response.aread()
        except TRANSPORT_ERRORS:
            return b""
        finally:
            await close(response)


async def close(response: httpx.Response | None) -> None:
    """Close an upstream response even while our task is being cancelled (client disconnect):
    closing the connection is what tells the worker to abort and free the request's KV."""
    if response is None:
        return
    with anyio.CancelScope(shield=True):
        await response.aclose()
