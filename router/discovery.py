"""Where the workers are: a static list, or Kubernetes endpoints of labelled pods.

Kubernetes: the pods matching `--selector` in `--namespace` give each worker's role
(`pdserve.io/role`: prefill | decode | both) and revision (`pdserve.io/revision`). A pod is
routable when an endpoint object lists it ready: EndpointSlices (`discovery.k8s.io/v1`) where
the server serves them, else core `Endpoints` (Kubernetes 1.20 serves only the v1beta1 slices).
A pod no Service selects has no endpoint object at all; then its own Ready condition and podIP
are used, so a prefill pool needs no Service of its own. Reads are periodic lists (resync every
`--discovery-interval`), which survive API-server restarts without watch bookkeeping.
"""

from __future__ import annotations

import asyncio
import json
import logging

from pdserve.router.config import RouterConfig
from pdserve.router.workers import WorkerSet, WorkerSpec

log = logging.getLogger("pdserve.router")

ROLE_LABEL = "pdserve.io/role"
REVISION_LABEL = "pdserve.io/revision"
PORT_NAME = "http"
DEFAULT_PORT = 8000


class StaticDiscovery:
    def __init__(self, config: RouterConfig):
        self._specs = [WorkerSpec(u, "prefill") for u in config.prefill_urls] + [
            WorkerSpec(u, "decode") for u in config.decode_urls]

    async def snapshot(self) -> list[WorkerSpec]:
        return list(self._specs)

    async def follow(self, workers: WorkerSet) -> None:
        return None


def _roles(role: str | None) -> tuple[str, ...]:
    return {"prefill": ("prefill",), "decode": ("decode",), "both": ("prefill", "decode")}.get(role or "", ())


def _pod_port(pod: dict) -> int:
    for container in pod.get("spec", {}).get("containers", []):
        for port in container.get("ports") or []:
            if port.get("name") == PORT_NAME:
                return int(port["containerPort"])
    return DEFAULT_PORT


def _pod_ready(pod: dict) -> bool:
    status = pod.get("status", {})
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return status.get("phase") == "Running" and conditions.get("Ready") == "True" and bool(status.get("podIP"))


def endpoints_from_slices(slices: list[dict]) -> tuple[dict[str, tuple[str, int]], set[str]]:
    """(ready pod name -> (ip, port), every pod name any slice mentions)."""
    ready, seen = {}, set()
    for s in slices:
        port = next((p.get("port") for p in s.get("ports") or [] if p.get("name") == PORT_NAME), None)
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
            port = next((p.get("port") for p in subset.get("ports") or [] if p.get("name") == PORT_NAME), None)
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
        for role in _roles(labels.get(ROLE_LABEL)):
            specs.append(WorkerSpec(f"http://{host}:{port}", role, labels.get(REVISION_LABEL)))
    return sorted(specs, key=lambda s: (s.role, s.url))


class KubernetesDiscovery:
    def __init__(self, config: RouterConfig):
        from kubernetes import client, config as kube_config

        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        self._api = client.ApiClient()
        self._core = client.CoreV1Api(self._api)
        self._slices = None
        self._namespace = config.namespace
        self._selector = config.selector
        self._interval_s = config.discovery_interval_s
        self._client = client

    def _serves_slices_v1(self) -> bool:
        groups = json.loads(self._client.ApisApi(self._api).get_api_versions(_preload_content=False).data)
        for g in groups.get("groups", []):
            if g.get("name") == "discovery.k8s.io":
                return any(v.get("version") == "v1" for v in g.get("versions", []))
        return False

    def _list(self) -> list[WorkerSpec]:
        if self._slices is None:
            self._slices = self._serves_slices_v1()
            log.info("discovery: using %s", "EndpointSlices (discovery.k8s.io/v1)" if self._slices else "Endpoints")
        ns = self._namespace
        pods = json.loads(self._core.list_namespaced_pod(ns, label_selector=self._selector,
                                                         _preload_content=False).data)["items"]
        if self._slices:
            api = self._client.DiscoveryV1Api(self._api)
            items = json.loads(api.list_namespaced_endpoint_slice(ns, _preload_content=False).data)["items"]
            ready, seen = endpoints_from_slices(items)
        else:
            items = json.loads(self._core.list_namespaced_endpoints(ns, _preload_content=False).data)["items"]
            ready, seen = endpoints_from_endpoints(items)
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
