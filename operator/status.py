"""Status aggregation: children's state in, ModelServing status out (pure functions).

Ready: every role has as many ready pods as it wants, with at least one decode worker and one
router. Progressing: some Deployment has not finished rolling out the current template (so a
spec edit reads Progressing until the new revision is ready). Degraded: pods crash-loop, cannot
pull their image or cannot be scheduled, a rollout missed its deadline, or the spec is invalid.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from pdserve.operator import naming, networking
from pdserve.operator.spec import ModelServing

ROLES = ("prefill", "decode", "router")
# containerStatuses[].state.waiting.reason values that will not fix themselves
BAD_WAITING = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
               "CreateContainerError", "InvalidImageName", "RunContainerError")


def role_status(deployment: Mapping[str, Any] | None, desired: int) -> dict[str, Any]:
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
    }


def rolled_out(deployment: Mapping[str, Any] | None) -> bool:
    """kubectl rollout status's test: the controller saw the template, old pods are gone."""
    if deployment is None:
        return False
    st, want = deployment.get("status") or {}, (deployment.get("spec") or {}).get("replicas", 1)
    return (st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 1)
            and st.get("updatedReplicas", 0) == want
            and st.get("replicas", 0) == want
            and st.get("availableReplicas", 0) >= want)


def degraded_reason(deployments: Iterable[Mapping[str, Any] | None],
                    pods: Iterable[Mapping[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) of the first problem that needs a human, or None."""
    for pod in pods:
        name = pod["metadata"]["name"]
        st = pod.get("status") or {}
        for cs in st.get("containerStatuses") or ():
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in BAD_WAITING:
                detail = waiting.get("message") or f"restarted {cs.get('restartCount', 0)} times"
                return waiting["reason"], f"pod {name} container {cs.get('name')}: {detail}"
        for cond in st.get("conditions") or ():
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                return "Unschedulable", f"pod {name}: {cond.get('message', 'cannot be scheduled')}"
    for d in deployments:
        for cond in ((d or {}).get("status") or {}).get("conditions") or ():
            if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                return "ProgressDeadlineExceeded", f"deployment {d['metadata']['name']}: {cond.get('message', '')}"
            if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
                return "ReplicaFailure", f"deployment {d['metadata']['name']}: {cond.get('message', '')}"
    return None


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


def build_status(ms: ModelServing, deployments: Mapping[str, Mapping[str, Any] | None],
                 pods: list[Mapping[str, Any]], old_conditions: Iterable[Mapping[str, Any]], now: str) -> dict[str, Any]:
    s = ms.spec
    desired = {"prefill": s.prefill.replicas, "decode": s.decode.replicas, "router": s.router.replicas}
    roles = {r: role_status(deployments.get(r), desired[r]) for r in ROLES}
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
        prog_c = condition("Progressing", True, "RollingOut",
                           f"revision {naming.revision(ms)} rolling out: " +
                           ", ".join(f"{r} {roles[r]['updatedReplicas']}/{roles[r]['desiredReplicas']} updated"
                                     for r in pending), ms.generation)
    else:
        prog_c = condition("Progressing", False, "RolloutComplete",
                           f"revision {naming.revision(ms)} rolled out", ms.generation)

    problem = degraded_reason(deployments.values(), pods)
    deg_c = (condition("Degraded", True, problem[0], problem[1], ms.generation) if problem
             else condition("Degraded", False, "AsExpected", "no failing pods", ms.generation))

    return {
        "observedGeneration": ms.generation,
        "revision": naming.revision(ms),
        "endpoint": networking.endpoint(ms),
        **roles,
        "conditions": merge_conditions(old_conditions, [ready_c, prog_c, deg_c], now),
    }


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


def transitions(old: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """Events for conditions whose status changed: (Normal|Warning, reason, message)."""
    before = {c.get("type"): c.get("status") for c in old or ()}
    out = []
    for c in new:
        prev, kind, status = before.get(c["type"]), c["type"], c["status"]
        if prev == status or (prev is None and (kind, status) in _QUIET_START):
            continue
        warning = (kind == "Degraded" and status == "True") or (kind == "Ready" and status == "False" and prev == "True")
        out.append(("Warning" if warning else "Normal", c["reason"], c["message"]))
    return out
