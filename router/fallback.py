"""Aggregated fallback: when one role has no routable worker, the other role serves whole requests.

    decode pool  prefill pool   requests go                              mode
    ─────────── ────────────── ──────────────────────────────────────── ───────────────
    yes          yes            P/D (or direct to decode, per decider)   disaggregated
    yes          none           whole on decode (it prefills locally)    degraded: no prefill
    none         yes            whole on prefill (it decodes too)        degraded: no decode
    none         none           held (admission_queue.py) or 503         unavailable

Every pdserve worker runs the whole engine whatever its role: the role only says which half of
a hand-off it takes. So a prefill worker answers a plain request like any worker, and the model
stays up while a role is scaled to zero, rolled, or crashed. Disaggregation resumes on its own:
the pools are read per request, so the first request after a worker of the missing role turns
routable is disaggregated again.

A role counts as *missing* (the service is Degraded) only once this router has seen a worker of
it for that model: a deployment with no prefill role at all is aggregated by design, not
degraded. `pdserve_router_degraded{model,missing_role}` says so (refreshed on every scrape), and
`pdserve_router_fallback_requests{missing_role}` counts requests served whole because of it.

A decode call that no decode worker took (each tried one refused the connection, answered 5xx,
or was draining) also moves to the other role while nothing has reached the client yet: that is
the window between a worker going away and the router's probes and discovery noticing it.
Overload (429) does not: a busy decode pool is not a missing one.
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.protocol.contract import ROLE_DECODE, ROLE_PREFILL
from pdserve.router.metrics import RouterMetrics
from pdserve.router.selection import Selector
from pdserve.router.upstream_call import UpstreamCall
from pdserve.router.workers import Worker

ROLES = (ROLE_PREFILL, ROLE_DECODE)


def other(role: str) -> str:
    return ROLE_PREFILL if role == ROLE_DECODE else ROLE_DECODE


class Availability(NamedTuple):
    """One model's pools right now (a tuple: made per request, cheaper than a frozen dataclass)."""

    prefill: list[Worker]
    decode: list[Worker]
    missing: str | None  # the role with no routable worker that this router has seen, if any

    @property
    def whole_role(self) -> str | None:
        """The role that serves whole (non-disaggregated) requests: decode, else prefill."""
        if self.decode:
            return ROLE_DECODE
        return ROLE_PREFILL if self.prefill else None

    def pool(self, role: str) -> list[Worker]:
        return self.decode if role == ROLE_DECODE else self.prefill


class RoleFallback:
    def __init__(self, selector: Selector, metrics: RouterMetrics):
        self.selector = selector
        self.metrics = metrics
        self._seen: set[tuple[str, str]] = set()  # (model, role) this router has had a worker of
        self._missing: dict[str, str | None] = {}  # per model, the missing role the gauge shows

    def availability(self, model: str) -> Availability:
        prefill, decode = self.selector.pools(model)
        seen, missing = self._seen, None
        # A role is missing when it has no routable worker, the other role has, and this router
        # has had one of it for the model (written out per role: this runs once per request).
        if prefill:
            if (model, ROLE_PREFILL) not in seen:
                seen.add((model, ROLE_PREFILL))
            if not decode and (model, ROLE_DECODE) in seen:
                missing = ROLE_DECODE
        if decode:
            if (model, ROLE_DECODE) not in seen:
                seen.add((model, ROLE_DECODE))
            if not prefill and (model, ROLE_PREFILL) in seen:
                missing = ROLE_PREFILL
        if self._missing.get(model, False) != missing:  # the gauge is set when it changes, not per request
            self._missing[model] = missing
            for role in ROLES:
                self.metrics.degraded.labels(model, role).set(1 if missing == role else 0)
        return Availability(prefill, decode, missing)

    def refresh(self) -> dict[str, str | None]:
        """Every known model's missing role (None: disaggregated or aggregated by design); sets
        the degraded gauge, so a scrape is current even when no request came in."""
        models = self.selector.workers.models() | {m for m, _ in self._seen}
        return {m: self.availability(m).missing for m in sorted(models)}

    def served_whole(self, missing: str | None) -> None:
        if missing is not None:
            self.metrics.fallback_requests.labels(missing).inc()

    @staticmethod
    def unreachable(up: UpstreamCall) -> bool:
        """No worker of the call's pool took it, and not because they were busy: the role is
        (for now) gone, so the other role may serve the request whole. No attempt at all counts:
        the pool's last worker left it (discovery, ejection) between selection and the pick."""
        return up.response is None and up.last_status != 429

    def whole_elsewhere(self, model: str, failed_role: str) -> tuple[str, list[Worker]] | None:
        """After `failed_role`'s pool took nothing: the other role's pool, if it has workers."""
        role = other(failed_role)
        pool = self.selector.pool(role, model)
        if not pool:
            return None
        self.metrics.fallback_requests.labels(failed_role).inc()
        return role, pool
