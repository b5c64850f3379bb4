"""Autoscaling on the real control plane with real workers: the operator (KopfRunner, its own
RBAC) and the kubelet stand-in (e2e/kubelet.py: each pod's command runs as a local process on
its own 127.0.0.x address), tiny checkpoint, CPU.

- fallback: a decode worker that stops answering (SIGSTOP: its readiness probe fails, so the
  pod leaves the endpoints as a crashed or wedged pod would) leaves the model answering through
  the prefill worker, the ModelServing Degraded (DecodeUnavailable); SIGCONT brings
  disaggregation and the condition back;
- scale to zero and back: with spec.slo and minReplicas 0, a quiet model goes to zero workers,
  and the first request after that is held by the router, wakes the planner, and is answered by
  the worker it starts.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from kubernetes import client

from e2e.kubelet import Kubelet
from tests.k8s_cluster import wait_for
from tests.operator.test_k8s_operator import Api, operator

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

PROMPT = "The capital of France is"


def spec(model: str, **extra) -> dict:
    return {"model": {"source": model, "servedName": "tiny"}, "device": "cpu",
            "kvTransfer": {"backend": "tcp", "peerAllow": ["127.0.0.0/8"]},
            "drain": {"preStopSeconds": 1, "timeoutSeconds": 10}, **extra}


def ready_pods(core, ns: str, ms: str, role: str) -> list:
    out = []
    for p in core.list_namespaced_pod(ns, label_selector=f"pdserve.io/modelserving={ms},pdserve.io/role={role}").items:
        if not p.metadata.deletion_timestamp and any(c.type == "Ready" and c.status == "True"
                                                     for c in p.status.conditions or ()):
            out.append(p)
    return out


def router(core, ns: str, ms: str) -> str:
    (pod,) = ready_pods(core, ns, ms, "router")
    return f"http://{pod.status.pod_ip}:8000"


def complete(base: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=timeout,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})


def disaggregated(base: str) -> float:
    total = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve_router_requests_total{") and 'disaggregated="yes"' in line and 'status="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_fallback_degraded_and_scale_from_zero_on_the_control_plane(k8s_cluster, operator_kubeconfig, namespace,
                                                                      tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("llama"))
    api = Api(k8s_cluster, namespace)
    core, apps = api.core, client.AppsV1Api(k8s_cluster.api_client)
    kubelet = Kubelet(k8s_cluster.api_client, f"https://127.0.0.1:{k8s_cluster.port}",
                      k8s_cluster.run_dir / "pki" / "apiserver.crt", tmp_path, namespaces=[namespace], first_ip=150).start()
    try:
        with operator(operator_kubeconfig, namespace):
            api.create("fb", spec(model, prefill={"replicas": 1}, decode={"replicas": 1}))
            api.create("zero", spec(model, prefill={"autoscaling": {"minReplicas": 0, "maxReplicas": 1}},
                                    decode={"autoscaling": {"minReplicas": 0, "maxReplicas": 1}},
                                    slo={"ttftMilliseconds": 60000, "itlMilliseconds": 10000, "intervalSeconds": 5,
                                         "scaleUpCooldownSeconds": 0, "scaleDownWindowSeconds": 0,
                                         "scaleToZeroAfterSeconds": 60}))

            # -- fallback: decode stops answering; the prefill worker serves whole requests
            wait_for(lambda: api.condition("fb", "Ready").get("status") == "True", timeout=600, interval=1,
                     what="fb Ready")
            base = wait_for(lambda: router(core, namespace, "fb"), timeout=60, what="fb's router")
            wait_for(lambda: httpx.get(f"{base}/ready", timeout=5).json().get("status") == "ready", timeout=60,
                     what="fb's router sees both roles")
            # In full CI runs (never alone) the first request right after /ready said "ready" got a
            # 503 once and was served whole (not disaggregated) once; the cause is not found yet
            # (docs/status.md). Wait, bounded, until a request is disaggregated, keeping what came
            # before it for the failure message.
            seen: list[str] = []

            def disaggregated_answer() -> bool:
                r = complete(base)
                seen.append(f"{r.status_code} disaggregated={disaggregated(base)} {r.text[:200]}")
                return r.status_code == 200 and disaggregated(base) >= 1

            try:
                wait_for(disaggregated_answer, timeout=60, interval=1, what="a disaggregated answer from fb")
            except AssertionError as e:
                raise AssertionError(f"{e}; answers: {seen}") from None
            pd_before = disaggregated(base)
            (decode_pod,) = ready_pods(core, namespace, "fb", "decode")
            (proc,) = [p for p in list(kubelet.pods.values()) if p.name == decode_pod.metadata.name]
            group = os.getpgid(proc.proc.pid)
            os.killpg(group, signal.SIGSTOP)
            try:
                wait_for(lambda: api.condition("fb", "Degraded").get("reason") == "DecodeUnavailable", timeout=120,
                         interval=1, what="fb Degraded DecodeUnavailable")
                wait_for(lambda: httpx.get(f"{base}/ready", timeout=5).json().get("missing_role") == {"tiny": "decode"},
                         timeout=60, what="the router stops routing to the stopped decode worker")
                r = complete(base)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
                assert disaggregated(base) == pd_before  # served whole by the prefill worker
            finally:
                os.killpg(group, signal.SIGCONT)
            wait_for(lambda: api.condition("fb", "Degraded").get("status") == "False", timeout=120, interval=1,
                     what="fb no longer Degraded")
            wait_for(lambda: httpx.get(f"{base}/ready", timeout=5).json().get("status") == "ready", timeout=60,
                     what="fb's router sees decode again")
            wait_for(lambda: complete(base).status_code == 200 and disaggregated(base) > pd_before, timeout=60,
                     interval=1, what="disaggregation resumed")

            # -- scale to zero: no traffic for scaleToZeroAfterSeconds
            def replicas(role: str) -> int:
                # A scale of 0 leaves spec.replicas out (omitempty): the client reads None.
                return apps.read_namespaced_deployment_scale(f"zero-{role}", namespace).spec.replicas or 0

            zbase = wait_for(lambda: router(core, namespace, "zero"), timeout=600, interval=1, what="zero's router")
            wait_for(lambda: replicas("prefill") == 0 and replicas("decode") == 0, timeout=300, interval=2,
                     what="the planner scales a quiet model to zero")
            wait_for(lambda: not [p for p in core.list_namespaced_pod(
                namespace, label_selector="pdserve.io/modelserving=zero,pdserve.io/role in (prefill,decode)").items],
                timeout=120, what="zero's workers gone")
            assert "no traffic" in api.get("zero")["status"]["planner"]["decodeReason"]
            # The router's discovery and probes drop the gone workers on their own clock: wait for it.
            wait_for(lambda: httpx.get(f"{zbase}/ready", timeout=5).json()["status"] == "holding", timeout=60,
                     what="zero's router holding (no worker left in its pools)")

            # -- and back: the first request is held, wakes the planner, and is answered
            answers: list[httpx.Response] = []
            first = threading.Thread(target=lambda: answers.append(complete(zbase, timeout=400)), daemon=True)
            first.start()
            wait_for(lambda: replicas("decode") == 1, timeout=120, interval=1, what="the planner scales decode up")
            first.join(400)
            (r,) = answers
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 6
            messages = {(e.reason, e.message) for e in core.list_namespaced_event(
                namespace, field_selector="involvedObject.name=zero,involvedObject.kind=ModelServing").items}
            assert any(reason == "PlannerScaledUp" and msg.startswith("decode 0 -> 1: scale from zero: 1 request")
                       for reason, msg in messages), messages
            assert any(reason == "PlannerScaledDown" and msg.startswith("decode 1 -> 0:") for reason, msg in messages)
    finally:
        kubelet.stop()
