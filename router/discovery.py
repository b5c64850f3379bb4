"""Where the workers are: a static list, or Kubernetes endpoints of labelled pods.

Kubernetes: the pods matching `--selector` in `--namespace` give each worker's role
(`pdserve.io/role`: prefill | decode | both) and revision (`pdserve.io/revision`). A pod is
routable when an endpoint object lists it ready: EndpointSlices where the server serves them
(`discovery.k8s.io/v1`, else `v1beta1` as on Kubernetes 1.20), else core `Endpoints`.
A pod no Service selects has no endpoint object at all; then its own Ready condition and podIP
are used, so a prefill pool needs no Service of its own. Reads are periodic lists (resync every
`--discovery-interval`), which survive API-server restarts without watch bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.protocol.contract import (HTTP_PORT, HTTP_PORT_NAME, LABEL_REVISION, LABEL_ROLE, ROLE_BOTH, ROLE_DECODE,
                                       ROLE_PREFILL)
from pdserve.router.config import RouterConfig
from pdserve.router.workers import WorkerSet, WorkerSpec

log = logging.getLogger("pdserve.router")


class StaticDiscovery:
    def __init__(self, config: RouterConfig):
        self._specs = [WorkerSpec(u, "prefill") for u in config.prefill_urls] + [
            WorkerSpec(u, "decode") for u in config.decode_urls]

    async def snapshot(self) -> list[WorkerSpec]:
        return list(self._specs)

    async def follow(self, workers: WorkerSet) -> None:
        return None


def _roles(role: str | None) -> tuple[str, ...]:
    return {ROLE_PREFILL: (ROLE_PREFILL,), ROLE_DECODE: (ROLE_DECODE,),
            ROLE_BOTH: (ROLE_PREFILL, ROLE_DECODE)}.get(role or "", ())


def _pod_port(pod: dict) -> int:
    for container in pod.get("spec", {}).get("containers", []):
        for port in container.get("ports") or []:
            if port.get("name") == HTTP_PORT_NAME:
                return int(port["containerPort"])
    return HTTP_PORT


def _pod_ready(pod: dict) -> bool:
    status = pod.get("status", {})
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return status.get("phase") == "Running" and conditions.get("Ready") == "True" and bool(status.get("podIP"))


def endpoints_from_slices(slices: list[dict]) -> tuple[dict[str, tuple[str, int]], set[str]]:
    """(ready pod name -> (ip, port), every pod name any slice mentions)."""
    ready, seen = {}, set()
    for s in slices:
        port = next((p.get("port") for p in s.get("ports") or [] if p.get("name") == HTTP_PORT_NAME), None)
        for ep in s.get("endpoints") or []:
            ref = ep.get("targetRef") or {}
            if ref.get("kind") != "Pod" or not ep.get("addresses"):
                continue
            seen.add(ref["name"])
            if (ep.get("conditions") or {}).get("ready") is not False and port:
                ready[ref["name"]] = (ep["addresses"][0], int(port))
    return ready, seen


def endpoints_from_endpoints(items: list[dict]) -> tuple[dict[str, tuple[str, int]], set[str]]:
    ready, seen = {}, set()
    for e in items:
        for subset in e.get("subsets") or []:
            port = next((p.get("port") for p in subset.get("ports") or [] if p.get("name") == HTTP_PORT_NAME), None)
            for key, is_ready in (("addresses", True), ("notReadyAddresses", False)):
                for addr in subset.get(key) or []:
                    ref = addr.get("targetRef") or {}
                    if ref.get("kind") != "Pod":
                        continue
                    seen.add(ref["name"])
                    if is_ready and port:
                        ready[ref["name"]] = (addr["ip"], int(port))
    return ready, seen


def specs_from(pods: list[dict], ready: dict[str, tuple[str, int]], seen: set[str]) -> list[WorkerSpec]:
    specs = []
    for pod in pods:
        meta = pod.get("metadata", {})
        labels, name = meta.get("labels") or {}, meta.get("name")
        if meta.get("deletionTimestamp"):
            continue
        if name in ready:
            ip, port = ready[name]
        elif name not in seen and _pod_ready(pod):
            ip, port = pod["status"]["podIP"], _pod_port(pod)
        else:
            continue
        host = f"[{ip}]" if ":" in ip else ip
        for role in _roles(labels.get(LABEL_ROLE)):
            specs.append(WorkerSpec(f"http://{host}:{port}", role, labels.get(LABEL_REVISION)))
    return sorted(specs, key=lambda s: (s.role, s.url))


class KubernetesDiscovery:
    # Newest first. v1beta1 matters beyond old clusters' sake: core Endpoints reject loopback
    # addresses, EndpointSlices accept them (local test clusters put pods on 127.0.0.x).
    SLICE_VERSIONS = ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1")

    def __init__(self, config: RouterConfig):
        from kubernetes import client, config as kube_config, dynamic

        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        # The dynamic client reads any group/version the server serves, whatever the Python
        # client's generated models cover (v1beta1 slices are gone from recent clients).
        self._dyn = dynamic.DynamicClient(client.ApiClient())
        self._endpoint_api = None
        self._namespace = config.namespace
        self._selector = config.selector
        self._interval_s = config.discovery_interval_s

    def _resource(self, api_version: str, kind: str):
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        try:
            return self._dyn.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            return None

    def _list_items(self, resource, **kw) -> list[dict]:
        return resource.get(namespace=self._namespace, **kw).to_dict().get("items") or []

    def _list(self) -> list[WorkerSpec]:
        if self._endpoint_api is None:
            found = next(((v, r) for v in self.SLICE_VERSIONS if (r := self._resource(v, "EndpointSlice"))), None)
            self._endpoint_api = found or ("v1", self._resource("v1", "Endpoints"))
            log.info("discovery: reading %s %s", self._endpoint_api[0], "EndpointSlices" if found else "Endpoints")
        version, resource = self._endpoint_api
        pods = self._list_items(self._resource("v1", "Pod"), label_selector=self._selector)
        items = self._list_items(resource)
        ready, seen = (endpoints_from_slices if version.startswith("discovery") else endpoints_from_endpoints)(items)
        return specs_from(pods, ready, seen)

    async def snapshot(self) -> list[WorkerSpec]:
        try:
            return await asyncio.to_thread(self._list)
        except Exception as e:  # the API server may be briefly away; start empty, follow() catches up
            log.warning("discovery: list failed: %r", e)
            return []

    async def follow(self, workers: WorkerSet) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                workers.update(await asyncio.to_thread(self._list))
            except Exception as e:  # keep the last known workers while the API server is away
                log.warning("discovery: list failed, keeping %d workers: %r", len(workers.all()), e)


def make_discovery(config: RouterConfig):
    return KubernetesDiscovery(config) if config.discovery == "kubernetes" else StaticDiscovery(config)
