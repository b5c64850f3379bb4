"""One level-triggered reconcile: apply every child, prune stale ones, compute status.

Called alike on create, update, resume and by the timer, so it must be idempotent; it never
looks at what changed, only at what the spec says now and what the cluster has.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.operator import naming, networking, status
from pdserve.operator.children import PRUNABLE, build_children
from pdserve.operator.kube import Kube, owned_by
from pdserve.operator.generated_secrets import KV_SECRET, WORKER_API_KEY, ensure_secret
from pdserve.operator.networking import NETWORK_POLICY_VERSION
from pdserve.operator.spec import ModelServing


@dataclass(frozen=True)
class Outcome:
    status: dict[str, Any]
    events: list[tuple[str, str, str]]  # (Normal|Warning, reason, message)


def _version_for(kind: str, kube: Kube) -> str | None:
    v = kube.versions()
    return {"HorizontalPodAutoscaler": v.hpa, "PodDisruptionBudget": v.pdb, "ServiceMonitor": v.service_monitor,
            "NetworkPolicy": NETWORK_POLICY_VERSION}[kind]


def reconcile(kube: Kube, body: Mapping[str, Any], now: str) -> Outcome:
    ms = ModelServing.from_body(body)  # SpecError propagates: the handler reports it
    # before any pod is built: the generated Secrets' uids are part of the pod templates
    ms = dataclasses.replace(ms, kv_secret_uid=ensure_secret(kube, ms, KV_SECRET),
                             worker_api_key_uid=ensure_secret(kube, ms, WORKER_API_KEY))
    selector = f"{naming.LABEL_MODELSERVING}={ms.name}"
    old_status = body.get("status") or {}
    old_conditions = old_status.get("conditions") or []

    current = {d["metadata"]["labels"].get(naming.LABEL_ROLE): d
               for d in kube.list("apps/v1", "Deployment", ms.namespace, selector) if owned_by(d, ms.uid)}
    # Replica counts the prefill:decode ratio is measured against: the spec's for a fixed-size
    # role, the Deployment's (an HPA moves it) for an autoscaled one, once it exists.
    replicas_now: dict[str, int] = {}
    for role in ("prefill", "decode"):
        rs = ms.spec.role(role)
        if rs.autoscaling is None:
            replicas_now[role] = rs.replicas
        elif role in current:
            replicas_now[role] = (current[role].get("spec") or {}).get("replicas", 1)

    desired = build_children(ms, kube.versions(), replicas_now)
    deployments: dict[str, dict[str, Any]] = {}
    for manifest in desired:
        applied = kube.apply(manifest)
        if manifest["kind"] == "Deployment":
            deployments[manifest["metadata"]["labels"][naming.LABEL_ROLE]] = applied

    events: list[tuple[str, str, str]] = []
    keep = {(m["kind"], m["metadata"]["name"]) for m in desired}
    for kind in PRUNABLE:
        version = _version_for(kind, kube)
        if version is None:
            continue
        for obj in kube.list(version, kind, ms.namespace, selector):
            name = obj["metadata"]["name"]
            if (kind, name) not in keep and owned_by(obj, ms.uid):
                kube.delete(version, kind, ms.namespace, name)
                events.append(("Normal", "Pruned", f"deleted {kind} {name}: no longer in the spec"))

    revision = naming.revision(ms)
    old_revision = old_status.get("revision")
    if old_revision and old_revision != revision:
        events.append(("Normal", "RevisionChanged", f"rolling out worker revision {revision} (was {old_revision})"))
    if not current:
        events.append(("Normal", "Created", f"created {len(desired)} children; endpoint {networking.endpoint(ms)}"))

    pods = kube.list("v1", "Pod", ms.namespace, selector)
    new_status = status.build_status(ms, deployments, pods, old_conditions, now)
    events += status.transitions(old_conditions, new_status["conditions"],
                                 expected=status.unready_expected(old_status, new_status))
    return Outcome(new_status, events)
