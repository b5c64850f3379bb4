"""Children that exist only where the cluster serves their API: HPA, PDB, ServiceMonitor.

Versions come from `ApiVersions` (discovered at run time): Kubernetes 1.20 serves
autoscaling/v2beta2 and policy/v1beta1, current releases autoscaling/v2 and policy/v1; the
manifests below are the same shape in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.operator import naming
from pdserve.operator.spec import Autoscaling, ModelServing, SecretKeyRef
from pdserve.protocol.contract import HTTP_PORT_NAME, ROLE_DECODE, ROLE_PREFILL

HPA_VERSIONS = ("autoscaling/v2", "autoscaling/v2beta2")
PDB_VERSIONS = ("policy/v1", "policy/v1beta1")
SERVICE_MONITOR_VERSION = "monitoring.coreos.com/v1"


@dataclass(frozen=True)
class ApiVersions:
    """Which optional APIs the cluster serves; None where it serves none we can use."""

    hpa: str | None = None
    pdb: str | None = None
    service_monitor: str | None = None

    def __post_init__(self) -> None:
        for value, allowed in ((self.hpa, HPA_VERSIONS), (self.pdb, PDB_VERSIONS),
                               (self.service_monitor, (SERVICE_MONITOR_VERSION,))):
            if value is not None and value not in allowed:
                raise ValueError(f"unsupported API version {value!r} (expected one of {allowed})")

    @classmethod
    def choose(cls, served: Mapping[str, set[str]]) -> "ApiVersions":
        """`served` maps group/version strings to the resource names served there."""

        def first(candidates: tuple[str, ...], resource: str) -> str | None:
            return next((gv for gv in candidates if resource in served.get(gv, ())), None)

        return cls(
            hpa=first(HPA_VERSIONS, "horizontalpodautoscalers"),
            pdb=first(PDB_VERSIONS, "poddisruptionbudgets"),
            service_monitor=first((SERVICE_MONITOR_VERSION,), "servicemonitors"),
        )


def hpa_bounds(a: Autoscaling, other_replicas: int | None, lo_ratio: float | None,
               hi_ratio: float | None) -> tuple[int, int]:
    """(min, max) replicas for a prefill HPA, kept within lo..hi prefill per decode replica.

    For the decode HPA, pass the ratios inverted (decode per prefill). The user's own bounds
    always hold; where they and the ratio cannot both hold, the user's bounds win.
    """
    lo, hi = a.min_replicas, a.max_replicas
    if other_replicas is not None:
        if lo_ratio is not None:
            lo = max(lo, math.ceil(lo_ratio * other_replicas - 1e-9))
        if hi_ratio is not None:
            hi = min(hi, math.floor(hi_ratio * other_replicas + 1e-9))
    lo = min(max(lo, a.min_replicas), a.max_replicas)
    hi = max(min(hi, a.max_replicas), lo)
    return lo, hi


def build_hpa(ms: ModelServing, role: str, api_version: str, bounds: tuple[int, int]) -> dict[str, Any]:
    a = ms.spec.role(role).autoscaling
    assert a is not None, "build_hpa is only called for roles with autoscaling"
    return {
        "apiVersion": api_version,
        "kind": "HorizontalPodAutoscaler",
        "metadata": naming.metadata(ms, role),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": naming.child_name(ms, role)},
            "minReplicas": bounds[0],
            "maxReplicas": bounds[1],
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": a.metric},
                        "target": {"type": "AverageValue", "averageValue": a.target_average_value},
                    },
                }
            ],
        },
    }


def build_pdb(ms: ModelServing, role: str, api_version: str) -> dict[str, Any]:
    """At most one pod of a role evicted at a time (node drains keep the rest serving)."""
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": naming.metadata(ms, role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": naming.selector_labels(ms, role)}},
    }


def _meta(kind: str, label: str) -> str:
    """The discovery label Prometheus exposes for a Kubernetes label (names sanitised to [a-z0-9_])."""
    return f"__meta_kubernetes_{kind}_label_" + "".join(c if c.isalnum() else "_" for c in label)


ROLE_META_LABEL = _meta("service", naming.LABEL_ROLE)
# What the Grafana dashboards filter and group on (the chart's monitors add the same labels).
DASHBOARD_RELABELINGS = tuple(
    [{"sourceLabels": [_meta("pod", label)], "targetLabel": target}
     for label, target in ((naming.LABEL_ROLE, "role"), (naming.LABEL_MODELSERVING, "modelserving"),
                           (naming.LABEL_REVISION, "revision"))]
    + [{"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"},
       {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "pod"}])


def _metrics_endpoint(roles: str, token: SecretKeyRef | None) -> dict[str, Any]:
    """Scrape /metrics of the Services whose role matches `roles` (a regex), with the Secret
    key as bearer token when the target needs one."""
    endpoint: dict[str, Any] = {
        "port": HTTP_PORT_NAME, "path": "/metrics", "interval": "15s",
        "relabelings": [{"sourceLabels": [ROLE_META_LABEL], "regex": roles, "action": "keep"},
                        *(dict(r) for r in DASHBOARD_RELABELINGS)]}
    if token is not None:
        endpoint["bearerTokenSecret"] = {"name": token.name, "key": token.key}
    return endpoint


def build_service_monitor(ms: ModelServing) -> dict[str, Any]:
    """Scrapes /metrics on every Service of this ModelServing, one endpoint per credential: the
    workers' with their API key (a keyed worker answers /metrics 401 without it); the router's
    with its client key Secret when it has one (that Secret must then hold a single key: the
    whole value is sent as the token)."""
    workers = f"{ROLE_PREFILL}|{ROLE_DECODE}"
    return {
        "apiVersion": SERVICE_MONITOR_VERSION,
        "kind": "ServiceMonitor",
        "metadata": naming.metadata(ms, "metrics", name=ms.name),
        "spec": {
            "selector": {"matchLabels": {naming.LABEL_MODELSERVING: ms.name}},
            "namespaceSelector": {"matchNames": [ms.namespace]},
            "endpoints": [_metrics_endpoint(workers, naming.worker_api_key_ref(ms)),
                          _metrics_endpoint("router", ms.spec.router.api_key_secret)],
        },
    }
