"""The KV data path's secure defaults (issue 15) and tensor-parallel workers (issue 18) against
a real Kubernetes 1.20 control plane, with the operator under its own minimal RBAC (so the
Secret and NetworkPolicy verbs it was given are proven enough) and `Kubelet` playing node-0
(8 nvidia.com/gpu; the real scheduler places the pods). No network plugin runs here, so the
NetworkPolicy is checked as the API server stores it, not enforced."""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from tests.k8s_cluster import Kubelet, wait_for
from tests.operator.test_k8s_operator import SPEC, Api, became, operator
from tests.operator.test_k8s_production import gpus_bound

pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]


def secret(api: Api, name: str):
    try:
        return api.core.read_namespaced_secret(name, api.ns)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def worker_secret_refs(kubelet: Kubelet, name: str, env: str = "PDSERVE_KV_SECRET",
                       roles: str = "prefill,decode") -> set[tuple[str, str]]:
    return {(e.value_from.secret_key_ref.name, e.value_from.secret_key_ref.key)
            for p in kubelet.bound_pods(f"pdserve.io/modelserving={name},pdserve.io/role in ({roles})")
            for e in p.spec.containers[0].env or () if e.name == env}


def key_uids(kubelet: Kubelet, name: str) -> dict[str, set[str]]:
    """role -> the worker API key Secret uids its live pods were started with (annotation)."""
    out: dict[str, set[str]] = {}
    for p in kubelet.bound_pods(f"pdserve.io/modelserving={name}"):
        if not p.metadata.deletion_timestamp:
            out.setdefault(p.metadata.labels["pdserve.io/role"], set()).add(
                (p.metadata.annotations or {}).get("pdserve.io/worker-api-key-uid"))
    return out


def test_kv_secret_is_generated_once_and_survives_reconciles_restarts_and_rollouts(k8s_cluster, operator_kubeconfig,
                                                                                   namespace):
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    with operator(operator_kubeconfig, namespace):
        uid = api.create("sec", SPEC)["metadata"]["uid"]
        became(api, kubelet, "sec", "Ready", "True")
        first = secret(api, "sec-kv-secret")
        assert first.type == "Opaque" and len(first.data["kv-secret"]) >= 40  # 32 random bytes, base64
        (ref,) = first.metadata.owner_references
        assert (ref.kind, ref.uid, ref.controller) == ("ModelServing", uid, True)
        assert worker_secret_refs(kubelet, "sec") == {("sec-kv-secret", "kv-secret")}
        revision = api.get("sec")["status"]["revision"]
        # the workers' API key: the same lifecycle; workers accept it, the router presents it
        key = secret(api, "sec-worker-api-key")
        assert key.type == "Opaque" and len(key.data["api-key"]) >= 40
        assert [(r.kind, r.uid) for r in key.metadata.owner_references] == [("ModelServing", uid)]
        assert worker_secret_refs(kubelet, "sec", "PDSERVE_API_KEYS") == {("sec-worker-api-key", "api-key")}
        assert worker_secret_refs(kubelet, "sec", "PDSERVE_WORKER_API_KEY", "router") == {
            ("sec-worker-api-key", "api-key")
        }
        assert key_uids(kubelet, "sec") == {r: {key.metadata.uid} for r in ("prefill", "decode", "router")}

        # many timer reconciles and a spec edit that rolls the pods: the Secret is untouched
        time.sleep(4)  # resync every 1 s
        api.patch("sec", {"decode": {"env": [{"name": "NCCL_DEBUG", "value": "WARN"}]}})
        became(api, kubelet, "sec", "Progressing", "False", "RolloutComplete", timeout=90)
        for name, before in (("sec-kv-secret", first), ("sec-worker-api-key", key)):
            same = secret(api, name)
            assert (same.metadata.uid, same.metadata.resource_version, same.data) == \
                (before.metadata.uid, before.metadata.resource_version, before.data)
        assert api.get("sec")["status"]["revision"] == revision  # env is not part of the revision

    # a restarted operator reads it, never rewrites it
    with operator(operator_kubeconfig, namespace):
        api.patch("sec", {"prefill": {"replicas": 1}})  # something to reconcile for sure
        wait_for(lambda: api.get("sec")["status"]["observedGeneration"] == api.get("sec")["metadata"]["generation"],
                 what="the restarted operator's reconcile")
        time.sleep(3)
        for name, before in (("sec-kv-secret", first), ("sec-worker-api-key", key)):
            after = secret(api, name)
            assert (after.metadata.uid, after.metadata.resource_version, after.data) == \
                (before.metadata.uid, before.metadata.resource_version, before.data)
        assert api.get("sec")["status"]["revision"] == revision

        # the API key deleted by hand: a new one, and every pod (workers and router) restarts
        # with it, on the same revision (who may call a worker is not what pairs workers)
        api.core.delete_namespaced_secret("sec-worker-api-key", namespace)
        new_key = wait_for(lambda: (s := secret(api, "sec-worker-api-key")) is not None
                           and s.metadata.uid != key.metadata.uid and s, what="a new worker API key")
        assert new_key.data != key.data

        def restarted():
            kubelet.make_ready("pdserve.io/modelserving=sec")
            return key_uids(kubelet, "sec") == {r: {new_key.metadata.uid} for r in ("prefill", "decode", "router")}

        wait_for(restarted, timeout=90, what="every pod restarted with the new key")
        assert api.get("sec")["status"]["revision"] == revision

        # deleted by hand: a new Secret (new value) and a new revision, so old and new pods never pair
        api.core.delete_namespaced_secret("sec-kv-secret", namespace)
        wait_for(lambda: (s := secret(api, "sec-kv-secret")) is not None and s.metadata.uid != first.metadata.uid,
                 what="a new generated Secret")
        assert secret(api, "sec-kv-secret").data != first.data
        wait_for(lambda: api.get("sec")["status"]["revision"] != revision, what="a new revision")
        became(api, kubelet, "sec", "Progressing", "False", "RolloutComplete", timeout=90)
        wait_for(lambda: ("Normal", "RevisionChanged") in api.events("sec"), what="the RevisionChanged event")

        # deleted with the ModelServing (garbage collector, through the owner reference)
        api.delete("sec")
        wait_for(lambda: secret(api, "sec-kv-secret") is None and secret(api, "sec-worker-api-key") is None,
                 what="the Secrets garbage-collected")


def test_a_foreign_secret_of_that_name_is_refused_and_a_secret_ref_is_used_as_given(k8s_cluster, operator_kubeconfig,
                                                                                     namespace):
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    api.core.create_namespaced_secret(namespace, {"metadata": {"name": "mine-kv-secret"},
                                                  "stringData": {"kv-secret": "not-the-operators-" * 2}})
    with operator(operator_kubeconfig, namespace):
        api.create("mine", SPEC)
        became(api, kubelet, "mine", "Degraded", "True", "InvalidSpec")
        message = api.condition("mine", "Degraded")["message"]
        assert "manages Secret mine-kv-secret, but a Secret of that name exists that this ModelServing does not own" \
            in message, message
        assert not api.deployments("mine")  # no worker was started with a secret nobody vouched for
        assert secret(api, "mine-kv-secret").metadata.owner_references is None  # left alone

        # naming it explicitly is how to use it
        api.patch("mine", {"kvTransfer": {"secretRef": {"name": "mine-kv-secret"}}})
        became(api, kubelet, "mine", "Ready", "True")
        assert api.condition("mine", "Degraded")["status"] == "False"
        assert worker_secret_refs(kubelet, "mine") == {("mine-kv-secret", "kv-secret")}

        # the workers' API key from the user's Secret: workers and router read it, no uid annotation
        api.core.create_namespaced_secret(namespace, {"metadata": {"name": "mine-keys"},
                                                      "stringData": {"api-key": "users-own-worker-key-0123"}})
        api.patch("mine", {"workerApiKeySecret": {"name": "mine-keys"}})

        def switched():
            kubelet.make_ready("pdserve.io/modelserving=mine")
            return (
                worker_secret_refs(kubelet, "mine", "PDSERVE_API_KEYS") == {("mine-keys", "api-key")}
                and worker_secret_refs(kubelet, "mine", "PDSERVE_WORKER_API_KEY", "router")
                == {("mine-keys", "api-key")}
                and key_uids(kubelet, "mine") == {r: {None} for r in ("prefill", "decode", "router")}
            )

        wait_for(switched, timeout=90, what="workers and router on the user's key Secret")
        assert secret(api, "mine-keys").metadata.owner_references is None  # theirs, never adopted


def test_network_policy_is_accepted_selects_this_modelserving_and_follows_the_spec(k8s_cluster, operator_kubeconfig,
                                                                                   namespace):
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    net = client.NetworkingV1Api(k8s_cluster.api_client)

    def policy():
        try:
            return net.read_namespaced_network_policy("np-workers", namespace)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    with operator(operator_kubeconfig, namespace):
        uid = api.create("np", {**SPEC, "router": {"policy": "prefix-aware"}})["metadata"]["uid"]
        became(api, kubelet, "np", "Ready", "True")
        p = wait_for(policy, what="the NetworkPolicy")
        assert [r.uid for r in p.metadata.owner_references] == [uid]
        assert p.spec.policy_types == ["Ingress"]
        # the server's own label-selector evaluation: the policy's pods are exactly the workers
        selector = ",".join(f"{e.key} in ({','.join(e.values)})" for e in p.spec.pod_selector.match_expressions)
        selected = {x.metadata.labels["pdserve.io/role"] for x in kubelet.bound_pods(selector)}
        assert selected == {"prefill", "decode"}
        workers, router = p.spec.ingress
        assert workers._from[0].pod_selector == p.spec.pod_selector
        assert [(x.protocol, x.port) for x in workers.ports] == [("TCP", None)]
        assert router._from[0].pod_selector.match_labels == {
            "pdserve.io/modelserving": "np",
            "pdserve.io/role": "router",
        }
        assert [x.port for x in router.ports] == [8000, 5557, 5558]

        # scrapers as configured
        api.patch("np", {"networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]}})
        p = wait_for(lambda: (q := policy()) and len(q.spec.ingress) == 3 and q, what="a scraper rule")
        assert p.spec.ingress[2]._from[0].namespace_selector.match_labels == {"team": "obs"}
        assert [x.port for x in p.spec.ingress[2].ports] == [8000]

        # turned off: pruned (the operator's RBAC lets it list and delete NetworkPolicies)
        api.patch("np", {"networkPolicy": {"enabled": False}})
        wait_for(lambda: policy() is None, what="the NetworkPolicy pruned")
        wait_for(lambda: ("Normal", "Pruned") in api.events("np"), what="the Pruned event")  # kopf posts them async


def test_tensor_parallel_workers_request_a_gpu_per_rank_and_fill_node_0(k8s_cluster, operator_kubeconfig, namespace):
    """2 prefill workers of TP=2 and 1 decode worker of TP=4: exactly node-0's 8 GPUs, a KV port
    per prefill rank; one more TP=2 worker cannot be placed and waits for capacity."""
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    spec = {
        **SPEC,
        "prefill": {"replicas": 2, "tensorParallelSize": 2},
        "decode": {"replicas": 1, "tensorParallelSize": 4},
    }
    with operator(operator_kubeconfig, namespace):
        api.create("tp", spec)
        became(api, kubelet, "tp", "Ready", "True", timeout=90)
        assert gpus_bound(kubelet) == 8
        for role, ranks, shm in (("prefill", 2, "8Gi"), ("decode", 4, "16Gi")):
            pods = kubelet.bound_pods(f"pdserve.io/modelserving=tp,pdserve.io/role={role}")
            assert len(pods) == (2 if role == "prefill" else 1)
            for p in pods:
                c = p.spec.containers[0]
                assert c.resources.limits["nvidia.com/gpu"] == str(ranks)
                assert c.resources.requests["nvidia.com/gpu"] == str(ranks)  # defaulted from the limit
                assert c.args[c.args.index("--tensor-parallel-size") + 1] == str(ranks)
                (vol,) = [v for v in p.spec.volumes if v.name == "shm"]
                assert (vol.empty_dir.medium, vol.empty_dir.size_limit) == ("Memory", shm)
                # prefill rank r serves its KV shard on kvTransfer.port + r; decode ranks only dial out
                kv = [("kv", 5600), ("kv-1", 5601)] if role == "prefill" else [("kv", 5600)]
                assert [(x.name, x.container_port) for x in c.ports] == [("http", 8000)] + kv
            # the API server accepts the per-rank port names in the headless Service too
            svc = api.core.read_namespaced_service(f"tp-{role}", namespace)
            assert [(x.name, x.port, x.target_port) for x in svc.spec.ports] == [("http", 8000, "http")] + [
                (n, p, n) for n, p in kv]

        api.patch("tp", {"prefill": {"replicas": 3}})
        wait_for(lambda: "waiting for capacity" in api.condition("tp", "Progressing").get("message", ""),
                 what="the third TP=2 prefill worker waiting for GPUs")
        pending = [p for p in api.core.list_namespaced_pod(namespace, label_selector="pdserve.io/role=prefill").items
                   if not p.spec.node_name]
        assert len(pending) == 1
        (cond,) = [c for c in pending[0].status.conditions if c.type == "PodScheduled"]
        assert cond.reason == "Unschedulable" and "nvidia.com/gpu" in cond.message
