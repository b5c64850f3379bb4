"""The flow-control queue and its dispatcher.

A request takes a slot (`--flow-control-max-inflight`) at once when one is free and nobody
waits before it; otherwise it waits. Whenever a slot frees (or the workers stop being
saturated), the dispatcher picks the next request: the most urgent band (lowest priority value)
that has a request it may let through, and within it the tenant served least so far, its oldest
request. A tenant that was idle joins at the band's current least-served count, so it gets its
fair share from now on and cannot bank credit while away (start-time fair queuing's rule). A
tenant at its concurrency limit (`--flow-control-tenant-max-inflight`) is skipped until one of
its requests ends.

Bounded: past `--flow-control-max-queue` waiting, a newcomer of a more urgent band displaces the
newest request of the least urgent band; else, within its own band, the newest request of the
tenant with the most requests waiting, if that tenant has more waiting than the newcomer's (so a
tenant flooding the router fills the bound with its own requests, and a quiet tenant's newcomer
takes one of those places instead of being refused); otherwise the newcomer is refused. A request waits at
most `--flow-control-queue-timeout`. Each refusal is a 429 with `Retry-After` and its reason. A
client that leaves while queued (its task cancelled) leaves the queue.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdserve.protocol.errors import APIError
from pdserve.router.flow_control.config import FlowControlConfig
from pdserve.router.flow_control.limits import TokenRate
from pdserve.router.flow_control.metrics import FlowMetrics

_SATURATION_POLL_S = 0.05  # worker metrics change with the probes (--probe-interval): no finer wake-up helps


@dataclass(frozen=True)
class Ticket:
    band: int
    tenant: str
    tokens: int  # prompt + max_tokens: what the token rate charges


@dataclass(eq=False)
class _Waiter:
    ticket: Ticket
    seq: int
    since: float
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Lease:
    """A slot held while a request is served; `release()` is idempotent."""

    def __init__(self, flow: FlowController, ticket: Ticket):
        self._flow, self.ticket, self._held = flow, ticket, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._flow._released(self.ticket)


class _Band:
    def __init__(self) -> None:
        self.queues: dict[str, deque[_Waiter]] = {}  # tenant -> its waiting requests, oldest first
        self.served: dict[str, int] = {}  # tenant -> dispatches counted for fairness

    def push(self, w: _Waiter) -> None:
        tenant = w.ticket.tenant
        if tenant not in self.queues:
            # Joining (again): at the least-served count of the tenants already waiting.
            floor = min((self.served.get(t, 0) for t in self.queues), default=self.served.get(tenant, 0))
            self.served[tenant] = max(self.served.get(tenant, 0), floor)
            self.queues[tenant] = deque()
        self.queues[tenant].append(w)

    def remove(self, w: _Waiter) -> None:
        q = self.queues.get(w.ticket.tenant)
        if q is not None and w in q:
            q.remove(w)
            if not q:
                del self.queues[w.ticket.tenant]

    def pick(self, may_run: Callable[[str], bool]) -> _Waiter | None:
        best = None
        for tenant, q in self.queues.items():
            if not may_run(tenant):
                continue
            key = (self.served[tenant], q[0].seq)
            if best is None or key < best[0]:
                best = (key, tenant)
        if best is None:
            return None
        tenant = best[1]
        w = self.queues[tenant].popleft()
        if not self.queues[tenant]:
            del self.queues[tenant]
        self.served[tenant] += 1
        if len(self.served) > 4 * len(self.queues) + 1024:  # idle tenants rejoin at the floor anyway
            self.served = {t: n for t, n in self.served.items() if t in self.queues}
        return w

    def newest(self) -> _Waiter | None:
        return max((q[-1] for q in self.queues.values()), key=lambda w: w.seq, default=None)

    def newest_of_longest(self, than: str) -> _Waiter | None:
        """The newest request of the tenant with the most waiting, if it has more than `than`'s."""
        longest = max(self.queues.values(), key=len, default=None)
        if longest is None or len(longest) <= len(self.queues.get(than, ())):
            return None
        return longest[-1]


class FlowController:
    def __init__(self, config: FlowControlConfig, metrics: FlowMetrics, saturated: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._metrics = metrics
        self._saturated = saturated
        self._clock = clock
        self._rate = TokenRate(config.tenant_tokens_per_minute, clock)
        self._bands = {b: _Band() for b in config.bands}  # sorted: most urgent first
        self._seq = itertools.count()
        self.inflight = 0
        self.queued = 0
        self._tenant_inflight: dict[str, int] = {}
        self._poller: asyncio.Task | None = None

    # ---- admission --------------------------------------------------------------------

    async def acquire(self, ticket: Ticket) -> Lease:
        """A slot for `ticket`, once its turn comes; 429 when refused. Cancelled (the client
        left), it leaves the queue, or gives back the slot it was just granted."""
        try:
            self._rate.charge(ticket.tenant, ticket.tokens)
        except APIError:
            self._metrics.rejected.labels(str(ticket.band), self._metrics.tenant(ticket.tenant),
                                          "tenant_token_rate").inc()
            raise
        w = _Waiter(ticket, next(self._seq), self._clock())
        self._bands[ticket.band].push(w)
        self._count_queued(w, +1)
        self._dispatch()
        if not w.granted.done() and self.queued > self.config.max_queue:
            self._make_room(w)
        # A timer, not asyncio.wait_for: wait_for (3.11) may swallow a cancellation that races
        # the grant, and the request would go on for a client that has left.
        timer = asyncio.get_running_loop().call_later(self.config.queue_timeout_s, self._expire, w)
        try:
            return await w.granted  # raises the refusal of a displaced or timed-out request
        except asyncio.CancelledError:
            if w.granted.done() and not w.granted.cancelled() and w.granted.exception() is None:
                w.granted.result().release()  # granted just as the client left: give it back
            else:
                self._leave(w)
            raise
        finally:
            timer.cancel()

    def _expire(self, w: _Waiter) -> None:
        if w.granted.done():
            return
        self._leave(w)
        self._metrics.rejected.labels(str(w.ticket.band), self._metrics.tenant(w.ticket.tenant), "queue_timeout").inc()
        w.granted.set_exception(self._refusal(f"waited {self.config.queue_timeout_s:g}s in the flow-control queue "
                                              "without a free slot", "queue_timeout"))

    def _make_room(self, newcomer: _Waiter) -> None:
        """The queue is over its bound with `newcomer` in it: refuse the newest request of the
        least urgent band, if that band is less urgent than the newcomer's; else the newest of
        the newcomer's band's longest tenant queue, if longer than the newcomer's tenant's; else
        the newcomer."""
        victim = newcomer
        for band in reversed(self.config.bands):
            if band <= newcomer.ticket.band:
                break
            victim = self._bands[band].newest() or victim
            if victim is not newcomer:
                break
        same_band = victim is newcomer
        if same_band:
            victim = self._bands[newcomer.ticket.band].newest_of_longest(newcomer.ticket.tenant) or newcomer
        self._leave(victim)
        reason = "queue_full" if victim is newcomer else "displaced"
        self._metrics.rejected.labels(str(victim.ticket.band), self._metrics.tenant(victim.ticket.tenant), reason).inc()
        message = (f"the flow-control queue is full ({self.config.max_queue} waiting)" if victim is newcomer else
                   "a request of a tenant with fewer requests waiting took this one's place in the full "
                   "flow-control queue" if same_band else
                   "a more urgent request took this one's place in the full flow-control queue")
        victim.granted.set_exception(self._refusal(message, reason))
        victim.granted.exception()  # retrieved: a displaced waiter may be gone already

    def _refusal(self, message: str, reason: str) -> APIError:
        retry = max(1, math.ceil(min(self.config.queue_timeout_s, 10.0) / 2))
        return APIError(429, message, code=reason, headers={"Retry-After": str(retry)})

    def _leave(self, w: _Waiter) -> None:
        """Out of the queue (timed out, cancelled, displaced); nothing if already dispatched."""
        band = self._bands[w.ticket.band]
        q = band.queues.get(w.ticket.tenant)
        if q is not None and w in q:
            band.remove(w)
            self._count_queued(w, -1)

    def _count_queued(self, w: _Waiter, delta: int) -> None:
        self.queued += delta
        self._metrics.queued.labels(str(w.ticket.band), self._metrics.tenant(w.ticket.tenant)).inc(delta)

    # ---- dispatch ---------------------------------------------------------------------

    def _may_run(self, tenant: str) -> bool:
        cap = self.config.tenant_max_inflight
        return not cap or self._tenant_inflight.get(tenant, 0) < cap

    def _dispatch(self) -> None:
        while self.queued and self.inflight < self.config.max_inflight:
            if self._saturated():
                self._poll_saturation()
                return
            w = None
            for band in self._bands.values():
                w = band.pick(self._may_run)
                if w is not None:
                    break
            if w is None:
                return  # only tenants at their limit wait: their releases dispatch them
            self._count_queued(w, -1)
            if w.granted.done():  # its task was cancelled and has not run yet to leave the queue
                continue
            t = w.ticket
            self.inflight += 1
            self._tenant_inflight[t.tenant] = self._tenant_inflight.get(t.tenant, 0) + 1
            self._metrics.inflight.set(self.inflight)
            labels = (str(t.band), self._metrics.tenant(t.tenant))
            self._metrics.dispatched.labels(*labels).inc()
            self._metrics.waited.labels(*labels).observe(self._clock() - w.since)
            w.granted.set_result(Lease(self, t))

    def _released(self, ticket: Ticket) -> None:
        self.inflight -= 1
        n = self._tenant_inflight[ticket.tenant] - 1
        if n:
            self._tenant_inflight[ticket.tenant] = n
        else:
            del self._tenant_inflight[ticket.tenant]
        self._metrics.inflight.set(self.inflight)
        self._dispatch()

    def _poll_saturation(self) -> None:
        """While the workers are saturated and requests wait, look again every poll: nothing else
        would wake the dispatcher when a scrape shows room."""
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._wait_for_room())

    async def _wait_for_room(self) -> None:
        while self.queued and self._saturated():
            await asyncio.sleep(_SATURATION_POLL_S)
        self._dispatch()
