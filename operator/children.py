"""Every child manifest of one ModelServing, in apply order (pure). The generated Secrets are
not among them: each is created once, never applied (operator/generated_secrets.py)."""

from __future__ import annotations

from typing import Any, Mapping

from pdserve.operator import networking, optional, rbac, workloads
from pdserve.operator.optional import ApiVersions
from pdserve.operator.spec import ModelServing

# Kinds that come and go with the spec or the cluster's APIs; the reconciler prunes these.
PRUNABLE = ("HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor", "NetworkPolicy")


def autoscaler_bounds(ms: ModelServing, role: str, replicas_now: Mapping[str, int]) -> tuple[int, int]:
    """HPA bounds for a role, with the prefill:decode ratio applied against the other role's
    current replica count (prefill follows decode; decode follows prefill only when prefill is
    not itself autoscaled)."""
    s = ms.spec
    a = s.role(role).autoscaling
    assert a is not None
    if role == "prefill":
        return optional.hpa_bounds(a, replicas_now.get("decode"), s.ratio_min, s.ratio_max)
    if s.prefill.autoscaling is not None:
        return a.min_replicas, a.max_replicas
    inv = lambda r: None if not r else 1.0 / r  # noqa: E731  decode-per-prefill bounds swap ends
    return optional.hpa_bounds(a, replicas_now.get("prefill"), inv(s.ratio_max), inv(s.ratio_min))


def build_children(ms: ModelServing, versions: ApiVersions, replicas_now: Mapping[str, int]) -> list[dict[str, Any]]:
    """`replicas_now`: current Deployment replicas per worker role (for the ratio bound)."""
    out: list[dict[str, Any]] = [
        rbac.build_router_service_account(ms),
        rbac.build_router_role(ms),
        rbac.build_router_role_binding(ms),
        rbac.build_worker_service_account(ms),
    ]
    for role in ("prefill", "decode"):
        out += [networking.build_worker_service(ms, role), workloads.build_worker_deployment(ms, role)]
    out += [networking.build_router_service(ms), workloads.build_router_deployment(ms)]
    if ms.spec.network_policy:
        out.append(networking.build_worker_network_policy(ms))
    if versions.hpa:
        for role in ("prefill", "decode"):
            # With spec.slo the planner (operator/autoscaler.py) owns the count instead.
            if ms.spec.role(role).autoscaling is not None and ms.spec.slo is None:
                out.append(optional.build_hpa(ms, role, versions.hpa, autoscaler_bounds(ms, role, replicas_now)))
    if versions.pdb:
        out += [optional.build_pdb(ms, role, versions.pdb) for role in ("prefill", "decode", "router")]
    if versions.service_monitor and ms.spec.service_monitor:
        out.append(optional.build_service_monitor(ms))
    return out
