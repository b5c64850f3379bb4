"""spec.slo and scale to zero in the operator: the spec rules and builders (pure), the fallback
Degraded condition, the CRD's validation on the real API server, and one planner round
(operator/autoscaler.py) against the real API server under the operator's own RBAC."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.rest import ApiException

from pdserve.operator.autoscaler import Memory, planner_config, tick
from pdserve.operator.children import build_children
from pdserve.operator.config import load_client_configuration
from pdserve.operator.kube import Kube
from pdserve.operator.optional import ApiVersions
from pdserve.operator.reconcile import reconcile
from pdserve.operator.spec import ModelServing, ModelServingSpec, SpecError
from pdserve.operator.status import build_status
from pdserve.operator.workloads import build_router_deployment

APIS = ApiVersions("autoscaling/v2", "policy/v1", None)
SLO = {"ttftMilliseconds": 1000, "itlMilliseconds": 30}
SPEC = {"model": {"source": "hf://m/x"}, "image": "img",
        "prefill": {"autoscaling": {"minReplicas": 0, "maxReplicas": 6}},
        "decode": {"autoscaling": {"minReplicas": 0, "maxReplicas": 4}}, "slo": SLO}


def ms(spec=SPEC) -> ModelServing:
    return ModelServing("llama", "ns", "uid", ModelServingSpec.from_dict(spec))


def test_min_replicas_zero_needs_the_planner():
    spec = {**SPEC}
    del spec["slo"]
    with pytest.raises(SpecError, match=r"spec.prefill.autoscaling.minReplicas 0 needs spec.slo"):
        ms(spec)
    with pytest.raises(SpecError, match="ttftMilliseconds and itlMilliseconds"):
        ms({**SPEC, "slo": {"ttftMilliseconds": 5}})


def test_with_slo_the_planner_not_an_hpa_owns_the_counts():
    children = build_children(ms(), APIS, {})
    assert not [c for c in children if c["kind"] == "HorizontalPodAutoscaler"]
    workers = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] != "llama-router"]
    assert len(workers) == 2 and all("replicas" not in d["spec"] for d in workers)
    without = {**SPEC, "slo": None, "prefill": {"autoscaling": {"maxReplicas": 6}}, "decode": {}}
    assert [c["kind"] for c in build_children(ms(without), APIS, {})].count("HorizontalPodAutoscaler") == 1


def test_a_router_that_may_find_no_worker_holds_requests():
    args = build_router_deployment(ms())["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--hold-timeout") + 1] == "300"
    fixed = {**SPEC, "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 6}},
             "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}}
    assert (
        "--hold-timeout" not in build_router_deployment(ms(fixed))["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_planner_config_from_the_spec():
    cfg = planner_config(ms({**SPEC, "slo": {**SLO, "percentile": 99, "gpuBudget": 8},
                             "decode": {"replicas": 3, "resources": {"limits": {"nvidia.com/gpu": 2}}},
                             "prefillDecodeRatio": {"max": 2}}))
    assert (cfg.ttft_s, cfg.itl_s, cfg.percentile, cfg.gpu_budget, cfg.ratio_max) == (1.0, 0.03, 0.99, 8, 2)
    assert (cfg.prefill.min_replicas, cfg.prefill.max_replicas) == (0, 6)
    # decode has no autoscaling block: fixed at its replicas
    assert (cfg.decode.min_replicas, cfg.decode.max_replicas, cfg.decode.gpus_per_replica) == (3, 3, 2)


def dep(want, ready):
    return {"metadata": {"name": "d", "generation": 1}, "spec": {"replicas": want},
            "status": {"observedGeneration": 1, "replicas": want, "readyReplicas": ready, "availableReplicas": ready,
                       "updatedReplicas": ready}}


def conds(s):
    return {c["type"]: (c["status"], c["reason"]) for c in s["conditions"]}


def test_degraded_while_one_role_serves_whole_requests():
    m = ms({"model": {"source": "hf://m/x"}, "image": "img"})
    up = build_status(m, {"prefill": dep(1, 1), "decode": dep(1, 1), "router": dep(1, 1)}, [], [], "T0")
    assert conds(up)["Degraded"] == ("False", "AsExpected")
    lost = build_status(m, {"prefill": dep(1, 1), "decode": dep(1, 0), "router": dep(1, 1)}, [], up["conditions"], "T1")
    assert conds(lost)["Degraded"] == ("True", "DecodeUnavailable")
    assert "prefill workers serve whole requests" in next(c["message"] for c in lost["conditions"]
                                                          if c["type"] == "Degraded")
    still = build_status(
        m, {"prefill": dep(1, 1), "decode": dep(1, 0), "router": dep(1, 1)}, [], lost["conditions"], "T2"
    )
    assert conds(still)["Degraded"] == ("True", "DecodeUnavailable")  # stays reported while not Ready
    back = build_status(
        m, {"prefill": dep(1, 1), "decode": dep(1, 1), "router": dep(1, 1)}, [], still["conditions"], "T3"
    )
    assert conds(back)["Degraded"] == ("False", "AsExpected")
    # At creation a role slower to load is not Degraded.
    fresh = build_status(m, {"prefill": dep(1, 0), "decode": dep(1, 1), "router": dep(1, 1)}, [], [], "T0")
    assert conds(fresh)["Degraded"] == ("False", "AsExpected")


# ---- the real API server ---------------------------------------------------------------------

K8S = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]


def create(k8s_cluster, namespace, spec, name="m"):
    return client.CustomObjectsApi(k8s_cluster.api_client).create_namespaced_custom_object(
        "pdserve.io", "v1alpha1", namespace, "modelservings",
        {"apiVersion": "pdserve.io/v1alpha1", "kind": "ModelServing", "metadata": {"name": name}, "spec": spec})


@pytest.mark.k8s
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_the_crd_takes_slo_and_zero_minimums_and_names_bad_fields(k8s_cluster, crd, namespace):
    obj = create(k8s_cluster, namespace, SPEC)
    assert obj["spec"]["slo"] == {**SLO, "percentile": 90, "targetUtilization": 0.8, "intervalSeconds": 15,
                                  "scaleUpCooldownSeconds": 30, "scaleDownWindowSeconds": 300, "maxScaleDownStep": 1,
                                  "scaleToZeroAfterSeconds": 600}
    assert obj["spec"]["prefill"]["autoscaling"]["minReplicas"] == 0
    for bad, field in (({"ttftMilliseconds": 100}, "spec.slo.itlMilliseconds"),
                       ({**SLO, "percentile": 100}, "spec.slo.percentile"),
                       ({**SLO, "intervalSeconds": 1}, "spec.slo.intervalSeconds")):
        with pytest.raises(ApiException) as e:
            create(k8s_cluster, namespace, {**SPEC, "slo": bad}, name="bad")
        assert e.value.status == 422 and field in e.value.body


def metrics_page(prompt_tokens: float, ttft_le: dict[str, float]) -> str:
    """A worker's and a router's /metrics as they print them (vLLM's names; recorded text)."""
    lines = ["# TYPE vllm:prompt_tokens_total counter", f'vllm:prompt_tokens_total{{model_name="m"}} {prompt_tokens}',
             "# TYPE pdserve_router_time_to_first_token_seconds histogram"]
    lines += [f'pdserve_router_time_to_first_token_seconds_bucket{{le="{le}"}} {n}' for le, n in ttft_le.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.k8s
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_a_planner_round_scales_prefill_through_its_scale_subresource(k8s_cluster, crd, namespace, operator_kubeconfig):
    """reconcile + two planner rounds as the operator runs them, under the operator's RBAC. No
    kubelet runs workers here: the pods are API objects marked ready, and their /metrics pages
    are recorded text (the `fetch` stand-in for the scrape) showing a TTFT breach."""
    spec = {**SPEC, "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 6}},
            "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}}
    create(k8s_cluster, namespace, spec, name="pl")
    kube = Kube(ApiClient(load_client_configuration(str(operator_kubeconfig))))
    body = kube.get("pdserve.io/v1alpha1", "ModelServing", namespace, "pl")
    reconcile(kube, body, "2026-11-27T00:00:00Z")
    core = k8s_cluster.core()
    for name, role, ip in (("pl-p1", "prefill", "127.0.0.91"), ("pl-r1", "router", "127.0.0.93")):
        core.create_namespaced_pod(namespace, {
            "metadata": {"name": name, "labels": {"pdserve.io/modelserving": "pl", "pdserve.io/role": role}},
            "spec": {"nodeName": "node-0", "containers": [{"name": "c", "image": "i", "ports": [
                {"name": "http", "containerPort": 8000}]}]}})
        core.patch_namespaced_pod_status(name, namespace, {"status": {
            "phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})
    apps = client.AppsV1Api(k8s_cluster.api_client)
    pages = {"before": {"http://127.0.0.91:8000": metrics_page(0, {}), "http://127.0.0.93:8000": metrics_page(0, {})},
             "after": {"http://127.0.0.91:8000": metrics_page(18000 * 20, {}),
                       "http://127.0.0.93:8000": metrics_page(0, {"0.5": 10, "1.0": 20, "5.0": 100, "+Inf": 100})}}
    memory = Memory()
    body = kube.get("pdserve.io/v1alpha1", "ModelServing", namespace, "pl")
    assert tick(kube, body, memory, 0.0, "2026-11-27T00:00:00Z", lambda urls, key: pages["before"]) is not None
    decision, events = tick(kube, body, memory, 20.0, "2026-11-27T00:00:20Z", lambda urls, key: pages["after"])
    # TTFT p90 4.5 s against 1 s. No Deployment pod is ready (no kubelet), so no capacity can be
    # learned from this round: the breach adds one replica.
    assert decision.prefill == 2 and decision.decode == 1
    assert "TTFT p90 4500 ms (target 1000 ms) missed" in decision.reasons["prefill"]
    assert apps.read_namespaced_deployment_scale("pl-prefill", namespace).spec.replicas == 2
    assert events == [("Normal", "PlannerScaledUp", f"prefill 1 -> 2: {decision.reasons['prefill']}")]
    planner = kube.get("pdserve.io/v1alpha1", "ModelServing", namespace, "pl")["status"]["planner"]
    assert planner["prefillReplicas"] == 2 and "TTFT p90" in planner["prefillReason"]
    # The next reconcile leaves the planner's count alone.
    reconcile(kube, kube.get("pdserve.io/v1alpha1", "ModelServing", namespace, "pl"), "2026-11-27T00:00:30Z")
    assert apps.read_namespaced_deployment_scale("pl-prefill", namespace).spec.replicas == 2


@pytest.mark.k8s
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_the_operator_runs_the_planner_on_its_timer(k8s_cluster, operator_kubeconfig, namespace):
    """The registered operator (KopfRunner, its own RBAC): a ModelServing with spec.slo gets no
    HPA and a status.planner from the timer; one without spec.slo gets neither."""
    from tests.k8s_cluster import Kubelet, wait_for
    from tests.operator.test_k8s_operator import SPEC as BASE
    from tests.operator.test_k8s_operator import Api, operator

    api = Api(k8s_cluster, namespace)
    kube = Kube(k8s_cluster.api_client)
    kubelet = Kubelet(k8s_cluster, namespace)
    spec = {**BASE, "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
            "decode": {"autoscaling": {"minReplicas": 1, "maxReplicas": 3}}, "slo": SLO}
    with operator(operator_kubeconfig, namespace):
        api.create("tp", spec)
        api.create("plain", BASE)

        def planned():
            kubelet.make_ready("pdserve.io/modelserving=tp")
            return (api.get("tp").get("status") or {}).get("planner")

        planner = wait_for(planned, timeout=60, what="status.planner from the planner's timer")
        assert planner["prefillReplicas"] == 1 and planner["decodeReplicas"] == 1
        assert "TTFT p90 n/a (target 1000 ms)" in planner["prefillReason"]
        assert not kube.list("autoscaling/v2beta2", "HorizontalPodAutoscaler", namespace, "pdserve.io/modelserving=tp")
        assert "planner" not in (api.get("plain").get("status") or {})
