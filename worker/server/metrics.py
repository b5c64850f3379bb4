"""Prometheus metrics under vLLM's names, so vLLM dashboards, autoscalers and endpoint pickers
work on pdserve workers unchanged. Every series carries `model_name`.

Engine state (queue lengths, KV usage, prefix-cache counters) is read from `engine.stats()` at
scrape time, so it is never stale and the step loop pays nothing for it. Per-request series
(tokens, finishes, latencies) are recorded by the server as requests complete. The registry
belongs to one app (no module globals): several apps in one test process do not collide.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.worker.request.outputs import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self._model = model_name
        self._stats = stats

    def collect(self):
        s = self._stats()
        if s is None:  # engine still loading: no engine series yet
            return
        label = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric([self._model], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=label)
            c.add_metric([self._model], value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", s.kv_cache_usage)
        yield gauge("pdserve_kv_free_blocks", "Free KV cache blocks.", s.num_free_blocks)
        yield gauge("pdserve_kv_total_blocks", "KV cache blocks in all.", s.num_total_blocks)
        yield gauge("pdserve_kv_pinned_blocks", "KV blocks held for remote decode workers.", s.num_pinned_blocks)
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Requests preempted (to be recomputed).", s.num_preemptions)
        t = s.host_tier
        if t is not None:  # --kv-offloading-size: the host tier behind the device cache
            yield counter("vllm:external_prefix_cache_queries",
                          "Prompt tokens looked up in the host KV tier (those the device cache missed).", t.queries)
            yield counter("vllm:external_prefix_cache_hits", "Prompt tokens found in the host KV tier.", t.hits)
            yield gauge("pdserve_kv_offload_blocks", "KV blocks held in the host tier.", t.num_blocks)
            yield gauge("pdserve_kv_offload_total_blocks", "KV blocks the host tier can hold.", t.num_slots)
            yield counter("pdserve_kv_offload_stored_blocks", "KV blocks copied into the host tier.", t.stored_blocks)
            yield counter("pdserve_kv_offload_restored_blocks",
                          "KV blocks copied back from the host tier (prefix hits there).", t.restored_blocks)
            yield counter("pdserve_kv_offload_evicted_blocks", "KV blocks dropped from the host tier (LRU).",
                          t.evicted_blocks)
            moved = CounterMetricFamily("pdserve_kv_offload_bytes", "Bytes copied between the device cache and "
                                        "the host tier (this rank's shard), by direction.",
                                        labels=label + ["direction"])
            moved.add_metric([self._model, "store"], t.stored_bytes)
            moved.add_metric([self._model, "restore"], t.restored_bytes)
            yield moved


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        label = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", label, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       label + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", label,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", label,
                             buckets=_E2E_BUCKETS, registry=r)
        # vLLM's name and meaning; TTFT's buckets, not vLLM's (from 0.3 s): a healthy queue waits ms.
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled (time waiting).",
                                    label, buckets=_TTFT_BUCKETS, registry=r)
        r.register(_EngineCollector(model_name, stats))
        # Pre-create children so every series exists (at 0) from the first scrape.
        self._prompt = self.prompt_tokens.labels(model_name)
        self._gen = self.generation_tokens.labels(model_name)
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self._queue_time = self.queue_time.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)

    def first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def queued(self, queue_s: float) -> None:
        self._queue_time.observe(queue_s)

    def tokens(self, gap_s: float, n: int) -> None:
        """`n` tokens arrived together `gap_s` after the previous output: n gaps of gap/n."""
        for _ in range(n):
            self._itl.observe(gap_s / n)

    def finished(self, reason: str, num_prompt_tokens: int, num_output_tokens: int, e2e_s: float) -> None:
        self._prompt.inc(num_prompt_tokens)
        self._gen.inc(num_output_tokens)
        self.request_success.labels(self.model_name, reason).inc()
        self._e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
