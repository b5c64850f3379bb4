"""Aggregated fallback (router/fallback.py) with real `pdserve worker` processes (tiny checkpoint,
CPU, TCP KV transfer) and the real `openai` client: with the decode role gone, the prefill worker
serves whole requests (the answer equals one worker's greedy answer); the router's metrics and
/ready say degraded; when decode comes back, requests are disaggregated again. Then the same
both ways on the real API server: pods go unready and ready (as Kubernetes takes a pod out of
its endpoints before stopping it) under a steady request stream that must see no failure."""

from __future__ import annotations

import os
import threading

import httpx
import openai
import pytest

from tests.helpers.metrics import metric
from tests.k8s_cluster import k8s_cluster  # noqa: F401  (the session fixture)
from tests.router.test_failures import eventually
from tests.router.test_real_workers import text_of

pytestmark = pytest.mark.slow


def disaggregated(router) -> float:
    return metric(router, "pdserve_router_requests_total", status="200", disaggregated="yes")


def test_prefill_workers_serve_whole_requests_while_decode_is_gone(launch, tiny_checkpoint):
    prefill, decode = launch.real_pd_workers(tiny_checkpoint("llama"))
    router = launch.router("--prefill", prefill.url, "--decode", decode.url)
    via_router = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    single = openai.OpenAI(base_url=prefill.url + "/v1", api_key="x", max_retries=0)  # a whole request on one worker
    expected = {(chat, stream): text_of(single, chat, stream)[0] for chat in (False, True) for stream in (False, True)}
    assert text_of(via_router, False, False)[0] == expected[False, False]
    assert disaggregated(router) == 1 and metric(router, "pdserve_router_degraded", missing_role="decode") == 0

    decode.stop()  # SIGTERM: it drains and exits; the router has not noticed yet
    # Unary: the decode leg finds no worker before anything reached the client, so the request
    # moves to the prefill worker whole (the prefill's pinned KV is released).
    assert text_of(via_router, True, False)[0] == expected[True, False]
    eventually(lambda: httpx.get(router.url + "/ready").json()["status"] == "degraded")
    assert httpx.get(router.url + "/ready").json()["missing_role"] == {"tiny": "decode"}
    assert metric(router, "pdserve_router_degraded", model="tiny", missing_role="decode") == 1
    for chat in (False, True):
        for stream in (False, True):
            text, usage = text_of(via_router, chat, stream)
            assert text == expected[chat, stream]
            assert usage is None or usage["completion_tokens"] == 10
    assert disaggregated(router) == 1  # none of those went through a hand-off
    assert metric(router, "pdserve_router_fallback_requests_total", missing_role="decode") >= 4
    eventually(lambda: prefill.kv()["num_pinned_blocks"] == 0, timeout_s=10)

    launch.restart(decode)
    eventually(lambda: httpx.get(router.url + "/ready").json()["status"] == "ready")
    assert metric(router, "pdserve_router_degraded", model="tiny", missing_role="decode") == 0
    assert text_of(via_router, False, True)[0] == expected[False, True]
    assert disaggregated(router) == 2  # disaggregation resumed


class Load(threading.Thread):
    """Requests one after another (completions and chat, unary and streamed) until stopped; every
    answer is checked, every failure kept."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        self.stopping = threading.Event()
        self.done = 0
        self.failures: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stopping.is_set():
            chat, stream = bool(i & 1), bool(i & 2)
            i += 1
            try:
                text, usage = text_of(self.client, chat, stream)
                if not text or (usage is not None and usage["completion_tokens"] != 10):
                    self.failures.append(f"request {i}: {text!r} {usage}")
            except Exception as e:  # noqa: BLE001 - every failure is the test's finding
                self.failures.append(f"request {i}: {e!r}")
            self.done += 1

    def wait_for(self, n: int, timeout_s: float = 120.0) -> None:
        target = self.done + n
        eventually(lambda: self.done >= target or bool(self.failures), timeout_s)
        assert not self.failures, self.failures

    def stop(self) -> None:
        self.stopping.set()
        self.join(120)


@pytest.mark.k8s
def test_role_transitions_fail_no_request(k8s_cluster, launch, tiny_checkpoint):  # noqa: F811
    """Kubernetes discovery: each role's pod goes unready (out of the endpoints, its process
    still up, as during a scale-down's drain) and comes back, under a steady request stream."""
    core = k8s_cluster.core()
    ns = k8s_cluster.create_namespace("router-fallback")
    labels = {"pdserve.io/modelserving": "fb"}
    prefill, decode = launch.real_pd_workers(tiny_checkpoint("llama"))
    for name, role, proc in (("fb-prefill", "prefill", prefill), ("fb-decode", "decode", decode)):
        port = int(proc.url.rsplit(":", 1)[1])
        core.create_namespaced_pod(ns, {
            "metadata": {"name": name, "labels": {**labels, "pdserve.io/role": role, "pdserve.io/revision": "r1"}},
            "spec": {"nodeName": "node-0", "containers": [
                {"name": "worker", "image": "pdserve:test", "ports": [{"name": "http", "containerPort": port}]}]}})
    # No Service selects them: each pod's own Ready condition decides (router/discovery.py).

    def set_ready(name: str, ready: bool) -> None:
        core.patch_namespaced_pod_status(
            name,
            ns,
            {
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "hostIP": "127.0.0.1",
                    "conditions": [
                        {"type": "Ready", "status": str(ready)},
                        {"type": "ContainersReady", "status": str(ready)},
                    ],
                }
            },
        )

    set_ready("fb-prefill", True)
    set_ready("fb-decode", True)
    env = dict(os.environ, KUBECONFIG=str(k8s_cluster.kubeconfig))
    router = launch.router("--discovery", "kubernetes", "--namespace", ns, "--selector", "pdserve.io/modelserving=fb",
                           "--discovery-interval", "0.3", env=env)

    def status() -> dict:
        return httpx.get(router.url + "/ready", timeout=5).json()

    eventually(lambda: status().get("prefill_workers") == 1 and status().get("decode_workers") == 1, 60)
    load = Load(router.url)
    load.start()
    try:
        load.wait_for(4)
        assert disaggregated(router) > 0
        for name, role in (("fb-decode", "decode"), ("fb-prefill", "prefill")):
            set_ready(name, False)
            eventually(lambda: status().get("missing_role") == {"tiny": role}, 30)
            assert metric(router, "pdserve_router_degraded", model="tiny", missing_role=role) == 1
            load.wait_for(1)  # a request begun before the router saw the change is done
            before = disaggregated(router)
            load.wait_for(4)
            assert disaggregated(router) == before  # served whole meanwhile
            set_ready(name, True)
            eventually(lambda: status()["status"] == "ready", 30)
            load.wait_for(4)
            assert disaggregated(router) > before  # disaggregation resumed
            assert metric(router, "pdserve_router_degraded", model="tiny", missing_role=role) == 0
    finally:
        load.stop()
    assert not load.failures, load.failures
    assert load.done >= 20
