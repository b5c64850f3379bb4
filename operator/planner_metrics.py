"""From `/metrics` text to the planner's Snapshot: what the planner reads, as pure functions.

A scrape is cumulative (counters, histogram buckets); the planner needs the last interval's
rates and percentiles, so two scrapes are differenced, as Prometheus' rate() and
histogram_quantile() would (linear inside a bucket). Counters that went backwards (a restarted
pod) count from zero.

    prefill token rate  Δ vllm:prompt_tokens        on the prefill pods / Δt
    prefill arrivals    Δ pdserve_router_arrived_prompt_tokens on the routers / Δt (None when
                        no router exports it: an older router); the demand prefill is sized from
    decode token rate   Δ vllm:generation_tokens    on the decode pods / Δt
    prefill latency     Δ pdserve_router_time_to_first_token_seconds (what clients see)
                        quantile at the SLO percentile; else the prefill pods' TTFT
    decode latency      Δ vllm:inter_token_latency_seconds on the decode pods, same quantile
    waiting             vllm:num_requests_waiting, summed per role
    held                pdserve_router_requests_waiting_for_workers, summed over routers
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdserve.operator.planner import RoleSample

PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
WORKER_TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
WAITING = "vllm:num_requests_waiting"
ROUTER_TTFT = "pdserve_router_time_to_first_token_seconds"
HELD = "pdserve_router_requests_waiting_for_workers"
ARRIVED_PROMPT_TOKENS = "pdserve_router_arrived_prompt_tokens"


@dataclass
class Scrape:
    """One or more /metrics pages added together (a role's pods, or the routers)."""

    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> cumulative count

    def add(self, text: str) -> "Scrape":
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if family.type == "counter" and s.name.endswith("_total"):
                    self.counters[family.name] = self.counters.get(family.name, 0.0) + s.value
                elif family.type == "gauge":
                    self.gauges[family.name] = self.gauges.get(family.name, 0.0) + s.value
                elif family.type == "histogram" and s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    h = self.buckets.setdefault(family.name, {})
                    h[le] = h.get(le, 0.0) + s.value
        return self


def counter_rate(prev: Scrape | None, cur: Scrape, name: str, dt: float) -> float:
    if prev is None or dt <= 0:
        return 0.0
    now, before = cur.counters.get(name, 0.0), prev.counters.get(name, 0.0)
    return max(0.0, (now - before if now >= before else now) / dt)


def quantile(prev: Scrape | None, cur: Scrape, name: str, q: float) -> float | None:
    """The q-quantile of the observations between the two scrapes; None without any."""
    now = cur.buckets.get(name) or {}
    before = (prev.buckets.get(name) or {}) if prev is not None else {}
    if not now:
        return None
    bounds = sorted(now)
    counts = [now[b] - before.get(b, 0.0) for b in bounds]
    if any(c < 0 for c in counts):  # a pod restarted: its buckets start over
        counts = [now[b] for b in bounds]
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if math.isinf(b):
                return lower_bound  # past the last finite bucket: its bound is all we know
            if c == lower_count:
                return b
            return lower_bound + (b - lower_bound) * (rank - lower_count) / (c - lower_count)
        lower_bound, lower_count = b, c
    return bounds[-1]


def role_sample(role: str, prev: Scrape | None, cur: Scrape, router_prev: Scrape | None, router: Scrape,
                dt: float, percentile: float, replicas: int, ready: int, terminating: int = 0) -> RoleSample:
    if role == "prefill":
        rate = counter_rate(prev, cur, PROMPT_TOKENS, dt)
        arrival = counter_rate(router_prev, router, ARRIVED_PROMPT_TOKENS, dt) \
            if ARRIVED_PROMPT_TOKENS in router.counters else None
        latency = quantile(router_prev, router, ROUTER_TTFT, percentile)
        if latency is None:
            latency = quantile(prev, cur, WORKER_TTFT, percentile)
    else:
        rate, arrival = counter_rate(prev, cur, GENERATION_TOKENS, dt), None
        latency = quantile(prev, cur, ITL, percentile)
    return RoleSample(replicas=replicas, ready=ready, token_rate=rate, latency_s=latency,
                      waiting=cur.gauges.get(WAITING, 0.0), terminating=terminating, arrival_rate=arrival)


def held(router: Scrape) -> int:
    return int(router.gauges.get(HELD, 0.0))
