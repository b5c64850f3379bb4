"""The few Kubernetes calls the operator makes, through the client's DynamicClient.

Children are written with server-side apply (field manager `pdserve-operator`, forced): one
idempotent PATCH per child creates or updates it, leaves fields other managers own alone (an
HPA's replica count), and is safe to repeat after an operator restart. The DynamicClient
resolves each kind's path from the server's discovery documents, so no group, version or
plural is written down here, and optional APIs that appear later are found.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from pdserve.operator import naming
from pdserve.operator.optional import HPA_VERSIONS, PDB_VERSIONS, SERVICE_MONITOR_VERSION, ApiVersions

# (group/version, kind) pairs the optional children may use, newest first
_OPTIONAL = [*((v, "HorizontalPodAutoscaler") for v in HPA_VERSIONS),
             *((v, "PodDisruptionBudget") for v in PDB_VERSIONS),
             (SERVICE_MONITOR_VERSION, "ServiceMonitor")]


class Kube:
    """Thin wrapper; owns discovery caching (optional APIs can appear while we run)."""

    def __init__(self, api_client: client.ApiClient, discovery_ttl_s: float = 60.0):
        self.api_client = api_client
        self.discovery_ttl_s = discovery_ttl_s
        self._dyn: dynamic.DynamicClient | None = None
        self._versions: ApiVersions | None = None
        self._discovered_at = 0.0
        # kopf runs sync handlers on a thread pool; the client's discovery cache is not thread-safe
        self._lock = threading.RLock()

    @property
    def dyn(self) -> dynamic.DynamicClient:
        """Created on first use: it reads discovery documents, and an API server that is away
        at start-up should fail one reconcile (retried), not the operator's start."""
        with self._lock:
            if self._dyn is None:
                self._dyn = dynamic.DynamicClient(self.api_client)
            return self._dyn

    def resource(self, api_version: str, kind: str):
        with self._lock:
            return self.dyn.resources.get(api_version=api_version, kind=kind)

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        res = self.resource(manifest["apiVersion"], manifest["kind"])
        for attempt in range(3):
            try:
                return res.server_side_apply(body=manifest, namespace=manifest["metadata"]["namespace"],
                                             field_manager=naming.FIELD_MANAGER, force_conflicts=True).to_dict()
            except ApiException as e:
                # Two reconciles (an event handler and the timer) may both create the object;
                # the loser gets 409 AlreadyExists, and applying again updates it instead.
                if e.status != 409 or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """A plain create (409 if it exists): for objects made once and never re-applied."""
        res = self.resource(manifest["apiVersion"], manifest["kind"])
        return res.create(body=manifest, namespace=manifest["metadata"]["namespace"]).to_dict()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.resource(api_version, kind).get(name=name, namespace=namespace).to_dict()
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        out = self.resource(api_version, kind).get(namespace=namespace, label_selector=selector).to_dict()
        return out.get("items") or []

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        try:
            self.resource(api_version, kind).delete(name=name, namespace=namespace,
                                                   body={"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status != 404:
                raise

    def patch_status(self, obj: dict[str, Any], status: dict[str, Any]) -> None:
        """Merge-patch the status subresource (lists such as conditions are replaced whole)."""
        m = obj["metadata"]
        self.resource(obj["apiVersion"], obj["kind"]).status.patch(
            body={"metadata": {"name": m["name"]}, "status": status}, namespace=m["namespace"],
            content_type="application/merge-patch+json")

    def versions(self) -> ApiVersions:
        """Which optional APIs are served, re-discovered at most every discovery_ttl_s."""
        now = time.monotonic()
        if self._versions is None or now - self._discovered_at > self.discovery_ttl_s:
            with self._lock:
                # Start from the server's current group list: a CRD installed or removed since
                # the last look must count, and the client's cache file may be another
                # process's, or old.
                self.dyn.resources.invalidate_cache()
                served: dict[str, set[str]] = {}
                for gv, kind in _OPTIONAL:
                    try:
                        res = self.dyn.resources.get(api_version=gv, kind=kind)
                    except ResourceNotFoundError:
                        continue
                    served.setdefault(gv, set()).add(res.name)
            self._versions, self._discovered_at = ApiVersions.choose(served), now
        return self._versions


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or ())
