"""The live side of spec.lora: every ready worker pod of a ModelServing is brought to the
spec's adapter list through vLLM's runtime endpoints (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`), and status.lora says where each adapter is loaded. A kopf timer
calls `sync` (operator/handlers.py); what to call is `lora.plan`'s, this file only talks HTTP.

A pod that does not answer is left for the next round; an adapter a worker refuses (400: a rank
over maxLoraRank, missing files, another base) is named in status.lora with the worker's reason
and retried next round (a PVC being filled, a hub outage)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import httpx

from pdserve.operator import lora, naming
from pdserve.operator.autoscaler import pod_ready, pod_url, worker_key
from pdserve.operator.kube import Kube
from pdserve.operator.spec import ModelServing
from pdserve.protocol.contract import ROLE_DECODE, ROLE_PREFILL

log = logging.getLogger("pdserve.operator")
_TIMEOUT_S = 30.0  # a load reads the adapter from disk or the hub


class WorkerAdapters:
    """One worker's adapters over HTTP (the worker API key in every call)."""

    def __init__(self, client: httpx.Client, url: str):
        self.client, self.url = client, url

    def current(self) -> dict[str, str]:
        r = self.client.get(self.url + "/v1/models")
        r.raise_for_status()
        return lora.loaded(r.json())

    def apply(self, step: lora.Load | lora.Unload) -> str | None:
        """None when done, else the worker's refusal."""
        if isinstance(step, lora.Load):
            r = self.client.post(self.url + "/v1/load_lora_adapter",
                                 json={"lora_name": step.name, "lora_path": step.path})
        else:
            r = self.client.post(self.url + "/v1/unload_lora_adapter", json={"lora_name": step.name})
        if r.status_code == 200 or (isinstance(step, lora.Unload) and r.status_code == 404):
            return None  # an unload of what is already gone is done
        try:
            return str(r.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return f"HTTP {r.status_code}: {r.text[:200]}"


def sync_workers(spec: lora.LoRASpec, urls: list[str], client: httpx.Client) -> dict[str, Any]:
    """Bring each worker to the spec's list; status.lora of what they serve afterwards."""
    desired, reached, errors = spec.desired(), [], {}
    for url in urls:
        worker = WorkerAdapters(client, url)
        try:
            current = worker.current()
            for step in lora.plan(desired, current):
                if (why := worker.apply(step)) is not None:
                    errors.setdefault(step.name, why)
                    log.warning("LoRA adapter %s on %s: %s", step.name, url, why)
            reached.append(worker.current())
        except httpx.HTTPError as e:
            log.info("LoRA sync of %s failed: %r", url, e)
    return lora.status(spec, reached, errors)


def worker_urls(kube: Kube, ms: ModelServing) -> list[str]:
    selector = f"{naming.LABEL_MODELSERVING}={ms.name}"
    return [u for p in kube.list("v1", "Pod", ms.namespace, selector)
            if p["metadata"].get("labels", {}).get(naming.LABEL_ROLE) in (ROLE_PREFILL, ROLE_DECODE)
            and pod_ready(p) and (u := pod_url(p))]


def sync(kube: Kube, body: Mapping[str, Any],
         client_for: Callable[[str | None], httpx.Client] | None = None) -> dict[str, Any] | None:
    """One round for one ModelServing: status.lora, None without spec.lora."""
    ms = ModelServing.from_body(body)
    if ms.spec.lora is None:
        return None
    key = worker_key(kube, ms)
    make = client_for or (lambda k: httpx.Client(timeout=_TIMEOUT_S,
                                                 headers={"Authorization": f"Bearer {k}"} if k else {}))
    with make(key) as client:
        return sync_workers(ms.spec.lora, worker_urls(kube, ms), client)
