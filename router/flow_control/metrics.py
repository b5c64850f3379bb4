"""Flow control's Prometheus series, on the router's registry. Tenants are client-chosen names
(the fairness header), so only the first `MAX_TENANT_LABELS` get a label of their own; the rest
share `other`, and no client can grow the router's series without bound."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MAX_TENANT_LABELS = 64
OTHER = "other"
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.queued = Gauge("pdserve_router_flow_queue_depth", "Requests waiting in the flow-control queue.",
                            ["band", "tenant"], registry=r)
        self.inflight = Gauge("pdserve_router_flow_inflight", "Requests flow control has let through and not "
                              "yet seen end.", registry=r)
        self.waited = Histogram("pdserve_router_flow_queue_wait_seconds",
                                "Time a request waited in the flow-control queue before it was dispatched.",
                                ["band", "tenant"], buckets=_WAIT_BUCKETS, registry=r)
        self.dispatched = Counter("pdserve_router_flow_dispatched", "Requests let through by flow control.",
                                  ["band", "tenant"], registry=r)
        self.rejected = Counter("pdserve_router_flow_rejected",
                                "Requests refused by flow control (429), by reason: queue_full, queue_timeout, "
                                "displaced (a more urgent band took its place), tenant_token_rate.",
                                ["band", "tenant", "reason"], registry=r)
        self._tenants: set[str] = set()

    def tenant(self, name: str) -> str:
        """The label for `name`."""
        if name in self._tenants:
            return name
        if len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(name)
            return name
        return OTHER
