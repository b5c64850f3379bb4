"""KV-transfer metrics (pdserve_kv_transfer_*, pdserve_kv_window_skipped_bytes,
pdserve_kv_local_prefill_fallbacks, pdserve_kv_pull_tail_seconds) and the decode
side's hand-off waits (pdserve_kv_decode_admission_wait_seconds, pdserve_kv_first_step_wait_seconds).

A collector, not a registry: the server registers it in the process's one registry once the
engine is loaded, so every family appears once in /metrics. (Pinned and free block counts are
engine state, reported from `engine.stats()` with the other engine series.) Offline engines
(tests, benchmarks) read the counters directly.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from pdserve.worker.kv.prefix_cost import PrefixPullCost

LABELS = ("direction", "transport")
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_WAIT_SECONDS = _SECONDS + (30, 60)
_REQUEST_BYTES = tuple(float(4**k) for k in range(6, 18))  # 4 KiB .. 16 GiB: a tiny prompt .. a long one of a big model
# 1 MB/s .. 100 GB/s: P and D pods on different nodes see 1-50 GB/s links (docs/architecture.md).
_BANDWIDTH = (1e6, 1e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11)


class KVMetrics:
    def __init__(self, prefix_cost: PrefixPullCost | None = None):
        # Pull a prefix a peer holds, or recompute it: the estimates and the choices (prefix_cost.py).
        self.prefix_cost = prefix_cost or PrefixPullCost()
        self.bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved between workers.", LABELS, registry=None)
        self.seconds = Histogram("pdserve_kv_transfer_seconds", "Duration of one request's KV transfer.",
                                 LABELS, registry=None, buckets=_SECONDS)
        self.request_bytes = Histogram("pdserve_kv_transfer_request_bytes", "KV bytes of one request's transfer.",
                                       LABELS, registry=None, buckets=_REQUEST_BYTES)
        self.bandwidth = Histogram("pdserve_kv_transfer_bandwidth_bytes_per_second",
                                   "One request's KV transfer: its bytes over its duration.", LABELS, registry=None,
                                   buckets=_BANDWIDTH)
        # A hybrid KV cache's hand-off (docs/kv-cache.md): the sliding layers' blocks before the window
        # of the decode side's first query are not moved. Beside the bytes moved, what a hand-off of
        # every sliding block would have moved on top: the window's saving, counted not assumed.
        self.window_skipped = Counter("pdserve_kv_window_skipped_bytes",
                                      "KV bytes of sliding-window layers a hand-off did not move: their blocks "
                                      "wholly before the window of the decode side's first query.", LABELS,
                                      registry=None)
        self.failures = Counter(
            "pdserve_kv_transfer_failures",
            "KV transfers that failed (decode fell back to local prefill).",
            LABELS,
            registry=None,
        )
        self.local_prefill_fallbacks = Counter("pdserve_kv_local_prefill_fallbacks",
                                               "Remote-prefilled requests recomputed locally after a failed pull.",
                                               registry=None)
        self.admission_wait = Histogram("pdserve_kv_decode_admission_wait_seconds",
                                        "Decode side, a remote-prefilled request: from its arrival to its admission "
                                        "with KV blocks allocated.", registry=None, buckets=_WAIT_SECONDS)
        self.first_step_wait = Histogram("pdserve_kv_first_step_wait_seconds",
                                         "Decode side, a remote-prefilled request: from its KV pull landing to its "
                                         "first decode step producing a token.", registry=None, buckets=_WAIT_SECONDS)
        # A streamed hand-off's share of the first gap that is the transfer's own: what is left to
        # move once the prefill is done. Over TCP the senders follow the prefill, over NIXL the
        # reader READs what each progress reply announces; either way this is what did not overlap.
        self.pull_tail = Histogram("pdserve_kv_pull_tail_seconds",
                                   "Decode side, a streamed KV pull: from the prefill worker's reply that the "
                                   "prefill is done to the pull's last block landing here.", LABELS, registry=None,
                                   buckets=_SECONDS)

    def observe_pull_tail(self, transport: str, seconds: float) -> None:
        """A streamed pull's tail: from the reply that the prefill is done to its last byte here."""
        self.pull_tail.labels("recv", transport).observe(seconds)

    def observe_pull(self, transport: str, nbytes: int, seconds: float) -> None:
        """One request's pull landed: `nbytes` in `seconds`. Once per request: a streamed pull
        reports its chunks' total once, when its last chunk landed (the end of `KVConnector._pull`),
        and its seconds include waiting for the prefill to compute them."""
        labels = ("recv", transport)
        self.bytes.labels(*labels).inc(nbytes)
        self.seconds.labels(*labels).observe(seconds)
        self.request_bytes.labels(*labels).observe(nbytes)
        if seconds > 0:
            self.bandwidth.labels(*labels).observe(nbytes / seconds)

    def observe_decode_waits(self, admission_s: float | None, first_step_s: float | None) -> None:
        """A remote-prefilled request's first output: the waits it had (None: it had not that one)."""
        if admission_s is not None:
            self.admission_wait.observe(admission_s)
        if first_step_s is not None:
            self.first_step_wait.observe(first_step_s)

    def collect(self):
        """The prometheus_client collector protocol (`CollectorRegistry.register(self)`)."""
        for metric in (self.bytes, self.window_skipped, self.seconds, self.request_bytes, self.bandwidth, self.failures,
                       self.local_prefill_fallbacks, self.admission_wait, self.first_step_wait, self.pull_tail):
            yield from metric.collect()
        yield from self.prefix_cost.collect()

