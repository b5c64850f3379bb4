"""The few Kubernetes calls the operator makes, over the official client's ApiClient.

Children are written with server-side apply (field manager `pdserve-operator`, forced): one
idempotent PATCH per child creates or updates it, leaves fields other managers own alone (an
HPA's replica count), and is safe to repeat after an operator restart.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable

from kubernetes import client
from kubernetes.client.rest import ApiException

from pdserve.operator import naming
from pdserve.operator.optional import ApiVersions

# kind -> plural; every kind the operator reads or writes
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "Pod": "pods",
    "ModelServing": naming.PLURAL,
}
_DISCOVERY_CANDIDATES = ("autoscaling/v2", "autoscaling/v2beta2", "policy/v1", "policy/v1beta1", "monitoring.coreos.com/v1")


def path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    p = f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{p}/{name}" if name else p


class Kube:
    """Thin wrapper; owns discovery caching (optional APIs can appear while we run)."""

    def __init__(self, api_client: client.ApiClient, discovery_ttl_s: float = 60.0):
        self.api = api_client
        self.discovery_ttl_s = discovery_ttl_s
        self._versions: ApiVersions | None = None
        self._discovered_at = 0.0

    def request(self, method: str, url: str, body: Any = None, query: list | None = None,
                content_type: str | None = None, accept: str = "application/json") -> Any:
        """One API call; returns the decoded JSON body, raises ApiException on non-2xx."""
        headers = {"Accept": accept}
        if content_type:
            headers["Content-Type"] = content_type
        elif body is not None:
            headers["Content-Type"] = "application/json"
        if not hasattr(self.api, "param_serialize"):  # kubernetes client before the v7 generator
            return self.api.call_api(url, method, query_params=query or [], header_params=headers, body=body,
                                     response_type="object", auth_settings=["BearerToken"],
                                     _return_http_data_only=True)
        resp = self.api.call_api(*self.api.param_serialize(
            method, url, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]))
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException(http_resp=resp)
        return json.loads(resp.data) if resp.data else None

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        m = manifest["metadata"]
        url = path(manifest["apiVersion"], manifest["kind"], m["namespace"], m["name"])
        for attempt in range(3):
            try:
                return self.request("PATCH", url, body=manifest, content_type="application/apply-patch+yaml",
                                    query=[("fieldManager", naming.FIELD_MANAGER), ("force", "true")])
            except ApiException as e:
                # Two reconciles (an event handler and the timer) may both create the object;
                # the loser gets 409 AlreadyExists, and applying again updates it instead.
                if e.status != 409 or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path(api_version, kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        out = self.request("GET", path(api_version, kind, namespace), query=[("labelSelector", selector)])
        return out.get("items") or []

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        try:
            self.request("DELETE", path(api_version, kind, namespace, name),
                       body={"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status != 404:
                raise

    def patch_status(self, obj: dict[str, Any], status: dict[str, Any]) -> None:
        """Merge-patch the status subresource (lists such as conditions are replaced whole)."""
        m = obj["metadata"]
        url = path(obj["apiVersion"], obj["kind"], m["namespace"], m["name"]) + "/status"
        self.request("PATCH", url, body={"status": status}, content_type="application/merge-patch+json")

    def versions(self) -> ApiVersions:
        """Which optional APIs are served, re-discovered at most every discovery_ttl_s."""
        now = time.monotonic()
        if self._versions is None or now - self._discovered_at > self.discovery_ttl_s:
            groups = self.request("GET", "/apis").get("groups") or []
            listed = {v["groupVersion"] for g in groups for v in g.get("versions") or ()}
            served: dict[str, set[str]] = {}
            for gv in _DISCOVERY_CANDIDATES:
                if gv in listed:
                    resources = self.request("GET", f"/apis/{gv}").get("resources") or []
                    served[gv] = {r["name"] for r in resources}
            self._versions, self._discovered_at = ApiVersions.choose(served), now
        return self._versions


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or ())


def names(objs: Iterable[dict[str, Any]]) -> set[str]:
    return {o["metadata"]["name"] for o in objs}
