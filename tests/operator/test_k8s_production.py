"""Running in production (issue 13) against a real Kubernetes 1.20 control plane, with the
operator under its own minimal RBAC and `Kubelet` standing in for node-0's kubelet (it marks
bound pods Ready and confirms deletions; it runs no containers).

node-0 advertises 8 nvidia.com/gpu: a ModelServing with 4 prefill + 4 decode workers fills it.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from pdserve.operator.status import UNSCHEDULABLE_GRACE_S
from tests.k8s_cluster import Kubelet, wait_for
from tests.net import free_port
from tests.operator.test_k8s_operator import SPEC, Api, became, operator

pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

FULL = {**SPEC, "prefill": {"replicas": 4}, "decode": {"replicas": 4}}
WORKERS = "pdserve.io/modelserving=full,pdserve.io/role in (prefill,decode)"


def gpus_bound(kubelet: Kubelet) -> int:
    return sum(int((c.resources.limits or {}).get("nvidia.com/gpu", 0))
               for p in kubelet.bound_pods("pdserve.io/modelserving") for c in p.spec.containers)


def watch_rollout(api: Api, kubelet: Kubelet, done, timeout: float = 180) -> list[dict]:
    """Play the kubelet until `done()`, recording at every step what a router would see: the
    ready worker pods' revision labels and images, and the conditions."""
    steps, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        kubelet.make_ready("pdserve.io/modelserving=full")
        ready = [p for p in kubelet.bound_pods(WORKERS)
                 if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())]
        st = api.get("full").get("status") or {}
        steps.append({"pods": [(p.metadata.labels["pdserve.io/revision"], p.spec.containers[0].image) for p in ready],
                      "conditions": {c["type"]: c for c in st.get("conditions") or ()}})
        if done():
            return steps
        time.sleep(0.3)
    raise AssertionError(f"rollout did not complete in {timeout}s; last step {steps[-1]}")


def test_rollouts_complete_with_every_gpu_in_use(k8s_cluster, operator_kubeconfig, namespace):
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    with operator(operator_kubeconfig, namespace):
        api.create("full", FULL)
        became(api, kubelet, "full", "Ready", "True", timeout=120)
        assert gpus_bound(kubelet) == 8  # node-0 is full
        strategy = api.deployments("full")["full-decode"].spec.strategy.rolling_update
        assert (strategy.max_surge, strategy.max_unavailable) == (0, 1)

        # 1. a user-chosen surge cannot fit: the surge pod waits, and that is progress, not damage
        api.patch("full", {"decode": {"rollout": {"maxSurge": 1, "maxUnavailable": 0},
                                      "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}})
        waiting_since = wait_for(
            lambda: (
                "waiting for capacity" in api.condition("full", "Progressing").get("message", "") and time.monotonic()
            ),
            timeout=60,
            what="a surge pod waiting for capacity",
        )
        while time.monotonic() - waiting_since < UNSCHEDULABLE_GRACE_S + 5:
            kubelet.make_ready("pdserve.io/modelserving=full")
            assert api.condition("full", "Degraded")["status"] == "False", api.condition("full", "Degraded")
            time.sleep(1)
        assert api.condition("full", "Ready")["status"] == "True"  # the old pods still serve

        # ... and going back to the default (replace, then start) lets the same rollout finish
        api.patch("full", {"decode": {"rollout": None}})
        steps = watch_rollout(
            api,
            kubelet,
            lambda: (
                api.condition("full", "Progressing").get("reason") == "RolloutComplete"
                and all(
                    any(e.name == "NCCL_DEBUG" for e in p.spec.containers[0].env or ())
                    for p in kubelet.bound_pods("pdserve.io/role=decode")
                )
            ),
        )
        assert not [s for s in steps if s["conditions"]["Degraded"]["status"] == "True"]

        # 2. a new revision (image) on the full node: both roles roll one pod at a time
        old_revision = api.get("full")["status"]["revision"]
        api.patch("full", {"image": "reg/pdserve:2"})
        wait_for(lambda: api.get("full")["status"]["revision"] != old_revision, what="the new revision in status")
        new_revision = api.get("full")["status"]["revision"]
        first = api.condition("full", "Progressing")["message"]
        assert "4/4 updated" not in first.split("rolling out:")[1], first  # never claims done as it starts
        steps = watch_rollout(
            api, kubelet, lambda: api.condition("full", "Progressing").get("reason") == "RolloutComplete"
        )
        assert not [s for s in steps if s["conditions"]["Degraded"]["status"] == "True"]
        # pairing: both revisions served side by side while part of each role was updated, and
        # the revision label always told the two KV layouts apart (the router pairs by it)
        mixed = [s for s in steps if {r for r, _ in s["pods"]} == {old_revision, new_revision}]
        assert mixed, "the rollout was expected to pass through a mixed state"
        for s in steps:
            assert {(r, img) for r, img in s["pods"]} <= {
                (old_revision, "reg/pdserve:1"),
                (new_revision, "reg/pdserve:2"),
            }
            assert len(s["pods"]) >= 6  # at most one pod per role down at a time
        pods = kubelet.bound_pods(WORKERS)
        assert {p.metadata.labels["pdserve.io/revision"] for p in pods} == {new_revision} and len(pods) == 8
        events = api.events("full")
        assert ("Normal", "RevisionChanged") in events and not [e for e in events if e[0] == "Warning"]


def test_scale_subresource_sizes_decode(k8s_cluster, operator_kubeconfig, namespace):
    """`kubectl scale ms NAME --replicas N` is a PATCH of the scale subresource."""
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    co = client.CustomObjectsApi(k8s_cluster.api_client)
    with operator(operator_kubeconfig, namespace):
        api.create("sc", SPEC)
        became(api, kubelet, "sc", "Ready", "True")
        scale = co.get_namespaced_custom_object_scale("pdserve.io", "v1alpha1", namespace, "modelservings", "sc")
        assert (
            scale["spec"]["replicas"] == 1
            and scale["status"]["selector"] == "pdserve.io/modelserving=sc,pdserve.io/role=decode"
        )
        co.patch_namespaced_custom_object_scale("pdserve.io", "v1alpha1", namespace, "modelservings", "sc",
                                                {"spec": {"replicas": 3}})
        assert api.get("sc")["spec"]["decode"]["replicas"] == 3
        wait_for(lambda: api.deployments("sc")["sc-decode"].spec.replicas == 3, what="decode Deployment scaled")
        became(api, kubelet, "sc", "Ready", "True")
        wait_for(lambda: co.get_namespaced_custom_object_scale("pdserve.io", "v1alpha1", namespace, "modelservings",
                                                               "sc")["status"]["replicas"] == 3, what="scale status 3")


def test_production_pod_shape_is_accepted_and_runs(k8s_cluster, operator_kubeconfig, namespace):
    """Every new pod-level field goes through the real API server's validation and
    server-side apply: pinned revision with an init container, the cache, prefix-aware router
    with a tokenizer, drain, security contexts, a podTemplate with a sidecar and a volume.
    (A cache sizeLimit also requests ephemeral-storage, which node-0 does not advertise: the
    pure builder test covers it.)"""
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    spec = {
        **SPEC,
        "model": {"source": "hf://org/model@0123abcd"},
        "router": {"policy": "prefix-aware"},
        "drain": {"timeoutSeconds": 90},
        "kvTransfer": {"ucxTls": "tcp"},
        "decode": {
            "probes": {"readiness": {"timeoutSeconds": 7}},
            "shmSize": "2Gi",
            "podTemplate": {
                "metadata": {"annotations": {"example.com/network": "fast"}},
                "spec": {
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": {"pdserve.io/role": "decode"}},
                        }
                    ],
                    "volumes": [{"name": "extra", "emptyDir": {}}],
                    "containers": [{"name": "sidecar", "image": "busybox", "command": ["sleep", "infinity"]}],
                },
            },
        },
    }
    with operator(operator_kubeconfig, namespace):
        api.create("prod", spec)
        became(api, kubelet, "prod", "Ready", "True")
        deps = api.deployments("prod")
        decode, router = deps["prod-decode"].spec.template, deps["prod-router"].spec.template
        worker = decode.spec.containers[0]
        assert [c.name for c in decode.spec.containers] == ["worker", "sidecar"]
        # the user's annotation merged with the operator's (the generated worker API key's uid)
        key_uid = api.core.read_namespaced_secret("prod-worker-api-key", namespace).metadata.uid
        assert decode.metadata.annotations == {"example.com/network": "fast", "pdserve.io/worker-api-key-uid": key_uid}
        assert decode.spec.init_containers[0].name == "fetch-model"
        assert (
            decode.spec.security_context.run_as_non_root
            and decode.spec.security_context.seccomp_profile.type == "RuntimeDefault"
        )
        assert worker.security_context.read_only_root_filesystem and worker.security_context.capabilities.drop == [
            "ALL"
        ]
        assert decode.spec.termination_grace_period_seconds == 5 + 90 + 10
        assert worker.lifecycle.pre_stop._exec.command == ["sleep", "5"]
        assert worker.readiness_probe.timeout_seconds == 7
        assert {e.name: e.value for e in worker.env}["UCX_TLS"] == "tcp"
        assert {p.name for p in worker.ports} == {"http", "kv", "kv-events", "kv-replay"}
        vols = {v.name: v for v in decode.spec.volumes}
        assert vols["shm"].empty_dir.size_limit == "2Gi" and {"cache", "tmp", "extra"} <= set(vols)
        assert (
            decode.spec.service_account_name == "prod-worker" and decode.spec.automount_service_account_token is False
        )
        assert (
            api.core.read_namespaced_service_account("prod-worker", namespace).automount_service_account_token is False
        )
        r = router.spec.containers[0]
        assert r.readiness_probe.http_get.path == "/ready" and r.resources.requests == {"cpu": "1", "memory": "1Gi"}
        assert r.args[r.args.index("--tokenizer") + 1] == "/cache/tokenizer"
        assert router.spec.init_containers[0].name == "fetch-tokenizer"


def test_prefix_aware_router_starts_as_built_and_is_unready_without_workers(
    k8s_cluster, namespace, tiny_checkpoint, tmp_path
):
    """The router container exactly as the operator builds it (command and args, a tokenizer
    from the model source), run as a process against the real API server: it starts with the
    prefix-aware policy, /health says alive, and /ready (the readinessProbe) says 503 while no
    decode worker is healthy, so a Service would not send it traffic."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from pdserve.operator.spec import ModelServing, ModelServingSpec
    from pdserve.operator.workloads import build_router_deployment

    m = ModelServing("rt", namespace, "uid", ModelServingSpec.from_dict(
        {"model": {"source": str(tiny_checkpoint("llama"))}, "router": {"policy": "prefix-aware"}}))
    (c,) = build_router_deployment(m)["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    port = free_port()
    args = list(c["args"])
    args[args.index("--host") + 1], args[args.index("--port") + 1] = "127.0.0.1", str(port)
    env = {
        **os.environ,
        "KUBECONFIG": str(k8s_cluster.kubeconfig),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    log = (tmp_path / "router.log").open("w")
    proc = subprocess.Popen([*c["command"], *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        wait_for(up, timeout=90, what="the router's /health")
        ready = httpx.get(f"{url}/ready", timeout=2)
        assert ready.status_code == 503 and "no healthy decode worker" in ready.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
