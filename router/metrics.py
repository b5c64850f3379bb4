"""The router's Prometheus series, on a registry owned by one app (no module-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.router.flow_control.metrics import FlowMetrics
from pdserve.router.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

# The stall between a stream's first two tokens: decode steps are milliseconds, a KV hand-off that
# waits for a whole transfer can be seconds.
_GAP_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple, object] = {}  # child()
        r = self.registry
        # The series every request updates are the Loop* kinds (loop_metrics.py: no lock per
        # update); they are only ever updated from the event loop's thread.
        self.requests = LoopCounter("pdserve_router_requests", "Requests answered, by route, status and P/D.",
                                ["route", "status", "disaggregated"], registry=r)
        self.ttft = LoopHistogram("pdserve_router_time_to_first_token_seconds",
                              "From request arrival to the first generated token sent to the client.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = LoopHistogram("pdserve_router_e2e_latency_seconds", "From request arrival to its last byte.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = LoopHistogram("pdserve_router_prefill_seconds", "Duration of the prefill call (P/D only).",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.handoff = LoopHistogram("pdserve_router_handoff_seconds",
                                 "From the prefill answer to the decode worker's first byte (KV transfer included).",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.first_token_gap = LoopHistogram("pdserve_router_first_token_gap_seconds",
                                         "Streams: from sending the first token's event to sending the second's "
                                         "(P/D: the stall after the hand-off; direct: the first inter-token gap).",
                                         ["disaggregated"], buckets=_GAP_BUCKETS, registry=r)
        self.upstream_errors = LoopCounter("pdserve_router_upstream_errors", "Failed worker calls.",
                                       ["worker", "phase"], registry=r)
        self.inflight = LoopGauge("pdserve_router_inflight", "Requests open on each worker.", ["worker"], registry=r)
        self.retries = LoopCounter("pdserve_router_retries", "Worker calls retried on another worker.", ["phase"],
                               registry=r)
        # Aggregated fallback (fallback.py) and scale from zero (admission_queue.py): what a
        # planner and the operator's Degraded condition read.
        self.degraded = Gauge("pdserve_router_degraded",
                              "1 while this role has no routable worker for the model and the other role serves "
                              "whole requests (aggregated fallback).", ["model", "missing_role"], registry=r)
        self.fallback_requests = Counter("pdserve_router_fallback_requests",
                                         "Requests served whole by the other role because this one had no worker "
                                         "that took them.", ["missing_role"], registry=r)
        self.held = Gauge("pdserve_router_requests_waiting_for_workers",
                          "Requests held because no worker of their model is routable (scale from zero).",
                          registry=r)
        self.held_outcomes = Counter("pdserve_router_held_requests",
                                     "Held requests by outcome: admitted (a worker came), timeout, queue_full.",
                                     ["outcome"], registry=r)

        # Demand as it arrives (the planner sizes prefill from it: what workers finish plateaus
        # when they saturate, what arrives does not). Counted once per request, when a worker
        # accepts it (its first 2xx: Orchestrator._answered), so what the router or a worker
        # refuses (an unknown model, a malformed or oversized body, a prompt over the context)
        # never inflates it, and a client cannot mint label values; a held request counts when a
        # worker takes it. Prompt tokens are exact when the router tokenizes (--tokenizer), else
        # its estimate (prompt.py).
        self.arrived_requests = LoopCounter("pdserve_router_arrived_requests",
                                        "Requests for a served model, counted once a worker accepted them.",
                                        ["model"], registry=r)
        self.arrived_prompt_tokens = LoopCounter("pdserve_router_arrived_prompt_tokens",
                                             "Prompt tokens of the arrived requests (exact with --tokenizer, "
                                             "else estimated from the text).", ["model"], registry=r)

        self.peer_prefix_pins = Counter("pdserve_router_peer_prefix_pins",
                                        "Requests whose chosen worker lacked a prefix another worker cached, by "
                                        "outcome: pinned on that peer and handed over (prefix_from), or not (the "
                                        "peer failed; the chosen worker computes it all).", ("outcome",), registry=r)
        self.decode_prefix_hits = Counter("pdserve_router_decode_prefix_hits",
                                          "Requests the P/D decider served whole on a decode worker that already "
                                          "cached all but fewer than --pd-min-uncached-tokens of the prompt.",
                                          registry=r)
        self.kv_index_blocks = Gauge("pdserve_router_kv_index_blocks",
                                     "KV blocks each worker reported cached (prefix-aware's index).", ["worker"],
                                     registry=r)

        # Exact mid-stream migration (migration.py).
        self.migrations = Counter("pdserve_router_migrations",
                                  "Streams continued on another worker, by why their worker was left: lost "
                                  "(reset, ended without [DONE], or no decode worker took the hand-off), "
                                  "stalled (--stream-idle-timeout), drained (ended aborted) or busy (every "
                                  "decode worker of the hand-off answered 429).",
                                  ["cause"], registry=r)
        self.migration_reprefilled_tokens = Counter("pdserve_router_migration_reprefilled_tokens",
                                                    "Tokens the continuations prefilled again: prompt (as "
                                                    "arrived_prompt_tokens counts it) plus the tokens generated "
                                                    "before the move.", registry=r)
        self.migration_gap = Histogram("pdserve_router_migration_gap_seconds",
                                       "The stall a client sees at a migration: from the last event relayed from "
                                       "the lost worker to the first from the new one.", buckets=_LATENCY_BUCKETS,
                                       registry=r)

        # Declared with flow control off too: dashboards find the series, empty.
        self.flow = FlowMetrics(r)

    def child(self, metric, *values: str):
        """`metric.labels(*values)`, kept: `labels()` takes a lock and checks its arguments on
        every call (~1.5 µs), and the request path asks for the same few children per request.
        No child is ever removed from these metrics, so a kept one stays the registry's."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
