"""Autoscaling on the real control plane with real workers: the operator (KopfRunner, its own
RBAC) and the kubelet stand-in (e2e/kubelet.py: each pod's command runs as a local process on
its own 127.0.0.x address), tiny checkpoint, CPU.

- fallback: a decode worker that stops answering (SIGSTOP: its readiness probe fails, so the
  pod leaves the endpoints as a crashed or wedged pod would) leaves the model answering through
  the prefill worker, the ModelServing Degraded (DecodeUnavailable); SIGCONT brings
  disaggregation and the condition back;
- scale to zero and back: with spec.slo and minReplicas 0, a quiet model goes to zero workers,
  and the first request after that is held by the router, wakes the planner, and is answered by
  the worker it starts;
- a load step: a TTFT breach adds a prefill replica, which takes prefill work; the load removed,
  the planner takes it back with no failed request (test_a_ttft_breach_adds_prefill_...).
"""

from __future__ import annotations

import base64
import os
import signal
import threading
import warnings

import httpx
import pytest
from kubernetes import client

from e2e.kubelet import Kubelet
from pdserve.operator.naming import WORKER_API_KEY_KEY
from tests.helpers.metrics import metric
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


def ready_router(api, core, ns: str, ms: str) -> str:
    """Once ModelServing `ms` is Ready and its router sees both roles: the router's base URL."""
    wait_for(lambda: api.condition(ms, "Ready").get("status") == "True", timeout=600, interval=1, what=f"{ms} Ready")
    base = wait_for(lambda: router(core, ns, ms), timeout=60, what=f"{ms}'s router")
    wait_for(lambda: httpx.get(f"{base}/ready", timeout=5).json().get("status") == "ready", timeout=60,
             what=f"{ms}'s router sees both roles")
    return base


def complete(base: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=timeout,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})


def disaggregated(base: str) -> float:
    return metric(base, "pdserve_router_requests_total", disaggregated="yes", status="200")


def routing_state(base: str, kubelet: Kubelet, ms: str) -> str:
    """The router's counters that say why a request was not disaggregated, its workers (with
    their revisions: the router pairs only workers of one), and the warnings in the logs of
    `ms`'s pods (a failed prefill or decode leg is logged there)."""
    wanted = ("pdserve_router_retries_total", "pdserve_router_upstream_errors_total",
              "pdserve_router_fallback_requests_total", "pdserve_router_decode_prefix_hits_total")
    lines = [ln for ln in httpx.get(f"{base}/metrics", timeout=5).text.splitlines() if ln.startswith(wanted)]
    workers = [{k: w[k] for k in ("role", "revision", "models", "healthy", "routable", "consecutive_failures")}
               for w in httpx.get(f"{base}/debug/workers", timeout=5).json()]
    logged = {}
    for pod in list(kubelet.pods.values()):
        if pod.name.startswith(f"{ms}-") and pod.log_path.exists():
            text = pod.log_path.read_text(errors="replace").splitlines()
            logged[pod.name] = [ln[:300] for ln in text if "WARNING" in ln or "ERROR" in ln][-8:]
    return f"metrics {lines}; workers {workers}; pod warnings {logged}"


def test_fallback_degraded_and_scale_from_zero_on_the_control_plane(k8s_cluster, operator_kubeconfig, namespace,
                                                                      tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("llama"))
    api = Api(k8s_cluster, namespace)
    core, apps = api.core, client.AppsV1Api(k8s_cluster.api_client)
    kubelet = Kubelet(k8s_cluster.api_client, f"https://127.0.0.1:{k8s_cluster.port}",
                      k8s_cluster.run_dir / "pki" / "apiserver.crt", tmp_path, namespaces=[namespace],
                      first_ip=150).start()
    try:
        with operator(operator_kubeconfig, namespace):
            api.create("fb", spec(model, prefill={"replicas": 1}, decode={"replicas": 1}))
            api.create("zero", spec(model, prefill={"autoscaling": {"minReplicas": 0, "maxReplicas": 1}},
                                    decode={"autoscaling": {"minReplicas": 0, "maxReplicas": 1}},
                                    slo={"ttftMilliseconds": 60000, "itlMilliseconds": 10000, "intervalSeconds": 5,
                                         "scaleUpCooldownSeconds": 0, "scaleDownWindowSeconds": 0,
                                         "scaleToZeroAfterSeconds": 60}))

            # -- fallback: decode stops answering; the prefill worker serves whole requests
            base = ready_router(api, core, namespace, "fb")
            # In full CI runs (never alone) the first request right after /ready said "ready" got a
            # 503 once and was served whole (not disaggregated) once; the cause is not found yet
            # (docs/status.md). Wait, bounded, until a request is disaggregated, keeping what came
            # before it for the failure message.
            seen: list[str] = []

            def disaggregated_answer() -> bool:
                r = complete(base)
                seen.append(f"{r.status_code} disaggregated={disaggregated(base)} {r.text[:200]}")
                if r.status_code == 200 and disaggregated(base) >= 1:
                    return True
                # Surfaced in the run's warnings summary even when a later request passes: which
                # way the router went (a prefill retry, a fallback, a decode prefix hit) and how it
                # saw its workers, so the next occurrence names its cause.
                warnings.warn(f"fb's request right after /ready was not disaggregated: {seen[-1]}; "
                              f"{routing_state(base, kubelet, 'fb')}", stacklevel=1)
                return False

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


class Load:
    """`clients` threads, each sending completions back to back until stopped; every answer's
    status (a failure's with its body, or the exception a failed call raised) is kept."""

    def __init__(self, base: str, clients: int):
        self.base, self.stop_event, self.results = base, threading.Event(), []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                r = complete(self.base)
                # a failure keeps what the router said, so a red run names its cause
                outcome: object = 200 if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                outcome = repr(e)
            with self.lock:
                self.results.append(outcome)

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(150)
        if exc[0] is None:  # never hide the failure that ended the block
            assert not any(t.is_alive() for t in self.threads), "a load client is stuck"

    def failed(self) -> list:
        with self.lock:
            return [r for r in self.results if r != 200]


def counter(url: str, name: str, key: str | None = None) -> float:
    """Sum of a counter's samples on one /metrics page (a worker's takes the worker API key)."""
    return metric(url, name, headers={"Authorization": f"Bearer {key}"} if key else None)


def test_a_ttft_breach_adds_prefill_and_load_removed_takes_it_back(k8s_cluster, operator_kubeconfig, namespace,
                                                                   tiny_checkpoint, tmp_path):
    """The load step of issue 29 on the real control plane, with the planner's own timer.

    The breach is made by construction, not by racing the CPU: the TTFT target is 1 ms, which
    no request meets, so any interval with requests misses it and no interval without requests
    does. On this shared 2-core machine a live TTFT that a load pushes over a target and a
    second CPU process brings back under it is a race (both workers share the same two cores),
    so "the target is met again once the replicas are ready" is checked from recorded snapshots
    (tests/operator/test_planner.py, test_a_saturated_prefill_role_is_sized_from_arrivals_in_one_step),
    and here: the load breaks the target; the planner adds a prefill replica (its reason names
    the TTFT it read); the new worker becomes ready and takes prefill work from the router; the
    load removed, the planner takes the replica back (after its 20 s window) and the removed pod
    goes; not one request of the load (across the new worker joining), nor one
    after the scale-down, failed. The load stops before the scale-down, so no request is in
    flight on the pod that goes (a prefill worker's SIGTERM drain with KV pinned:
    tests/worker/test_kv_transfer.py; role changes under a request stream:
    tests/router/test_fallback.py). Nothing is timed: every step is a condition waited for with a
    bound; it takes about 2 minutes here.
    """
    model = str(tiny_checkpoint("llama"))
    api = Api(k8s_cluster, namespace)
    core, apps = api.core, client.AppsV1Api(k8s_cluster.api_client)
    kubelet = Kubelet(k8s_cluster.api_client, f"https://127.0.0.1:{k8s_cluster.port}",
                      k8s_cluster.run_dir / "pki" / "apiserver.crt", tmp_path, namespaces=[namespace],
                      first_ip=170).start()

    def replicas(role: str) -> int:
        return apps.read_namespaced_deployment_scale(f"step-{role}", namespace).spec.replicas or 0

    def prefill_pods() -> list:
        return core.list_namespaced_pod(
            namespace, label_selector="pdserve.io/modelserving=step,pdserve.io/role=prefill"
        ).items

    def events(reason: str) -> list[str]:
        return [e.message for e in core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=step,involvedObject.kind=ModelServing").items
            if e.reason == reason]

    try:
        with operator(operator_kubeconfig, namespace):
            api.create("step", spec(model, prefill={"autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
                                    decode={"replicas": 1},
                                    slo={"ttftMilliseconds": 1, "itlMilliseconds": 10000, "intervalSeconds": 5,
                                         "scaleUpCooldownSeconds": 0,
                                         # a window, so one quiet interval in the load (a stalled
                                         # machine) does not take the new replica back mid-test
                                         "scaleDownWindowSeconds": 20}))
            base = ready_router(api, core, namespace, "step")
            (first,) = ready_pods(core, namespace, "step", "prefill")
            assert replicas("prefill") == 1 and not events("PlannerScaledUp")  # no traffic, no change

            # -- the load step: the target breaks, the planner adds a prefill worker, which serves
            with Load(base, clients=3) as load:
                wait_for(lambda: replicas("prefill") == 2, timeout=120, interval=1,
                         what="the planner adds a prefill replica")
                # The Event is written after the scale: wait for it too.
                ups = wait_for(lambda: [m for m in events("PlannerScaledUp") if m.startswith("prefill 1 -> 2:")],
                               timeout=30, what="the PlannerScaledUp event")
                assert "(target 1 ms)" in ups[0] and "TTFT p90" in ups[0], ups
                new = wait_for(lambda: [p for p in ready_pods(core, namespace, "step", "prefill")
                                        if p.metadata.name != first.metadata.name], timeout=300, interval=1,
                               what="the new prefill worker ready")
                new_url = f"http://{new[0].status.pod_ip}:8000"
                secret = core.read_namespaced_secret("step-worker-api-key", namespace)
                key = base64.b64decode(secret.data[WORKER_API_KEY_KEY]).decode()
                try:
                    wait_for(lambda: counter(new_url, "vllm:prompt_tokens_total", key) > 0, timeout=120, interval=1,
                             what="the router sends prefill work to the new worker")
                except AssertionError as e:
                    first_url = f"http://{first.status.pod_ip}:8000"
                    raise AssertionError(
                        f"{e}; router workers {httpx.get(base + '/debug/workers', timeout=5).text}; "
                        f"prompt tokens first {counter(first_url, 'vllm:prompt_tokens_total', key)} new "
                        f"{counter(new_url, 'vllm:prompt_tokens_total', key)} ({new_url}); disaggregated {disaggregated(base)}; "  # noqa: E501
                        f"load {len(load.results)} answers, failed {load.failed()[:3]}"
                    ) from None
                assert replicas("decode") == 1  # decode has no autoscaling block: not the planner's
                assert counter(base, "pdserve_router_arrived_prompt_tokens_total") > 0
            assert load.results and not load.failed(), load.failed()[:5]

            # -- load removed: the planner takes the replica back; nothing fails
            wait_for(lambda: replicas("prefill") == 1, timeout=120, interval=1,
                     what="the planner takes the prefill replica back")
            wait_for(lambda: any(m.startswith("prefill 2 -> 1: down:") for m in events("PlannerScaledDown")),
                     timeout=30, what="the PlannerScaledDown event")
            wait_for(lambda: len(prefill_pods()) == 1, timeout=120, interval=1, what="the removed prefill pod gone")
            r = complete(base)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    finally:
        kubelet.stop()
