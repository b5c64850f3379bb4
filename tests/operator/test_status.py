"""Status aggregation from Deployments and pods, without a cluster."""

from __future__ import annotations

import pytest

from pdserve.operator.spec import ModelServing, ModelServingSpec
from pdserve.operator.status import (build_status, invalid_spec_status, unready_expected, merge_conditions,
                                     rolled_out, transitions)

SPEC = {"model": {"source": "hf://m/x"}, "image": "img", "prefill": {"replicas": 2}, "decode": {"replicas": 1}}
T0, T1 = "2025-01-01T00:00:00Z", "2025-01-01T00:01:00Z"


def ms(generation=1):
    return ModelServing("llama", "ns", "uid", ModelServingSpec.from_dict(SPEC), generation)


def dep(role, want, ready, updated=None, total=None, observed=1, generation=1, conditions=()):
    updated = ready if updated is None else updated
    return {"metadata": {"name": f"llama-{role}", "generation": generation}, "spec": {"replicas": want},
            "status": {"observedGeneration": observed, "replicas": want if total is None else total,
                       "readyReplicas": ready, "availableReplicas": ready, "updatedReplicas": updated,
                       "conditions": list(conditions)}}


def conds(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def all_ready():
    return {"prefill": dep("prefill", 2, 2), "decode": dep("decode", 1, 1), "router": dep("router", 1, 1)}


def test_all_ready():
    s = build_status(ms(), all_ready(), [], [], T0)
    assert conds(s) == {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "RolloutComplete"),
                        "Degraded": ("False", "AsExpected")}
    assert s["prefill"] == {
        "desiredReplicas": 2,
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
        "ready": "2/2",
        "selector": "pdserve.io/modelserving=llama,pdserve.io/role=prefill",
    }
    assert s["endpoint"] == "http://llama-router.ns.svc:80" and s["observedGeneration"] == 1


@pytest.mark.parametrize(
    "deployments, ready, progressing",
    [
        ({}, ("False", "ReplicasNotReady"), ("True", "RollingOut")),  # nothing yet
        ({**all_ready(), "prefill": dep("prefill", 2, 1)}, ("False", "ReplicasNotReady"), ("True", "RollingOut")),
        # new template not yet seen by the controller: still progressing although pods are ready
        (
            {**all_ready(), "decode": dep("decode", 1, 1, observed=1, generation=2)},
            ("True", "AllReplicasReady"),
            ("True", "RollingOut"),
        ),
        # surge: old pod still running beside the updated one
        (
            {**all_ready(), "decode": dep("decode", 1, 1, updated=1, total=2)},
            ("True", "AllReplicasReady"),
            ("True", "RollingOut"),
        ),
        ({**all_ready(), "router": dep("router", 0, 0)}, ("False", "NoReplicas"), ("False", "RolloutComplete")),
    ],
)
def test_ready_and_progressing(deployments, ready, progressing):
    c = conds(build_status(ms(), deployments, [], [], T0))
    assert c["Ready"] == ready and c["Progressing"] == progressing


@pytest.mark.parametrize(
    "deployment, text",
    [
        # the controller has not seen the new template: its counts describe the old one
        (dep("decode", 2, 2, observed=1, generation=2), "decode waiting for the Deployment controller"),
        (
            dep("decode", 2, 1, updated=1, total=2, observed=2, generation=2),
            "decode 1/2 updated, 1 old pod left, 1/2 available",
        ),
        (dep("decode", 2, 1, updated=2, total=2, observed=2, generation=2), "decode 2/2 updated, 1/2 available"),
    ],
)
def test_rollout_message_says_what_is_true(deployment, text):
    prog = next(c for c in build_status(ms(), {**all_ready(), "decode": deployment}, [], [], T0)["conditions"]
                if c["type"] == "Progressing")
    assert prog["status"] == "True" and prog["message"].endswith(text), prog["message"]


def pod(name, waiting=None, unschedulable=False, role="decode", since=T0, deleting=False, last=None):
    st = (
        {"containerStatuses": [{"name": "worker", "restartCount": 7, "state": {"waiting": {"reason": waiting}}}]}
        if waiting
        else {}
    )
    if last:
        st["containerStatuses"][0]["lastState"] = {"terminated": last}
    if unschedulable:
        st["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "lastTransitionTime": since,
                "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
            }
        ]
    meta = {"name": name, "labels": {"pdserve.io/role": role}}
    if deleting:
        meta["deletionTimestamp"] = T0
    return {"metadata": meta, "status": st}


SHORT = {**all_ready(), "decode": dep("decode", 1, 0)}


@pytest.mark.parametrize(
    "pods, deployments, reason, text",
    [
        (
            [pod("p1", waiting="CrashLoopBackOff")],
            all_ready(),
            "CrashLoopBackOff",
            "pod p1 container worker: restarted 7 times",
        ),
        ([pod("p2", waiting="ImagePullBackOff")], all_ready(), "ImagePullBackOff", "pod p2"),
        (
            [pod("p5", waiting="CrashLoopBackOff", last={"reason": "OOMKilled", "exitCode": 137})],
            all_ready(),
            "CrashLoopBackOff",
            "pod p5 container worker: restarted 7 times; last terminated: OOMKilled (exit code 137)",
        ),
        # the role is short of pods and this one has waited past the grace period: a real problem
        ([pod("p3", unschedulable=True)], SHORT, "Unschedulable", "Insufficient nvidia.com/gpu"),
        # a surge pod (the role still has all its pods available) waits for capacity: expected
        ([pod("p3", unschedulable=True)], all_ready(), None, None),
        # a rollout's pod waiting for the GPUs of a predecessor that is still terminating: expected
        ([pod("p3", unschedulable=True), pod("old", role="decode", deleting=True)], SHORT, None, None),
        # just now unschedulable: the scheduler may not have retried since capacity was freed
        ([pod("p3", unschedulable=True, since="2025-01-01T00:00:50Z")], SHORT, None, None),
        ([pod("p4", waiting="ContainerCreating")], all_ready(), None, None),  # transient: not degraded
        (
            [],
            {
                **all_ready(),
                "decode": dep(
                    "decode",
                    1,
                    0,
                    conditions=[
                        {
                            "type": "Progressing",
                            "status": "False",
                            "reason": "ProgressDeadlineExceeded",
                            "message": "timed out",
                        }
                    ],
                ),
            },
            "ProgressDeadlineExceeded",
            "deployment llama-decode: timed out",
        ),
    ],
)
def test_degraded(pods, deployments, reason, text):
    degraded = next(c for c in build_status(ms(), deployments, pods, [], T1)["conditions"] if c["type"] == "Degraded")
    if reason is None:
        assert degraded["status"] == "False"
    else:
        assert (degraded["status"], degraded["reason"]) == ("True", reason) and text in degraded["message"]


def test_rolled_out_needs_a_deployment():
    assert not rolled_out(None) and rolled_out(dep("x", 1, 1))


def test_transition_time_kept_while_status_unchanged():
    first = build_status(ms(), all_ready(), [], [], T0)["conditions"]
    again = build_status(ms(), all_ready(), [], first, T1)["conditions"]
    assert all(c["lastTransitionTime"] == T0 for c in again)
    flipped = merge_conditions(again, [{**again[0], "status": "False"}], T1)
    assert flipped[0]["lastTransitionTime"] == T1


def test_transitions_become_events():
    assert transitions([], build_status(ms(), {}, [], [], T0)["conditions"]) == [
        ("Normal", "ReplicasNotReady", "ready: prefill 0/2, decode 0/1, router 0/1"),
        ("Normal", "RollingOut", "revision " + build_status(ms(), {}, [], [], T0)["revision"] +
         " rolling out: prefill not created yet; decode not created yet; router not created yet")]
    ready = build_status(ms(), all_ready(), [], [], T0)["conditions"]
    crashed = build_status(
        ms(), {**all_ready(), "decode": dep("decode", 1, 0)}, [pod("p", waiting="CrashLoopBackOff")], ready, T1
    )
    kinds = {(t, r) for t, r, _ in transitions(ready, crashed["conditions"])}
    # a pod that is not available also means the rollout is not complete
    assert kinds == {("Warning", "ReplicasNotReady"), ("Warning", "CrashLoopBackOff"), ("Normal", "RollingOut")}
    assert transitions(ready, ready) == []


def test_scale_up_and_rollouts_are_news_not_warnings():
    before = build_status(ms(), all_ready(), [], [], T0)
    # a spec edit (generation 2) asks for a second decode worker
    scaled = build_status(ms(generation=2), {**all_ready(), "decode": dep("decode", 2, 1, updated=2, total=2)}, [],
                          before["conditions"], T1)
    assert unready_expected(before, scaled)
    events = transitions(before["conditions"], scaled["conditions"], expected=unready_expected(before, scaled))
    assert ("Normal", "ReplicasNotReady") in {(t, r) for t, r, _ in events}
    assert not [e for e in events if e[0] == "Warning"]
    # the last pod of a rollout being replaced: the rollout was already under way
    assert unready_expected(scaled, build_status(ms(generation=2), {**all_ready(), "decode": dep("decode", 2, 1)}, [],
                                                 scaled["conditions"], T1))
    # an autoscaler raised the count (no spec edit)
    hpa = build_status(
        ms(), {**all_ready(), "decode": dep("decode", 3, 1, updated=3, total=3)}, [], before["conditions"], T1
    )
    assert unready_expected(before, hpa)
    # a pod that stops being ready with nothing changing is a warning
    lost = build_status(ms(), {**all_ready(), "prefill": dep("prefill", 2, 1, updated=2)}, [], before["conditions"], T1)
    assert not unready_expected(before, lost)
    assert ("Warning", "ReplicasNotReady") in {(t, r) for t, r, _ in transitions(
        before["conditions"], lost["conditions"], expected=unready_expected(before, lost))}


def test_invalid_spec_keeps_ready():
    ready = build_status(ms(), all_ready(), [], [], T0)["conditions"]
    s = invalid_spec_status(2, "spec.x is bad", ready, T1)
    c = conds(s)
    assert c["Ready"] == ("True", "AllReplicasReady") and c["Degraded"] == ("True", "InvalidSpec")
    assert s["observedGeneration"] == 2
