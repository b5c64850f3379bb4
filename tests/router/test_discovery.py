"""Kubernetes discovery: the endpoint readers as pure functions (EndpointSlice v1 and core
Endpoints shapes), then against the real API server from ../shared/k8s with a router process
pairing prefill and decode workers of the same revision label."""

from __future__ import annotations

import os

import httpx
import pytest

from pdserve.router.discovery import endpoints_from_endpoints, endpoints_from_slices, specs_from
from pdserve.router.workers import WorkerSpec
from tests.k8s_cluster import k8s_cluster  # noqa: F401  (the session fixture)
from tests.net import free_port
from tests.router.test_failures import eventually


def pod(name, role, rev="r1", ready=True, ip="10.0.0.1", port=8000, deleting=False):
    meta = {"name": name, "labels": {"pdserve.io/role": role, "pdserve.io/revision": rev}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta,
            "spec": {"containers": [{"name": "w", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


SLICES = [{"ports": [{"name": "http", "port": 8000}], "endpoints": [
    {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": "d1"}},
    {"addresses": ["10.0.0.2"], "conditions": {"ready": False}, "targetRef": {"kind": "Pod", "name": "d2"}},
    {"addresses": ["10.0.0.3"], "conditions": {}, "targetRef": {"kind": "Pod", "name": "d3"}},
]}]
ENDPOINTS = [{"subsets": [{"ports": [{"name": "http", "port": 8000}],
                           "addresses": [{"ip": "10.0.0.1", "targetRef": {"kind": "Pod", "name": "d1"}},
                                         {"ip": "10.0.0.3", "targetRef": {"kind": "Pod", "name": "d3"}}],
                           "notReadyAddresses": [{"ip": "10.0.0.2", "targetRef": {"kind": "Pod", "name": "d2"}}]}]}]


@pytest.mark.parametrize("reader,items", [(endpoints_from_slices, SLICES), (endpoints_from_endpoints, ENDPOINTS)],
                         ids=["EndpointSlice", "Endpoints"])
def test_endpoint_readers_agree(reader, items):
    ready, seen = reader(items)
    assert ready == {"d1": ("10.0.0.1", 8000), "d3": ("10.0.0.3", 8000)}
    assert seen == {"d1", "d2", "d3"}


def test_specs_from_pods_and_endpoints():
    ready, seen = endpoints_from_endpoints(ENDPOINTS)
    pods = [pod("d1", "decode"), pod("d2", "decode", ip="10.0.0.2"),  # d2: endpoint says not ready
            pod("d3", "both", rev="r2", ip="10.0.0.3", deleting=True),  # terminating: dropped
            pod("p1", "prefill", ip="10.0.0.9", port=9000),  # no Service: its own Ready condition counts
            pod("p2", "prefill", ready=False, ip="10.0.0.8"),
            pod("b1", "both", rev="r2", ip="fd00::5"),
            pod("x", "router", ip="10.0.0.7")]
    assert specs_from(pods, ready, seen) == [
        WorkerSpec("http://10.0.0.1:8000", "decode", "r1"),
        WorkerSpec("http://[fd00::5]:8000", "decode", "r2"),
        WorkerSpec("http://10.0.0.9:9000", "prefill", "r1"),
        WorkerSpec("http://[fd00::5]:8000", "prefill", "r2"),
    ]


@pytest.mark.k8s
def test_router_discovers_workers_and_pairs_revisions(k8s_cluster, launch):
    core = k8s_cluster.core()
    ns = k8s_cluster.create_namespace("router-disc")
    labels = {"pdserve.io/modelserving": "m1"}
    layout = {"prefill-a": ("prefill", "a", "127.0.0.81"), "prefill-b": ("prefill", "b", "127.0.0.82"),
              "decode-a": ("decode", "a", "127.0.0.83"), "decode-b": ("decode", "b", "127.0.0.84")}
    workers = {}
    for name, (role, rev, ip) in layout.items():
        workers[name] = launch.fake_worker(host=ip, port=free_port(ip))
        port = int(workers[name].url.rsplit(":", 1)[1])
        core.create_namespaced_pod(ns, {
            "metadata": {"name": name, "labels": {**labels, "pdserve.io/role": role, "pdserve.io/revision": rev}},
            "spec": {"nodeName": "node-0", "containers": [
                {"name": "worker", "image": "pdserve:test", "ports": [{"name": "http", "containerPort": port}]}]}})
        core.patch_namespaced_pod_status(name, ns, {"status": {
            "phase": "Running", "podIP": ip, "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}})
    # Decode pods sit behind a Service (the EndpointSlice controller lists them; core Endpoints
    # would refuse these loopback pod IPs); prefill pods have none: their Ready condition counts.
    core.create_namespaced_service(
        ns,
        {
            "metadata": {"name": "m1-decode", "labels": labels},
            "spec": {
                "selector": {**labels, "pdserve.io/role": "decode"},
                "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
            },
        },
    )
    env = dict(os.environ, KUBECONFIG=str(k8s_cluster.kubeconfig))
    router = launch.router("--discovery", "kubernetes", "--namespace", ns, "--selector", "pdserve.io/modelserving=m1",
                           "--discovery-interval", "0.3", env=env)
    eventually(lambda: httpx.get(router.url + "/ready").json().get("prefill_workers") == 2)
    for _ in range(6):
        r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "hello " * 20, "max_tokens": 3},
                       timeout=10)
        assert r.status_code == 200, r.text
    paired = 0
    for rev in ("a", "b"):
        for req in workers[f"decode-{rev}"].requests():
            remote = req["body"]["kv_transfer_params"]["remote_url"]
            assert remote == workers[f"prefill-{rev}"].url  # never across revisions
            paired += 1
    assert paired == 6
    # A decode pod going unready leaves the router's pool (through its Endpoints).
    core.patch_namespaced_pod_status("decode-b", ns, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    eventually(lambda: httpx.get(router.url + "/ready").json().get("decode_workers") == 1)
