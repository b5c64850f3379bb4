"""Services: the router's front door and one headless Service per worker role (pure builders)."""

from __future__ import annotations

from typing import Any

from pdserve.operator import naming
from pdserve.operator.spec import ModelServing
from pdserve.operator.pods import HTTP_PORT


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
            "ports": [{"name": "http", "port": r.service_port, "targetPort": "http", "protocol": "TCP"}],
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
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "kv", "port": ms.spec.kv_port, "targetPort": "kv", "protocol": "TCP"},
            ],
        },
    }
