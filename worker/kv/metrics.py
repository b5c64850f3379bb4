"""KV-transfer metrics (pdserve_kv_transfer_*, pdserve_kv_local_prefill_fallbacks).

A collector, not a registry: the server registers it in the process's one registry once the
engine is loaded, so every family appears once in /metrics. (Pinned and free block counts are
engine state, reported from `engine.stats()` with the other engine series.) Offline engines
(tests, benchmarks) read the counters directly.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

LABELS = ("direction", "transport")


class KVMetrics:
    def __init__(self):
        self.bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved between workers.", LABELS, registry=None)
        self.seconds = Histogram("pdserve_kv_transfer_seconds", "Duration of one request's KV transfer.",
                                 LABELS, registry=None,
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.failures = Counter("pdserve_kv_transfer_failures", "KV transfers that failed (decode fell back to local prefill).",
                                LABELS, registry=None)
        self.local_prefill_fallbacks = Counter("pdserve_kv_local_prefill_fallbacks",
                                               "Remote-prefilled requests recomputed locally after a failed pull.",
                                               registry=None)

    def collect(self):
        """The prometheus_client collector protocol (`CollectorRegistry.register(self)`)."""
        for metric in (self.bytes, self.seconds, self.failures, self.local_prefill_fallbacks):
            yield from metric.collect()
