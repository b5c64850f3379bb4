"""The spec.slo planner in the operator: a kopf timer, thin around operator/planner.py.

Each tick, for a ModelServing with `spec.slo`:

    scrape /metrics of its ready prefill, decode and router pods (the worker API key, as the router
    presents it) ─▶ difference with the last tick's scrape (planner_metrics.py) ─▶ Snapshot
    ─▶ planner.decide ─▶ for each role whose count changes: on a scale-down, annotate pods with
    controller.kubernetes.io/pod-deletion-cost (the idlest go first; honoured from Kubernetes
    1.22, ignored before) ─▶ patch the role Deployment's scale subresource ─▶ an Event per change
    and `status.planner` with the reasons.

Only roles with an autoscaling block are the planner's (children.py then builds no HPA and
workloads.py leaves their Deployment's replicas alone); a role without one keeps spec replicas.
The planner's memory (learned capacity, cooldowns, the scale-down window) lives in the
operator's memo: a restarted operator starts with the seeds again and waits a full window before
any scale-down, which is the safe direction.
"""

from __future__ import annotations

import base64
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import httpx

from pdserve.operator import naming
from pdserve.operator.kube import Kube, owned_by
from pdserve.operator.planner import ROLES, Decision, PlannerConfig, PlannerState, RoleBounds, Snapshot, decide
from pdserve.operator.planner_metrics import Scrape, held, role_sample
from pdserve.operator.spec import GPU_RESOURCE, ModelServing, RoleSpec
from pdserve.protocol.contract import HTTP_PORT, HTTP_PORT_NAME

log = logging.getLogger("pdserve.operator")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_SCRAPE_TIMEOUT_S = 3.0


def role_bounds(rs: RoleSpec) -> RoleBounds:
    gpus = int(((rs.resources.get("limits") or {}).get(GPU_RESOURCE)) or
               ((rs.resources.get("requests") or {}).get(GPU_RESOURCE)) or 0)
    if rs.autoscaling is None:  # not the planner's: fixed at spec replicas
        return RoleBounds(rs.replicas, rs.replicas, gpus)
    return RoleBounds(rs.autoscaling.min_replicas, rs.autoscaling.max_replicas, gpus)


def planner_config(ms: ModelServing) -> PlannerConfig:
    s, slo = ms.spec, ms.spec.slo
    assert slo is not None
    return PlannerConfig(
        ttft_s=slo.ttft_ms / 1000, itl_s=slo.itl_ms / 1000, percentile=slo.percentile / 100,
        prefill=role_bounds(s.prefill), decode=role_bounds(s.decode), gpu_budget=slo.gpu_budget,
        ratio_min=s.ratio_min, ratio_max=s.ratio_max, target_utilization=slo.target_utilization,
        prefill_capacity_tps=slo.prefill_tokens_per_second, decode_capacity_tps=slo.decode_tokens_per_second,
        scale_up_cooldown_s=slo.scale_up_cooldown_s, scale_down_window_s=slo.scale_down_window_s,
        max_scale_down_step=slo.max_scale_down_step, scale_to_zero_after_s=slo.scale_to_zero_after_s)


@dataclass
class Memory:
    """One ModelServing's planner memory between ticks."""

    state: PlannerState = field(default_factory=PlannerState)
    scrapes: dict[str, Scrape] = field(default_factory=dict)  # role|"router" -> last scrape
    scraped_at: float | None = None
    decided_at: float | None = None


def pod_url(pod: Mapping[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = HTTP_PORT
    for c in (pod.get("spec") or {}).get("containers") or ():
        for p in c.get("ports") or ():
            if p.get("name") == HTTP_PORT_NAME:
                port = p["containerPort"]
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def pod_ready(pod: Mapping[str, Any]) -> bool:
    conds = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or ()}
    return conds.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp")


def worker_key(kube: Kube, ms: ModelServing) -> str | None:
    ref = naming.worker_api_key_ref(ms)
    secret = kube.get("v1", "Secret", ms.namespace, ref.name)
    raw = ((secret or {}).get("data") or {}).get(ref.key)
    return base64.b64decode(raw).decode() if raw else None


def scrape_pages(urls: list[str], key: str | None) -> dict[str, str]:
    """url -> /metrics text, for the pods that answered (one that does not is left out)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = {}
    with httpx.Client(timeout=_SCRAPE_TIMEOUT_S, headers=headers) as client:
        for url in urls:
            try:
                r = client.get(url + "/metrics")
                if r.status_code == 200:
                    out[url] = r.text
            except httpx.HTTPError as e:
                log.info("planner: scrape of %s failed: %r", url, e)
    return out


def tick(kube: Kube, body: Mapping[str, Any], memory: Memory, now: float, stamp: str,
         fetch: Callable[[list[str], str | None], dict[str, str]] = scrape_pages) -> \
        tuple[Decision, list[tuple[str, str, str]]] | None:
    """One planner round for one ModelServing; None when it has no spec.slo or it is not time yet."""
    ms = ModelServing.from_body(body)
    if ms.spec.slo is None:
        return None
    if memory.decided_at is not None and now - memory.decided_at < ms.spec.slo.interval_s - 0.5:
        return None
    cfg = planner_config(ms)
    selector = f"{naming.LABEL_MODELSERVING}={ms.name}"
    deployments = {d["metadata"]["labels"].get(naming.LABEL_ROLE): d
                   for d in kube.list("apps/v1", "Deployment", ms.namespace, selector) if owned_by(d, ms.uid)}
    if not all(r in deployments for r in ROLES):
        return None  # not reconciled yet
    pods = kube.list("v1", "Pod", ms.namespace, selector)
    by_role: dict[str, list[dict]] = {}
    for p in pods:
        by_role.setdefault(p["metadata"].get("labels", {}).get(naming.LABEL_ROLE, ""), []).append(p)
    urls = {role: [u for p in by_role.get(role, []) if pod_ready(p) and (u := pod_url(p))]
            for role in (*ROLES, "router")}
    pages = fetch([u for us in urls.values() for u in us], worker_key(kube, ms))
    scrapes = {role: Scrape() for role in urls}
    per_pod_load: dict[str, float] = {}
    for role, us in urls.items():
        for u in us:
            if u in pages:
                scrapes[role].add(pages[u])
                one = Scrape().add(pages[u]).gauges
                per_pod_load[u] = one.get("vllm:num_requests_running", 0.0) + one.get("vllm:num_requests_waiting", 0.0)
    dt = now - memory.scraped_at if memory.scraped_at is not None else 0.0
    samples = {}
    for role in ROLES:
        d = deployments[role]
        samples[role] = role_sample(
            role, memory.scrapes.get(role), scrapes[role], memory.scrapes.get("router"), scrapes["router"], dt,
            cfg.percentile, replicas=(d.get("spec") or {}).get("replicas", 1),
            ready=((d.get("status") or {}).get("readyReplicas") or 0),
            terminating=sum(1 for p in by_role.get(role, []) if p["metadata"].get("deletionTimestamp")))
    snapshot = Snapshot(now, samples["prefill"], samples["decode"], held(scrapes["router"]))
    decision, memory.state = decide(cfg, memory.state, snapshot)
    memory.scrapes, memory.scraped_at, memory.decided_at = scrapes, now, now

    events = []
    for role, (before, after) in decision.changed(snapshot).items():
        if after < before:
            _mark_idlest(kube, ms, by_role.get(role, []), per_pod_load)
        kube.resource("apps/v1", "Deployment").scale.patch(
            body={"metadata": {"name": naming.child_name(ms, role)}, "spec": {"replicas": after}},
            namespace=ms.namespace, content_type="application/merge-patch+json")
        events.append(("Normal", "PlannerScaledUp" if after > before else "PlannerScaledDown",
                       f"{role} {before} -> {after}: {decision.reasons[role]}"))
    kube.patch_status({"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": body["metadata"]},
                      {"planner": planner_status(decision, stamp)})
    return decision, events


def planner_status(decision: Decision, stamp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"time": stamp, "prefillReplicas": decision.prefill, "decodeReplicas": decision.decode,
                           "prefillReason": decision.reasons["prefill"][:1000],
                           "decodeReason": decision.reasons["decode"][:1000]}
    for role in ROLES:
        if decision.capacity.get(role):
            out[f"{role}TokensPerSecondPerWorker"] = round(decision.capacity[role], 1)
    return out


def _mark_idlest(kube: Kube, ms: ModelServing, pods: list[dict], load: Mapping[str, float]) -> None:
    """The Deployment removes the lowest deletion cost first: a pod's cost is its load, so the
    pods with the fewest requests in flight drain first (each still drains fully on SIGTERM)."""
    for p in pods:
        url = pod_url(p)
        cost = int(load.get(url, 0.0)) if url else 0
        try:
            kube.resource("v1", "Pod").patch(body={"metadata": {"annotations": {DELETION_COST: str(cost)}}},
                                             name=p["metadata"]["name"], namespace=ms.namespace,
                                             content_type="application/merge-patch+json")
        except Exception as e:  # noqa: BLE001 - a pod gone meanwhile: the scale-down still works
            log.info("planner: could not mark %s: %r", p["metadata"]["name"], e)


def now_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def monotonic() -> float:
    return time.monotonic()
