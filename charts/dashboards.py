"""The Grafana dashboards, written as data: `charts/sync.py` renders them into
charts/pdserve/dashboards/*.json (importable into Grafana as they are, and shipped by the chart
as one sidecar ConfigMap each).

Every query filters on the labels the chart's PodMonitor/ServiceMonitor relabel from pod labels
(namespace, modelserving, role, pod); tests/charts checks that each metric name a query uses is
one a running worker or router exports, and evaluates every query on a real Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass

SEL = 'namespace=~"$namespace", modelserving=~"$modelserving"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    description: str = ""


def quantiles(metric: str, extra: str = "", by: str = "", qs=(0.5, 0.9, 0.99), legend: str = "") -> tuple:
    """p50/p90/p99 of a Prometheus histogram, optionally split by a label."""
    sel = SEL + (f", {extra}" if extra else "")
    group = f"le, {by}" if by else "le"
    return tuple((f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{sel}}}[{RATE}])))",
                  f"{legend}p{int(q * 100)}" + (f" {{{{{by}}}}}" if by else "")) for q in qs)


def per_second(metric: str, by: str = "", extra: str = "", legend: str = "") -> tuple[str, str]:
    sel = SEL + (f", {extra}" if extra else "")
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} (rate({metric}{{{sel}}}[{RATE}]))", legend or (f"{{{{{by}}}}}" if by else metric)


DASHBOARDS: dict[str, tuple[str, str, list[Panel]]] = {
    "pd-overview": ("pdserve / P/D overview", "Requests through the router, their latencies at the router and on the "
                    "workers, and how many were disaggregated.", [
        Panel("Request rate by status", (per_second("pdserve_router_requests_total", "status"),), "reqps"),
        Panel("Disaggregated share", ((f'sum(rate(pdserve_router_requests_total{{{SEL}, disaggregated="yes"}}'
                                       f'[{RATE}])) '
                                       f'/ sum(rate(pdserve_router_requests_total{{{SEL}}}[{RATE}]))', "P/D share"),),
              "percentunit", "stat",
              "Requests prefilled on a prefill worker and decoded on another (the rest ran on one decode worker)."),
        Panel("Error rate (non-2xx)", ((f'sum(rate(pdserve_router_requests_total{{{SEL}, status!~"2.."}}[{RATE}])) '
                                        f'/ sum(rate(pdserve_router_requests_total{{{SEL}}}[{RATE}]))', "errors"),),
              "percentunit", "stat"),
        Panel("Workers serving", ((f"count by (role) (vllm:num_requests_running{{{SEL}}})", "{{role}}"),), "short",
              "stat"),
        Panel("Time to first token (router)", quantiles("pdserve_router_time_to_first_token_seconds"), "s"),
        Panel("Time to first token (workers)", quantiles("vllm:time_to_first_token_seconds", by="role"), "s",
              description="On a decode worker of a P/D request this starts when the decode request arrives."),
        Panel("Inter-token latency (decode workers)", quantiles("vllm:inter_token_latency_seconds", 'role="decode"'),
              "s"),
        Panel("End-to-end latency (router)", quantiles("pdserve_router_e2e_latency_seconds"), "s"),
        Panel("End-to-end latency (workers)", quantiles("vllm:e2e_request_latency_seconds", by="role"), "s"),
        Panel("Requests by P/D", (per_second("pdserve_router_requests_total", "disaggregated"),), "reqps"),
        Panel("First-to-second token gap (router)", quantiles("pdserve_router_first_token_gap_seconds",
                                                              by="disaggregated"), "s",
              description="The stall a client sees after its first token; on a P/D request (yes) the hand-off to "
                          "the decode worker is inside it."),
        Panel("Hand-off on decode workers", quantiles("pdserve_kv_decode_admission_wait_seconds", qs=(0.5, 0.99),
                                                      legend="admission wait ")
              + quantiles("pdserve_kv_transfer_seconds", 'direction="recv"', qs=(0.5, 0.99), legend="KV pull ")
              + quantiles("pdserve_kv_pull_tail_seconds", 'direction="recv"', qs=(0.5, 0.99), legend="KV tail ")
              + quantiles("pdserve_kv_first_step_wait_seconds", qs=(0.5, 0.99), legend="landed to first step "), "s",
              description="A P/D request on its decode worker, in order: arrival to admission with blocks, the KV "
                          "pull (of which the tail: what a streamed pull had left once the prefill was done), the "
                          "pull landed to the first decode step's token."),
    ]),
    "workers": ("pdserve / workers", "Engine state of every prefill and decode worker.", [
        Panel("Running requests", ((f"sum by (pod, role) (vllm:num_requests_running{{{SEL}}})", "{{role}} {{pod}}"),)),
        Panel("Waiting requests", ((f"sum by (pod, role) (vllm:num_requests_waiting{{{SEL}}})", "{{role}} {{pod}}"),)),
        Panel("KV cache usage", ((f"max by (pod, role) (vllm:kv_cache_usage_perc{{{SEL}}})", "{{role}} {{pod}}"),),
              "percentunit"),
        Panel("Prefix cache hit rate", ((f"sum by (role) (rate(vllm:prefix_cache_hits_total{{{SEL}}}[{RATE}])) "
                                         f"/ sum by (role) (rate(vllm:prefix_cache_queries_total{{{SEL}}}[{RATE}]))",
                                         "{{role}}"),),
              "percentunit", description="Prompt tokens found in the prefix cache / prompt tokens looked up."),
        Panel("Prompt tokens/s by role", (per_second("vllm:prompt_tokens_total", "role"),), "short"),
        Panel("Generated tokens/s by role", (per_second("vllm:generation_tokens_total", "role"),), "short"),
        Panel("Finished requests by reason", (per_second("vllm:request_success_total", "finished_reason"),), "reqps"),
        Panel("Preemptions/s", (per_second("vllm:num_preemptions_total", "pod"),), "short"),
        Panel("Queue time (arrival to first scheduled)", quantiles("vllm:request_queue_time_seconds", by="role"), "s",
              description="vLLM's queue time. On a decode worker a P/D request is first scheduled once its KV pull "
                          "landed, so the pull is inside it."),
        Panel("Free KV blocks", ((f"sum by (pod, role) (pdserve_kv_free_blocks{{{SEL}}})", "{{role}} {{pod}}"),
                                 (f"sum by (pod, role) (pdserve_kv_total_blocks{{{SEL}}})", "total {{pod}}"))),
        Panel("Host KV tier: blocks/s", (per_second("pdserve_kv_offload_stored_blocks_total", legend="stored"),
                                         per_second("pdserve_kv_offload_restored_blocks_total", legend="restored"),
                                         per_second("pdserve_kv_offload_evicted_blocks_total", legend="evicted")),
              "short", description="Workers with --kv-offloading-size: blocks the device cache evicted copied to "
                                   "host memory, prefix hits there copied back, and blocks the tier's LRU dropped."),
        Panel("Host KV tier: bytes/s", (per_second("pdserve_kv_offload_bytes_total", "direction"),), "Bps",
              description="Bytes copied between the device cache and the host tier (store: device to host)."),
        Panel("Host KV tier: hit rate and fill",
              ((f"sum(rate(vllm:external_prefix_cache_hits_total{{{SEL}}}[{RATE}])) "
                f"/ sum(rate(vllm:external_prefix_cache_queries_total{{{SEL}}}[{RATE}]))", "hit rate"),
               (f"sum(pdserve_kv_offload_blocks{{{SEL}}}) / sum(pdserve_kv_offload_total_blocks{{{SEL}}})", "fill")),
              "percentunit", description="Prompt tokens found in the host tier / those looked up there (the ones "
                                         "the device cache missed); blocks held / the tier's capacity."),
    ]),
    "kv-transfer": ("pdserve / KV transfer", "KV blocks moved from prefill to decode workers (NIXL or TCP).", [
        Panel("KV bytes/s", (per_second("pdserve_kv_transfer_bytes_total", "direction, transport",
                                        legend="{{direction}} {{transport}}"),), "Bps"),
        Panel("Transfer latency (decode side)", quantiles("pdserve_kv_transfer_seconds", by="transport"), "s"),
        Panel("Transfer failures/s", (per_second("pdserve_kv_transfer_failures_total", "transport"),
                                      per_second("pdserve_kv_local_prefill_fallbacks_total",
                                                 legend="local prefill fallbacks")), "short"),
        Panel("Pinned blocks (prefill side)",
              ((f'sum by (pod) (pdserve_kv_pinned_blocks{{{SEL}, role="prefill"}})', "{{pod}}"),),
              description="Blocks a prefill worker holds until a decode worker pulled them (or their TTL ends)."),
        Panel("Prefill call (router)", quantiles("pdserve_router_prefill_seconds"), "s"),
        Panel("Prefill answer to decode first byte (router)", quantiles("pdserve_router_handoff_seconds"), "s",
              description="The hand-off: the decode worker's KV pull is inside it."),
        Panel("KV bytes per request (decode side)", quantiles("pdserve_kv_transfer_request_bytes", 'direction="recv"',
                                                              by="transport"), "bytes"),
        Panel("Pull bandwidth per request (decode side)",
              quantiles("pdserve_kv_transfer_bandwidth_bytes_per_second", 'direction="recv"', by="transport"), "Bps",
              description="One request's pulled bytes over its pull's duration (a streamed pull's includes "
                          "waiting for the prefill to compute its chunks)."),
        Panel("Decode admission wait", quantiles("pdserve_kv_decode_admission_wait_seconds"), "s",
              description="A P/D request on its decode worker: from arrival to admission with its KV blocks "
                          "allocated."),
        Panel("Streamed pull's tail (decode side)", quantiles("pdserve_kv_pull_tail_seconds", 'direction="recv"',
                                                              by="transport"), "s",
              description="A streamed hand-off: from the prefill worker's reply that the prefill is done to the "
                          "pull's last block landing: the transfer's share of the first-token gap."),
        Panel("KV landed to first decode step", quantiles("pdserve_kv_first_step_wait_seconds"), "s",
              description="A P/D request on its decode worker: from its KV pull landing to its first decode "
                          "step's token."),

        Panel("Peer prefix: pull or recompute", (per_second("pdserve_kv_prefix_pull_decisions_total", "choice"),),
              "short", description="A worker handed a peer's pin of a prefix it lacks (router "
                                   "--kv-peer-prefix-min-tokens): pulled, or recomputed because the estimates "
                                   "said the pull would take longer."),
        Panel("Peer prefix: link estimate",
              ((f"max by (pod) (pdserve_kv_prefix_pull_link_bytes_per_second{{{SEL}}})", "{{pod}}"),), "Bps",
              description="The link speed each worker assumes for a pull (measured over its pulls)."),
        Panel("Peer prefix: prefill estimate",
              ((f"max by (pod) (pdserve_kv_prefix_pull_prefill_tokens_per_second{{{SEL}}})", "{{pod}}"),), "short",
              description="The prefill speed (tokens/s) each worker assumes for a recompute (measured over its "
                          "prefill steps)."),
    ]),
    "router": ("pdserve / router", "The router's view of its workers.", [
        Panel("In-flight requests per worker",
              ((f"sum by (worker) (pdserve_router_inflight{{{SEL}}})", "{{worker}}"),)),
        Panel("Retries/s by phase", (per_second("pdserve_router_retries_total", "phase"),), "short"),
        Panel("Upstream errors/s", (per_second("pdserve_router_upstream_errors_total", "worker, phase",
                                               legend="{{phase}} {{worker}}"),), "short"),
        Panel("Requests/s by route and status", (per_second("pdserve_router_requests_total", "route, status",
                                                            legend="{{route}} {{status}}"),), "reqps"),
        Panel("Cached KV blocks per worker (prefix-aware index)",
              ((f"sum by (worker) (pdserve_router_kv_index_blocks{{{SEL}}})", "{{worker}}"),)),
        Panel("Router time to first token", quantiles("pdserve_router_time_to_first_token_seconds"), "s"),
        Panel("First-to-second token gap", quantiles("pdserve_router_first_token_gap_seconds", by="disaggregated"), "s",
              description="Between the first and second token events sent to the client, by P/D."),
        Panel("Arriving demand", (per_second("pdserve_router_arrived_prompt_tokens_total", legend="prompt tokens/s"),
                                  per_second("pdserve_router_arrived_requests_total", legend="requests/s")), "short",
              description="What arrives at the routers, before any worker takes it (the spec.slo planner sizes "
                          "prefill from it; prompt tokens are estimated unless the router has a tokenizer)."),
        Panel("P/D or served whole by a decode worker that cached the prompt",
              (per_second("pdserve_router_requests_total", extra='disaggregated="yes"', legend="disaggregated/s"),
               per_second("pdserve_router_decode_prefix_hits_total", legend="whole on a caching decode worker/s")),
              "reqps",
              description="Requests the prefix-based decider (--pd-min-uncached-tokens) sent whole to a decode "
                                   "worker that already cached all but a few of their prompt tokens, against those "
                                   "disaggregated."),
        Panel("Streams moved mid-answer/s by cause", (per_second("pdserve_router_migrations_total", "cause"),),
              "short", description="Streams continued on another worker after theirs was lost, stalled or drained, "
                                   "or after every decode worker of its hand-off was busy (429) "
                                   "(router/migration.py)."),
        Panel("Client-visible gap at a migration", quantiles("pdserve_router_migration_gap_seconds"), "s",
              description="From the last event relayed from the lost worker to the first from the new one."),
        # Flow control (router/flow_control/, --flow-control-max-inflight): empty while it is off.
        Panel("Flow control: queued and let through",
              ((f"sum by (band) (pdserve_router_flow_queue_depth{{{SEL}}})", "queued, band {{band}}"),
               (f"sum (pdserve_router_flow_inflight{{{SEL}}})", "in flight")), "short",
              description="Requests waiting at the routers for a slot, by priority band (lower is served sooner), "
                          "and those let through and not yet done."),
        Panel("Flow control: queued by tenant",
              ((f"topk(10, sum by (tenant) (pdserve_router_flow_queue_depth{{{SEL}}}))", "{{tenant}}"),), "short",
              description="The ten tenants with the most requests waiting (x-gateway-inference-fairness-id, else "
                          "a hash of the API key)."),
        Panel("Flow control: wait in the queue", quantiles("pdserve_router_flow_queue_wait_seconds", by="band",
                                                           qs=(0.5, 0.99)), "s"),
        Panel("Flow control: refused (429)/s", (per_second("pdserve_router_flow_rejected_total", "reason, band"),
                                                 per_second("pdserve_router_flow_rejected_total", "tenant",
                                                            legend="tenant {{tenant}}")), "short",
              description="queue_full, queue_timeout, displaced (a more urgent band took its place), "
                          "tenant_token_rate; by tenant too."),
    ]),
}


def _variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "includeAll": True,
            "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}


def render(key: str) -> dict:
    title, description, panels = DASHBOARDS[key]
    # Stat panels share the first row; time series follow, two per row.
    stats = [p for p in panels if p.kind == "stat"]
    series = [p for p in panels if p.kind != "stat"]
    places = [(p, {"x": i * (24 // len(stats)), "y": 0, "w": 24 // len(stats), "h": 4}) for i, p in enumerate(stats)]
    top = 4 if stats else 0
    places += [(p, {"x": (i % 2) * 12, "y": top + (i // 2) * 8, "w": 12, "h": 8}) for i, p in enumerate(series)]
    out = []
    for i, (p, grid) in enumerate(places):
        panel = {
            "id": i + 1, "type": p.kind, "title": p.title, "gridPos": grid,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(p.targets)],
        }
        if p.description:
            panel["description"] = p.description
        if p.kind == "timeseries":
            panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
        out.append(panel)
    return {
        "title": title, "description": description, "uid": f"pdserve-{key}", "tags": ["pdserve"],
        "editable": True, "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"}, "graphTooltip": 1,
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "refresh": 1},
            _variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)"),
            _variable("modelserving", "ModelServing",
                      'label_values(vllm:num_requests_running{namespace=~"$namespace"}, modelserving)'),
        ]},
        "panels": out,
    }


def exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression in a rendered dashboard: panel targets and variable queries."""
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    for v in dashboard["templating"]["list"]:
        q = (v.get("query") or {}).get("query", "") if isinstance(v.get("query"), dict) else ""
        if q.startswith("label_values("):
            found.append(q[len("label_values("):].rsplit(",", 1)[0])
    return found
