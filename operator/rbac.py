"""ServiceAccounts and RBAC: one account per workload (the router's may read pods and endpoints
in its namespace; the workers' holds nothing and mounts no token), and the operator's own
minimum ClusterRole."""

from __future__ import annotations

from typing import Any

from pdserve.operator import naming
from pdserve.operator.spec import ModelServing

# What router discovery reads: pods (IP, labels, readiness), Endpoints, EndpointSlices.
ROUTER_RULES = [
    {"apiGroups": [""], "resources": ["pods", "endpoints"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
]


def build_router_service_account(ms: ModelServing) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": naming.metadata(ms, "router")}


def build_worker_service_account(ms: ModelServing) -> dict[str, Any]:
    """Shared by prefill and decode pods, so they do not run as the namespace's `default`."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": naming.metadata(ms, "worker"),
            "automountServiceAccountToken": False}


def build_router_role(ms: ModelServing) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": naming.metadata(ms, "router"),
        "rules": ROUTER_RULES,
    }


def build_router_role_binding(ms: ModelServing) -> dict[str, Any]:
    name = naming.child_name(ms, "router")
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": naming.metadata(ms, "router"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ms.namespace}],
    }


_WRITE = ["get", "list", "watch", "create", "update", "patch", "delete"]


def build_operator_cluster_role(name: str = "pdserve-operator") -> dict[str, Any]:
    """The least the operator needs. The chart installs it; the real-server tests run under it.

    It must itself hold the router's read rules: RBAC refuses to grant more than the granter has.
    Namespace-scoped installs can bind the same rules with a RoleBinding per namespace.
    """
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [
            {
                "apiGroups": [naming.GROUP],
                "resources": [naming.PLURAL],
                "verbs": ["get", "list", "watch", "patch", "update"],
            },
            {
                "apiGroups": [naming.GROUP],
                "resources": [f"{naming.PLURAL}/status"],
                "verbs": ["get", "patch", "update"],
            },
            # blockOwnerDeletion on children needs update on the owner's finalizers
            {"apiGroups": [naming.GROUP], "resources": [f"{naming.PLURAL}/finalizers"], "verbs": ["update"]},
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": _WRITE},
            # the spec.slo planner (operator/autoscaler.py): sizes the worker Deployments through
            # their scale subresource, and marks the idlest pods to go first on a scale-down
            {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch", "update"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
            {"apiGroups": [""], "resources": ["services", "serviceaccounts"], "verbs": _WRITE},
            {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": _WRITE},
            {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"], "verbs": _WRITE},
            {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": _WRITE},
            {"apiGroups": ["monitoring.coreos.com"], "resources": ["servicemonitors"], "verbs": _WRITE},
            # the workers' NetworkPolicy: applied, listed and deleted (pruned) when turned off
            {
                "apiGroups": ["networking.k8s.io"],
                "resources": ["networkpolicies"],
                "verbs": ["get", "list", "create", "patch", "delete"],
            },
            # the generated KV Secret: created once and read back, never updated, listed or
            # deleted (the garbage collector deletes it with its ModelServing)
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
            *ROUTER_RULES,
            {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
            # kopf lists namespaces in --all-namespaces mode and CRDs to resolve resources
            {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": ["apiextensions.k8s.io"],
                "resources": ["customresourcedefinitions"],
                "verbs": ["get", "list", "watch"],
            },
        ],
    }
