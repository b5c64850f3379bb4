"""Services (the router's front door and one headless Service per worker role) and the
workers' NetworkPolicy (pure builders)."""

from __future__ import annotations

from typing import Any

from pdserve.operator import naming
from pdserve.operator.spec import ModelServing
from pdserve.protocol.contract import (
    HTTP_PORT,
    HTTP_PORT_NAME,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    ROLE_DECODE,
    ROLE_PREFILL,
)

NETWORK_POLICY_VERSION = "networking.k8s.io/v1"
# Who scrapes /metrics when a ServiceMonitor is made and networkPolicy.metricsFrom is unset:
# Prometheus pods (the Prometheus operator labels them so) in any namespace.
DEFAULT_SCRAPERS = (
    {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
)


def endpoint(ms: ModelServing) -> str:
    """The in-cluster URL clients use; status.endpoint."""
    return f"http://{naming.child_name(ms, 'router')}.{ms.namespace}.svc:{ms.spec.router.service_port}"


def build_router_service(ms: ModelServing) -> dict[str, Any]:
    r = ms.spec.router
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(ms, "router"),
        "spec": {
            "type": r.service_type,
            "selector": naming.selector_labels(ms, "router"),
            "ports": [
                {"name": HTTP_PORT_NAME, "port": r.service_port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def build_worker_service(ms: ModelServing, role: str) -> dict[str, Any]:
    """Headless: one DNS record per ready worker, and Endpoints the router can watch and scrape."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(ms, role),
        "spec": {
            "clusterIP": "None",
            "selector": naming.selector_labels(ms, role),
            "ports": [
                {"name": HTTP_PORT_NAME, "port": HTTP_PORT, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"},
            ] + [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                 for name, port in naming.kv_ports(ms, role)],
        },
    }


def metrics_scrapers(ms: ModelServing) -> tuple[dict[str, Any], ...]:
    s = ms.spec
    if s.metrics_from is not None:
        return tuple(dict(p) for p in s.metrics_from)
    return DEFAULT_SCRAPERS if s.service_monitor else ()


def build_worker_network_policy(ms: ModelServing) -> dict[str, Any]:
    """Ingress to prefill and decode pods only from this ModelServing's own pods (and scrapers).

    - Workers of this ModelServing: every TCP port. The KV side channel has known ports (one per
      prefill rank: naming.kv_ports), but NIXL's UCX TCP transport listens on ephemeral ports it
      picks at start-up, which cannot be listed here. (RDMA traffic bypasses the kernel's network stack, so no
      NetworkPolicy sees it.)
    - Routers of this ModelServing: the HTTP port, plus the KV-event ports when a prefix-aware
      policy subscribes to them.
    - Metric scrapers (networkPolicy.metricsFrom): the HTTP port, where /metrics is served; a
      NetworkPolicy works on ports, not paths, so they reach /v1 too, which the workers' API key
      guards (as it guards /metrics: the ServiceMonitor carries the key).
    Kubelet probes come from the node and are admitted by every common policy implementation.
    Only ingress is restricted: workers still reach DNS, the Hub and the API server.
    """
    workers = {"podSelector": {"matchExpressions": [
        {"key": naming.LABEL_MODELSERVING, "operator": "In", "values": [ms.name]},
        {"key": naming.LABEL_ROLE, "operator": "In", "values": [ROLE_PREFILL, ROLE_DECODE]}]}}
    http = [{"protocol": "TCP", "port": HTTP_PORT}]
    router_ports = list(http)
    if ms.spec.router.prefix_aware:
        router_ports += [
            {"protocol": "TCP", "port": KV_EVENTS_PORT},
            {"protocol": "TCP", "port": KV_EVENTS_REPLAY_PORT},
        ]
    ingress = [
        {"from": [workers], "ports": [{"protocol": "TCP"}]},  # no port: every TCP port
        {"from": [{"podSelector": {"matchLabels": naming.selector_labels(ms, "router")}}], "ports": router_ports},
    ]
    if scrapers := metrics_scrapers(ms):
        ingress.append({"from": list(scrapers), "ports": http})
    return {
        "apiVersion": NETWORK_POLICY_VERSION,
        "kind": "NetworkPolicy",
        "metadata": naming.metadata(ms, "workers"),
        "spec": {"podSelector": workers["podSelector"], "policyTypes": ["Ingress"], "ingress": ingress},
    }
