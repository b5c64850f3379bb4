"""One call to one worker, with the router's failure accounting around it.

`Upstream.open` returns a response whose status is known and whose body is still unread, so the
caller can decide (pass through, retry elsewhere) before a byte goes to the client.

The generation path's client is the router's own HTTP/1.1 client (http1.py: keep-alive pools
per worker, one write per request, bodies relayed as they arrive): aiohttp's took about a
quarter of the router's CPU per request, and httpx measured 5-10x slower still (its pool scans
every connection per request; see docs/router.md). The aiohttp session stays for the calls off
that path (KV releases, peer prefix pins, probes, scrapes).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp

from pdserve.protocol.contract import HEADER_REQUEST_FAILED, PATH_KV_RELEASE
from pdserve.router.http1 import Client, UpstreamConnectionError, UpstreamResponse
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import Worker, WorkerSet

log = logging.getLogger("pdserve.router")


class StreamBroken(Exception):
    """The worker's stream ended without its `[DONE]`."""


# Connection-level failures: the worker is down, died or stalled; another worker may do better.
UPSTREAM_ERRORS = (UpstreamConnectionError, aiohttp.ClientError, asyncio.TimeoutError, StreamBroken)


@dataclass
class Attempt:
    """How one call ended: a response to use, or why another worker should be tried."""

    worker: Worker
    response: UpstreamResponse | None = None
    retryable: bool = False
    reason: str = ""


def make_session(max_connections: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, keepalive_timeout=60)
    # Bytes are passed through as the worker sent them: no decompression, no cookie jar.
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 cookie_jar=aiohttp.DummyCookieJar(), raise_for_status=False)


def timeout(total_s: float | None, connect_s: float, read_s: float | None = None,
            first_byte_s: float | None = None) -> "Limits":
    """A bound on each socket read would also bound the wait for headers, which for a worker
    includes its queueing and prefill. Streams instead bound that wait with `first_byte_s` and
    each later chunk with `read_s`."""
    return Limits(total=total_s, connect=connect_s, first_byte_s=first_byte_s, idle_s=read_s)


class Limits(NamedTuple):  # (a tuple: made per non-streamed request, cheaper than a frozen dataclass)
    total: float | None  # the whole call, status and body
    connect: float  # a free connection slot and the connect
    first_byte_s: float | None = None  # headers must arrive within this (streams)
    idle_s: float | None = None  # then each chunk within this (streams)


class WorkerLost(Exception):
    """The worker stopped answering health probes while a call waited on it."""


class Upstream:
    """The pooled session plus the failure accounting every call shares.

    It also knows what each worker holds: the tasks waiting for its status line and the
    responses being read. When the prober finds a worker lost (a SIGSTOPped, wedged or
    partitioned process accepts connections and then says nothing), those are abandoned at once:
    a wait for a status line ends as a retryable failure (another worker is tried), a body being
    read ends as a broken connection (the caller's usual error path). Without this such calls
    would wait out `--first-byte-timeout` / `--request-timeout` (minutes)."""

    def __init__(self, session: aiohttp.ClientSession, workers: WorkerSet, metrics: RouterMetrics,
                 client: Client | None = None):
        self.session = session
        self.client = client
        self.workers = workers
        self.metrics = metrics
        self._waiting: dict[Worker, set[asyncio.Task]] = {}
        self._inflight: dict[str, object] = {}  # each worker URL's in-flight gauge series
        self._abandoned: set[asyncio.Task] = set()
        self._reading: dict[Worker, set[UpstreamResponse]] = {}
        self._background: set[asyncio.Task] = set()
        workers.on_lost.append(self.abandon)

    def keep(self, task: asyncio.Task) -> None:
        """Hold a reference to a task nobody awaits until it is done (the loop's is weak)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def release_kv(self, worker: Worker, kv_transfer_params: dict) -> None:
        """In the background, best effort: the prefill `worker` frees the pin of a hand-off that
        no decode worker was sent (the client left first); its TTL is the backstop."""
        self.keep(asyncio.get_running_loop().create_task(self._release_kv(worker, kv_transfer_params)))

    async def _release_kv(self, worker: Worker, kv_transfer_params: dict) -> None:
        try:
            async with self.session.post(worker.url + PATH_KV_RELEASE, json=kv_transfer_params,
                                         timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 202:
                    log.debug("KV release on %r answered %d", worker, r.status)
        except UPSTREAM_ERRORS as e:
            log.debug("KV release on %r failed: %r", worker, e)

    def abandon(self, worker: Worker) -> int:
        """Stop every call waiting on `worker` (see the class doc); returns how many."""
        tasks = self._waiting.pop(worker, set())
        responses = self._reading.pop(worker, set())
        for task in tasks:
            self._abandoned.add(task)
            task.cancel()
        for response in responses:
            response.close()  # the reader gets UpstreamConnectionError: an UPSTREAM_ERROR
        if tasks or responses:
            log.warning("%r stopped answering health probes: abandoning %d call(s) waiting on it",
                        worker, len(tasks) + len(responses))
        return len(tasks) + len(responses)

    def reading(self, worker: Worker, response: UpstreamResponse) -> None:
        """`response`'s body is being read from `worker` until `done_reading`."""
        reading = self._reading.get(worker)
        if reading is None:
            reading = self._reading[worker] = set()
        reading.add(response)

    def done_reading(self, worker: Worker, response: UpstreamResponse) -> None:
        held = self._reading.get(worker)
        if held is not None:
            held.discard(response)

    def acquire(self, worker: Worker) -> None:
        worker.inflight += 1
        self._inflight_series(worker).set(worker.inflight)

    def release(self, worker: Worker) -> None:
        worker.inflight -= 1
        self._inflight_series(worker).set(worker.inflight)

    def _inflight_series(self, worker: Worker):
        series = self._inflight.get(worker.url)
        if series is None:
            series = self._inflight[worker.url] = self.metrics.child(self.metrics.inflight, worker.url)
        return series

    def failed(self, worker: Worker, phase: str, reason: str) -> None:
        self.metrics.upstream_errors.labels(worker.url, phase).inc()
        if self.workers.record_failure(worker):
            log.warning("ejected %r after %d failures (last: %s)", worker, worker.consecutive_failures, reason)

    async def post(self, worker: Worker, path: str, body: bytes, headers: dict[str, str],
                   limits: "Limits", phase: str) -> Attempt:
        """POST and wait for the status line. 5xx and transport errors are retryable failures;
        429 is retryable without blaming the worker; other statuses are final answers, and so is
        a 500 that failed the request alone (HEADER_REQUEST_FAILED)."""
        task = asyncio.current_task()
        waiting = self._waiting.get(worker)
        if waiting is None:
            waiting = self._waiting[worker] = set()
        waiting.add(task)
        try:
            response = await self.client.post(worker.url, path, body, headers, limits.connect, limits.total,
                                              limits.first_byte_s)
        except asyncio.CancelledError:
            # Ours (abandon()) unless the client's cancellation is also pending: then it wins.
            if task not in self._abandoned or task.uncancel() > 0:
                raise
            e = WorkerLost("the worker stopped answering health probes while this call waited")
            self.failed(worker, phase, repr(e))
            return Attempt(worker, retryable=True, reason=f"{type(e).__name__}: {e}")
        except UPSTREAM_ERRORS as e:
            self.failed(worker, phase, repr(e))
            return Attempt(worker, retryable=True, reason=f"{type(e).__name__}: {e}")
        finally:
            self._abandoned.discard(task)
            waiting.discard(task)  # (abandon() took the set out if it ran: discarding from it is harmless)
        if response.status >= 500 and response.headers.get(HEADER_REQUEST_FAILED):
            return Attempt(worker, response)  # this request's failure, final: the worker is fine
        if response.status >= 500 or response.status == 429:
            content = await read_and_close(response)
            reason = f"{response.status}: {content[:200].decode(errors='replace')}"
            if response.status != 429:
                self.failed(worker, phase, reason)
            return Attempt(worker, response=response, retryable=True, reason=reason)
        return Attempt(worker, response)


async def read_and_close(response: UpstreamResponse) -> bytes:
    try:
        return await response.read()
    except UPSTREAM_ERRORS:
        return b""
    finally:
        response.release()


def close(response: UpstreamResponse | None) -> None:
    """Drop the connection unless the body was fully read (then it is back in the pool already).
    Synchronous on purpose: it must work inside a cancelled task (client disconnect), and
    closing the connection is what tells the worker to abort and free the request's KV."""
    if response is not None:
        response.close()
