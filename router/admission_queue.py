"""Scale from zero: hold a request while no worker of its model is routable.

With both roles at `minReplicas: 0`, the first request of the day finds no worker: the planner
sees it waiting (`pdserve_router_requests_waiting_for_workers`) and scales up, and the request
should be answered once the first worker is ready, not refused. So a request whose model has no
routable worker (of either role; fallback.py serves it with one) waits here:

- bounded in time (`--hold-timeout`): past it, 503 `no_workers` with `Retry-After`;
- bounded in number (`--hold-queue`): a request past it gets that 503 at once, so a burst
  against an empty model cannot pile up unbounded memory and connections in the router;
- released together as soon as a worker is routable (checked every `_POLL_S`: the
  prober and discovery update the worker set on their own schedules, seconds apart, so a finer
  wake-up would only buy milliseconds on a cold start that takes tens of seconds).

Without `--hold-timeout` (the default) nothing is held: 503 at once, as before.
A model this router has never seen while other models are served is not held: 404 follows.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable

from pdserve.protocol.errors import APIError
from pdserve.router.metrics import RouterMetrics

_POLL_S = 0.05


class AdmissionQueue:
    def __init__(self, hold_timeout_s: float | None, max_held: int, has_workers: Callable[[str], bool],
                 known_models: Callable[[], set[str]], metrics: RouterMetrics):
        self.hold_timeout_s = hold_timeout_s
        self.max_held = max_held
        self._has_workers = has_workers
        self._known_models = known_models
        self._metrics = metrics
        self.held = 0

    @property
    def enabled(self) -> bool:
        return bool(self.hold_timeout_s)

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.hold_timeout_s or 1)))}

    async def admit(self, model: str) -> None:
        """Return once `model` has a routable worker; raise 503 (with Retry-After) when the hold
        is full or runs out. Returns at once when holding is off or workers are there."""
        if not self.enabled or self._has_workers(model):
            return
        known = self._known_models()
        if known and model not in known:
            return  # someone else's model: the caller's model check answers 404
        if self.held >= self.max_held:
            self._metrics.held_outcomes.labels("queue_full").inc()
            raise APIError(503, f"no worker of model {model!r} is ready and {self.held} requests already wait "
                                "for one", code="no_workers", headers=self._retry_after())
        self.held += 1
        self._metrics.held.set(self.held)
        deadline = time.monotonic() + self.hold_timeout_s
        try:
            while not self._has_workers(model):
                if time.monotonic() >= deadline:
                    self._metrics.held_outcomes.labels("timeout").inc()
                    raise APIError(503, f"no worker of model {model!r} became ready within "
                                        f"{self.hold_timeout_s:g}s", code="no_workers", headers=self._retry_after())
                await asyncio.sleep(_POLL_S)
            self._metrics.held_outcomes.labels("admitted").inc()
        finally:
            self.held -= 1
            self._metrics.held.set(self.held)
