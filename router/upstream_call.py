"""One phase of one request against a pool of workers: the upstream call context.

It owns everything that must pair up: the worker it holds is acquired (in-flight +1) when a
call starts and released exactly once, when the call moves to another worker or the context
closes, on every path: success, a worker's error, a retry, the client hanging up (the task is
cancelled, or the stream's iterator closed, inside the `async with`). It also owns retries
(another routable worker, at most `max_retries` more) and success/failure accounting.

    async with UpstreamCall(upstream, "decode", pool, choose, retries) as call:
        response = await call.open(path, body, headers, limits)   # None: every try failed
        ...read or relay response...
        call.succeeded()          # or call.retry_elsewhere(reason) and open() again
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Sequence


from pdserve.protocol.tracing import Tracing
from pdserve.router.http1 import UpstreamResponse
from pdserve.router.upstream import Limits, Upstream, close
from pdserve.router.workers import Worker

log = logging.getLogger("pdserve.router")


class UpstreamCall:
    def __init__(self, upstream: Upstream, phase: str, pool: Sequence[Worker],
                 choose: Callable[[Sequence[Worker]], Worker], max_retries: int,
                 on_answer: Callable[[int], None] | None = None, tracing: Tracing | None = None,
                 parent_span=None):
        """`on_answer(status)`: called with each final status a worker answers (not 5xx, not 429).
        With `tracing`, each attempt is a span under `parent_span` (the request's), its context
        sent to the worker as `traceparent`: a retry is a sibling span, its failure on it."""
        self.up = upstream
        self._tracing = tracing or Tracing.off()
        self._parent_span = parent_span
        self._span = None  # the held attempt's, ended when the worker is released
        self._on_answer = on_answer
        self.phase = phase
        self._pool = pool
        self._choose = choose
        self._max_attempts = 1 + max_retries
        self._tried: set[int] = set()
        self.tried: list[Worker] = []  # every worker a call was sent to, in order
        self.attempts = 0
        self.worker: Worker | None = None  # held (acquired) while set
        self.response: UpstreamResponse | None = None
        self.last_status: int | None = None  # of the last retryable answer, for the final error
        self.busy_answers = 0  # attempts a worker refused with 429 (busy, not failing)
        self.last_reason = ""
        self._lingering: asyncio.Task | None = None  # an open() left to finish: close() waits for it

    async def __aenter__(self) -> "UpstreamCall":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def open(
        self, path: str, body: bytes, headers: dict[str, str], limits: Limits,
        body_for: Callable[[Worker, Sequence[Worker]], Awaitable[bytes | None]] | None = None,
    ) -> UpstreamResponse | None:
        """A response with a final status (not 5xx, not 429) from the next worker that gives
        one, its body unread; None when no candidate or attempt is left. `body_for(worker, pool)`:
        what to send the worker chosen instead of `body`, when it says so (None: `body`)."""
        self._drop()
        while self.attempts < self._max_attempts:
            now = time.monotonic()
            candidates = [w for w in self._pool if id(w) not in self._tried and w.routable(now)]
            if not candidates:
                break
            worker = self._choose(candidates)
            self._tried.add(id(worker))
            self.tried.append(worker)
            if self.attempts:
                self.up.metrics.retries.labels(self.phase).inc()
            self.attempts += 1
            self.up.acquire(worker)
            self.worker = worker
            span = None
            if self._tracing.enabled:  # (its name and attributes are not even built otherwise)
                span = self._tracing.start(f"{self.phase} call", self._parent_span, kind="client",
                                           attributes={"pdserve.phase": self.phase, "pdserve.worker": worker.url,
                                                       "pdserve.attempt": self.attempts})
                headers = {**headers, **self._tracing.carrier(span)}
            self._span = span
            own = await body_for(worker, self._pool) if body_for is not None else None
            attempt = await self.up.post(worker, path, body if own is None else own, headers, limits, self.phase)
            if not attempt.retryable:
                if span is not None:
                    span.set_attribute("http.response.status_code", attempt.response.status)
                self.response = attempt.response
                self.up.reading(worker, self.response)
                if self._on_answer is not None:
                    self._on_answer(self.response.status)
                return self.response
            self.last_status = attempt.response.status if attempt.response is not None else None
            self.busy_answers += self.last_status == 429
            self.last_reason = attempt.reason
            log.info("%s on %r failed (%s)", self.phase, worker, attempt.reason)
            self._tracing.end(span, {"http.response.status_code": self.last_status}, error=attempt.reason)
            self._span = None
            self._drop()
        return None

    @property
    def all_busy(self) -> bool:
        """Every worker tried answered 429: the pool is busy, none of it lost."""
        return self.attempts > 0 and self.busy_answers == self.attempts

    def retry_elsewhere(self, reason: str, phase: str | None = None) -> None:
        """The held worker's answer was unusable: count its failure; the next open() goes elsewhere."""
        self.failed(reason, phase)
        self.close()

    def failed(self, reason: str, phase: str | None = None) -> None:
        self.last_reason = reason
        if self._span is not None:
            self._tracing.end(self._span, error=reason)
            self._span = None
        self.up.failed(self.worker, phase or self.phase, reason)

    def succeeded(self) -> None:
        self.up.workers.record_success(self.worker)

    def close_when_done(self, task: asyncio.Task, within_s: float) -> None:
        """The caller left while `task` (this call's `open()`) waits for a status line: give the
        worker `within_s` to take the request in (an answer in time closes the call at once),
        then cut it off. Until then `close()` does nothing."""
        self._lingering = task
        asyncio.get_running_loop().call_later(within_s, task.cancel)

        def done(t: asyncio.Task) -> None:
            if not t.cancelled():
                t.exception()  # retrieved: a failure here is nobody's to report
            self._lingering = None
            self._drop()

        self.up.keep(task)
        task.add_done_callback(done)

    def close(self) -> None:
        """Drop the response (its connection, unless fully read) and release the worker. Idempotent;
        synchronous, so it also runs inside a cancelled task."""
        if self._lingering is None:
            self._drop()

    def _drop(self) -> None:
        if self.response is not None:
            self.up.done_reading(self.worker, self.response)
            close(self.response)
            self.response = None
        if self.worker is not None:
            self.up.release(self.worker)
            self.worker = None
        if self._span is not None:
            self._tracing.end(self._span)
            self._span = None
