"""Status aggregation: children's state in, ModelServing status out (pure functions).

Ready: every role has as many ready pods as it wants, with at least one decode worker and one
router. Progressing: some Deployment has not finished rolling out the current template (so a
spec edit reads Progressing until the new revision is ready). Degraded: pods crash-loop, cannot
pull their image or stay unschedulable while their role is short, a rollout missed its
deadline, or the spec is invalid.
"""

from __future__ import annotations

import datetime
from typing import Any, Iterable, Mapping

from pdserve.operator import naming, networking
from pdserve.operator.spec import ModelServing

ROLES = ("prefill", "decode", "router")
# containerStatuses[].state.waiting.reason values that will not fix themselves
BAD_WAITING = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
               "CreateContainerError", "InvalidImageName", "RunContainerError")
# How long a pod may wait for capacity (e.g. GPUs a deleted pod still holds) before it counts.
UNSCHEDULABLE_GRACE_S = 30


def role_status(ms: ModelServing, role: str, deployment: Mapping[str, Any] | None, desired: int) -> dict[str, Any]:
    st = (deployment or {}).get("status") or {}
    if deployment is not None:
        desired = (deployment.get("spec") or {}).get("replicas", desired)  # an HPA may have moved it
    ready = st.get("readyReplicas", 0)
    return {
        "desiredReplicas": desired,
        "replicas": st.get("replicas", 0),
        "readyReplicas": ready,
        "updatedReplicas": st.get("updatedReplicas", 0),
        "ready": f"{ready}/{desired}",
        # for the scale subresource (.status.decode.selector) and `kubectl get pods -l`
        "selector": ",".join(f"{k}={v}" for k, v in naming.selector_labels(ms, role).items()),
    }


def _observed(deployment: Mapping[str, Any]) -> bool:
    """The Deployment controller has seen the current template (else its counts are stale)."""
    st = deployment.get("status") or {}
    return st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 1)


def rolled_out(deployment: Mapping[str, Any] | None) -> bool:
    """kubectl rollout status's test: the controller saw the template, old pods are gone."""
    if deployment is None:
        return False
    st, want = deployment.get("status") or {}, (deployment.get("spec") or {}).get("replicas", 1)
    return (_observed(deployment)
            and st.get("updatedReplicas", 0) == want
            and st.get("replicas", 0) == want
            and st.get("availableReplicas", 0) >= want)


def rollout_progress(role: str, deployment: Mapping[str, Any] | None) -> str:
    """What a role's Deployment is doing, in words that stay true at every step."""
    if deployment is None:
        return f"{role} not created yet"
    if not _observed(deployment):
        return f"{role} waiting for the Deployment controller"
    st, want = deployment.get("status") or {}, (deployment.get("spec") or {}).get("replicas", 1)
    updated, total, available = st.get("updatedReplicas", 0), st.get("replicas", 0), st.get("availableReplicas", 0)
    old = max(total - updated, 0)
    text = f"{role} {updated}/{want} updated"
    if old:
        text += f", {old} old pod{'s' if old > 1 else ''} left"
    return text + f", {min(available, want)}/{want} available"


def _role_of(pod: Mapping[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(naming.LABEL_ROLE)


def _age_s(timestamp: str | None, now: str) -> float:
    if not timestamp:
        return 0.0
    parse = lambda t: datetime.datetime.strptime(t, "%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return (parse(now) - parse(timestamp)).total_seconds()


def degraded_reason(deployments: Mapping[str, Mapping[str, Any] | None],
                    pods: Iterable[Mapping[str, Any]], now: str) -> tuple[str, str] | None:
    """(reason, message) of the first problem that needs a human, or None.

    A pod waiting for capacity is a problem only when its role is short of available pods, no
    pod of this ModelServing is terminating (whose GPUs are about to be freed), and it has
    waited UNSCHEDULABLE_GRACE_S: a surge pod, or a rollout's pod waiting for its
    predecessor's GPUs, is expected and shows in Progressing instead."""
    pods = list(pods)
    terminating = any((p.get("metadata") or {}).get("deletionTimestamp") for p in pods)
    for pod in pods:
        name = pod["metadata"]["name"]
        st = pod.get("status") or {}
        for cs in st.get("containerStatuses") or ():
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in BAD_WAITING:
                detail = waiting.get("message") or f"restarted {cs.get('restartCount', 0)} times"
                last = (cs.get("lastState") or {}).get("terminated") or {}
                if last.get("reason"):  # why it died: OOMKilled says "raise the memory limit"
                    detail += f"; last terminated: {last['reason']} (exit code {last.get('exitCode')})"
                return waiting["reason"], f"pod {name} container {cs.get('name')}: {detail}"
        for cond in st.get("conditions") or ():
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                d = deployments.get(_role_of(pod) or "")
                dst, want = (d or {}).get("status") or {}, ((d or {}).get("spec") or {}).get("replicas", 1)
                if terminating or dst.get("availableReplicas", 0) >= want \
                        or _age_s(cond.get("lastTransitionTime"), now) < UNSCHEDULABLE_GRACE_S:
                    continue
                return "Unschedulable", f"pod {name}: {cond.get('message', 'cannot be scheduled')}"
    for d in deployments.values():
        for cond in ((d or {}).get("status") or {}).get("conditions") or ():
            if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                return "ProgressDeadlineExceeded", f"deployment {d['metadata']['name']}: {cond.get('message', '')}"
            if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
                return "ReplicaFailure", f"deployment {d['metadata']['name']}: {cond.get('message', '')}"
    return None


def fallback_reason(roles: Mapping[str, Mapping[str, Any]],
                    old_conditions: Iterable[Mapping[str, Any]]) -> tuple[str, str] | None:
    """A worker role that should run has no ready pod while the other has some: the router
    serves whole requests on the other role (router/fallback.py), so the model is up but not
    disaggregated. Reported once the service has been Ready (or is already reported so): a role
    that is merely slower to load at creation is Progressing, not Degraded."""
    before = {c.get("type"): c for c in old_conditions or ()}
    was_up = (before.get("Ready") or {}).get("status") == "True" or \
        (before.get("Degraded") or {}).get("reason") in ("PrefillUnavailable", "DecodeUnavailable")
    if not was_up:
        return None
    for role, other in (("decode", "prefill"), ("prefill", "decode")):
        if roles[role]["desiredReplicas"] >= 1 and roles[role]["readyReplicas"] == 0 \
                and roles[other]["readyReplicas"] >= 1:
            return (f"{role.capitalize()}Unavailable",
                    f"no ready {role} worker: the {other} workers serve whole requests (aggregated fallback)")
    return None


def waiting_for_capacity(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods
            if any(c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
                   for c in (p.get("status") or {}).get("conditions") or ())]


def condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason,
            "message": message, "observedGeneration": generation}


def merge_conditions(old: Iterable[Mapping[str, Any]], new: list[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    """Keep lastTransitionTime where a condition's status did not change."""
    before = {c.get("type"): c for c in old or ()}
    out = []
    for c in new:
        prev = before.get(c["type"])
        keep = prev is not None and prev.get("status") == c["status"] and prev.get("lastTransitionTime")
        out.append({**c, "lastTransitionTime": prev["lastTransitionTime"] if keep else now})
    return out


def build_status(
    ms: ModelServing,
    deployments: Mapping[str, Mapping[str, Any] | None],
    pods: list[Mapping[str, Any]],
    old_conditions: Iterable[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    s = ms.spec
    desired = {"prefill": s.prefill.replicas, "decode": s.decode.replicas, "router": s.router.replicas}
    roles = {r: role_status(ms, r, deployments.get(r), desired[r]) for r in ROLES}
    summary = ", ".join(f"{r} {roles[r]['ready']}" for r in ROLES)

    short = [r for r in ROLES if roles[r]["readyReplicas"] < roles[r]["desiredReplicas"]]
    empty = [r for r in ("decode", "router") if roles[r]["desiredReplicas"] < 1]
    ready = not short and not empty
    if ready:
        ready_c = condition("Ready", True, "AllReplicasReady", f"ready: {summary}", ms.generation)
    elif empty:
        ready_c = condition("Ready", False, "NoReplicas", f"{' and '.join(empty)} scaled to zero", ms.generation)
    else:
        ready_c = condition("Ready", False, "ReplicasNotReady", f"ready: {summary}", ms.generation)

    pending = [r for r in ROLES if not rolled_out(deployments.get(r))]
    if pending:
        message = f"revision {naming.revision(ms)} rolling out: " + \
            "; ".join(rollout_progress(r, deployments.get(r)) for r in pending)
        if waiting := waiting_for_capacity(pods):
            message += f"; waiting for capacity: {', '.join(sorted(waiting))}"
        prog_c = condition("Progressing", True, "RollingOut", message, ms.generation)
    else:
        prog_c = condition("Progressing", False, "RolloutComplete",
                           f"revision {naming.revision(ms)} rolled out", ms.generation)

    problem = degraded_reason(deployments, pods, now) or fallback_reason(roles, old_conditions)
    deg_c = (condition("Degraded", True, problem[0], problem[1], ms.generation) if problem
             else condition("Degraded", False, "AsExpected", "no failing pods", ms.generation))

    return {
        "observedGeneration": ms.generation,
        "revision": naming.revision(ms),
        "endpoint": networking.endpoint(ms),
        **roles,
        "conditions": merge_conditions(old_conditions, [ready_c, prog_c, deg_c], now),
    }


def unready_expected(old_status: Mapping[str, Any], new_status: Mapping[str, Any]) -> bool:
    """Whether losing readiness is the expected effect of a change: a spec edit (a scale-up
    wants pods that cannot be ready yet), a rollout already under way (it replaces pods by
    design), or an autoscaler raising a role's count. Anything else is a warning."""
    if old_status.get("observedGeneration") != new_status.get("observedGeneration"):
        return True
    if any(c.get("type") == "Progressing" and c.get("status") == "True" for c in old_status.get("conditions") or ()):
        return True
    return any((new_status.get(r) or {}).get("desiredReplicas", 0) > (old_status.get(r) or {}).get("desiredReplicas", 0)
               for r in ROLES)


def invalid_spec_status(generation: int, message: str, old_conditions: Iterable[Mapping[str, Any]],
                        now: str) -> dict[str, Any]:
    """A spec the operator refuses: say why. Children keep serving the last good spec, so Ready
    keeps whatever it was."""
    old = list(old_conditions or ())
    ready = next((dict(c) for c in old if c.get("type") == "Ready"),
                 condition("Ready", False, "InvalidSpec", message, generation))
    new = [ready, condition("Progressing", False, "InvalidSpec", "waiting for a valid spec", generation),
           condition("Degraded", True, "InvalidSpec", message, generation)]
    return {"observedGeneration": generation, "conditions": merge_conditions(old, new, now)}


# First appearances that are not news (a fresh object is neither rolling back nor degraded).
_QUIET_START = {("Degraded", "False"), ("Progressing", "False")}


def transitions(old: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]],
                expected: bool = False) -> list[tuple[str, str, str]]:
    """Events for conditions whose status changed: (Normal|Warning, reason, message). Warning
    for Degraded, and for lost readiness unless `expected` (a scale-up or rollout)."""
    before = {c.get("type"): c.get("status") for c in old or ()}
    out = []
    for c in new:
        prev, kind, status = before.get(c["type"]), c["type"], c["status"]
        if prev == status or (prev is None and (kind, status) in _QUIET_START):
            continue
        warning = (kind == "Degraded" and status == "True") or \
            (kind == "Ready" and status == "False" and prev == "True" and not expected)
        out.append(("Warning" if warning else "Normal", c["reason"], c["message"]))
    return out
