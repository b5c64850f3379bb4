"""KV-transfer metrics (pdserve_kv_*), in their own registry that /metrics appends."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LABELS = ("direction", "transport")


class KVMetrics:
    def __init__(self, pinned_blocks: Callable[[], int]):
        r = self.registry = CollectorRegistry()
        self.bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved between workers.", LABELS, registry=r)
        self.seconds = Histogram("pdserve_kv_transfer_seconds", "Duration of one request's KV transfer.",
                                 LABELS, registry=r,
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.failures = Counter("pdserve_kv_transfer_failures", "KV transfers that failed (decode fell back to local prefill).",
                                LABELS, registry=r)
        self.local_prefill_fallbacks = Counter("pdserve_kv_local_prefill_fallbacks",
                                               "Remote-prefilled requests recomputed locally after a failed pull.",
                                               registry=r)
        pinned = Gauge("pdserve_kv_pinned_blocks", "KV blocks held for remote decode workers.", registry=r)
        pinned.set_function(pinned_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
