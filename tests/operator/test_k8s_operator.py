"""The operator (kopf.testing.KopfRunner, in-process) against a real Kubernetes 1.20 control
plane, running under its own minimal RBAC. No kubelet exists: `Kubelet` patches pod status the
way a kubelet would, so Deployments roll out and status can be checked end to end."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from kopf.testing import KopfRunner
from kubernetes import client

from pdserve.operator.config import OperatorConfig
from pdserve.operator.handlers import build_registry
from pdserve.operator.kube import Kube
from tests.k8s_cluster import Kubelet, wait_for
from tests.operator.test_k8s_crd import server_table

pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

SPEC = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "servedName": "llama"},
        "image": "reg/pdserve:1", "prefill": {"replicas": 2}, "decode": {"replicas": 1}}
WORKERS = "pdserve.io/role in (prefill,decode)"


@contextlib.contextmanager
def operator(kubeconfig: Path, namespace: str):
    # resync every second and re-discover APIs every reconcile: tests change both quickly
    config = OperatorConfig(namespaces=(namespace,), resync_interval_s=1.0, discovery_ttl_s=0.0,
                            kubeconfig=str(kubeconfig))
    with KopfRunner(["run", "--standalone", "--namespace", namespace], registry=build_registry(config),
                    timeout=60) as runner:
        yield runner
    assert runner.exit_code == 0, runner.output


class Api:
    def __init__(self, cluster, namespace):
        self.ns = namespace
        self.co = client.CustomObjectsApi(cluster.api_client)
        self.apps = client.AppsV1Api(cluster.api_client)
        self.core = cluster.core()
        self.rbac = client.RbacAuthorizationV1Api(cluster.api_client)

    def create(self, name, spec):
        return self.co.create_namespaced_custom_object("pdserve.io", "v1alpha1", self.ns, "modelservings", {
            "apiVersion": "pdserve.io/v1alpha1", "kind": "ModelServing", "metadata": {"name": name}, "spec": spec})

    def get(self, name):
        return self.co.get_namespaced_custom_object("pdserve.io", "v1alpha1", self.ns, "modelservings", name)

    def patch(self, name, spec):
        return self.co.patch_namespaced_custom_object(
            "pdserve.io", "v1alpha1", self.ns, "modelservings", name, {"spec": spec}
        )

    def delete(self, name):
        self.co.delete_namespaced_custom_object("pdserve.io", "v1alpha1", self.ns, "modelservings", name)

    def condition(self, name, type_):
        for c in (self.get(name).get("status") or {}).get("conditions") or ():
            if c["type"] == type_:
                return c
        return {}

    def deployments(self, name):
        return {d.metadata.name: d for d in self.apps.list_namespaced_deployment(
            self.ns, label_selector=f"pdserve.io/modelserving={name}").items}

    def services(self, name):
        return {s.metadata.name: s for s in self.core.list_namespaced_service(
            self.ns, label_selector=f"pdserve.io/modelserving={name}").items}

    def events(self, name):
        return [(e.type, e.reason) for e in self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name},involvedObject.kind=ModelServing").items]


def became(api, kubelet, name, type_, status, reason=None, timeout=60):
    """Wait for a condition, playing the kubelet meanwhile (new pods keep appearing)."""
    def check():
        kubelet.make_ready(f"pdserve.io/modelserving={name}")
        c = api.condition(name, type_)
        return c.get("status") == status and (reason is None or c.get("reason") == reason)
    wait_for(check, timeout=timeout, what=f"{name} {type_}={status} {reason or ''}")


def test_lifecycle_create_ready_scale_edit_degrade_delete(k8s_cluster, operator_kubeconfig, namespace, capsys):
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    with operator(operator_kubeconfig, namespace):
        uid = api.create("llama", SPEC)["metadata"]["uid"]

        # create -> every child appears, owned by the ModelServing
        deps = wait_for(lambda: len(api.deployments("llama")) == 3 and api.deployments("llama"), what="3 Deployments")
        assert set(deps) == {"llama-prefill", "llama-decode", "llama-router"}
        assert set(api.services("llama")) == {"llama-prefill", "llama-decode", "llama-router"}
        assert api.services("llama")["llama-decode"].spec.cluster_ip == "None"
        sa = api.core.read_namespaced_service_account("llama-router", namespace)
        role = api.rbac.read_namespaced_role("llama-router", namespace)
        binding = api.rbac.read_namespaced_role_binding("llama-router", namespace)
        kube = Kube(k8s_cluster.api_client)
        assert kube.versions().pdb == "policy/v1beta1"  # what 1.20 serves: discovered, not assumed
        pdbs = kube.list("policy/v1beta1", "PodDisruptionBudget", namespace, "pdserve.io/modelserving=llama")
        assert len(pdbs) == 3
        for obj in [*deps.values(), *api.services("llama").values(), sa, role, binding]:
            (ref,) = obj.metadata.owner_references
            assert (ref.kind, ref.uid, ref.controller) == ("ModelServing", uid, True)
        for obj in pdbs:
            assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
        prefill = deps["llama-prefill"].spec.template.spec.containers[0]
        assert prefill.args[:2] == ["--model", "meta-llama/Llama-3.1-8B-Instruct"] and "prefill" in prefill.args
        assert prefill.resources.limits == {"nvidia.com/gpu": "1"}
        # no pod is ready yet (nothing plays the kubelet so far)
        wait_for(lambda: api.condition("llama", "Progressing").get("reason") == "RollingOut", what="Progressing")
        assert api.condition("llama", "Ready")["status"] == "False"

        # pods become ready -> Ready, counts and endpoint in status
        became(api, kubelet, "llama", "Ready", "True")
        became(api, kubelet, "llama", "Progressing", "False", "RolloutComplete")
        st = api.get("llama")["status"]
        assert (st["prefill"]["ready"], st["decode"]["ready"], st["router"]["ready"]) == ("2/2", "1/1", "1/1")
        assert st["endpoint"] == f"http://llama-router.{namespace}.svc:80"
        assert st["observedGeneration"] == api.get("llama")["metadata"]["generation"]
        revision = st["revision"]
        print_table(k8s_cluster, namespace, capsys)

        # scale -> the Deployment follows, status tracks
        api.patch("llama", {"decode": {"replicas": 2}})
        wait_for(lambda: api.deployments("llama")["llama-decode"].spec.replicas == 2, what="decode scaled to 2")
        became(api, kubelet, "llama", "Ready", "True")
        wait_for(lambda: api.get("llama")["status"]["decode"]["ready"] == "2/2", what="decode 2/2 in status")
        # scaling up is an expected transition: news, not a warning
        assert ("Normal", "ReplicasNotReady") in api.events("llama")
        assert ("Warning", "ReplicasNotReady") not in api.events("llama")
        assert api.get("llama")["status"]["revision"] == revision  # scaling is not a new revision

        # edit what the KV layout depends on -> new revision rolls out, Progressing until ready
        api.patch("llama", {"image": "reg/pdserve:2"})
        wait_for(lambda: api.get("llama")["status"]["revision"] != revision, what="a new revision in status")
        new_revision = api.get("llama")["status"]["revision"]
        assert api.condition("llama", "Progressing")["status"] == "True"
        became(api, kubelet, "llama", "Progressing", "False", "RolloutComplete")
        for d in api.deployments("llama").values():
            tmpl = d.spec.template
            assert tmpl.spec.containers[0].image == "reg/pdserve:2"
            if tmpl.metadata.labels["pdserve.io/role"] != "router":
                assert tmpl.metadata.labels["pdserve.io/revision"] == new_revision
        ready_pods = [p for p in kubelet.bound_pods(WORKERS) if p.status.phase == "Running"]
        assert {p.metadata.labels["pdserve.io/revision"] for p in ready_pods} == {new_revision}

        # a crash-looping worker -> Degraded with the reason, and a Warning event
        kubelet.crash_loop(kubelet.bound_pods("pdserve.io/role=decode")[0], "CUDA error: out of memory")
        wait_for(lambda: api.condition("llama", "Degraded").get("reason") == "CrashLoopBackOff", what="Degraded")
        assert "CUDA error: out of memory" in api.condition("llama", "Degraded")["message"]
        # Ready follows the Deployment's status, which the controller updates a moment later
        wait_for(lambda: api.condition("llama", "Ready").get("status") == "False", what="Ready=False")
        wait_for(lambda: ("Warning", "CrashLoopBackOff") in api.events("llama"), what="a Warning event")
        assert ("Normal", "Created") in api.events("llama")
        assert ("Normal", "RevisionChanged") in api.events("llama")

        # delete -> the garbage collector removes every child
        api.delete("llama")
        wait_for(lambda: not api.deployments("llama") and not api.services("llama"), what="children garbage-collected")
        wait_for(lambda: not api.rbac.list_namespaced_role(namespace).items, what="Role garbage-collected")


def print_table(k8s_cluster, namespace, capsys):
    """What `kubectl get modelservings` prints: the server's Table for the CRD's columns."""
    table = server_table(k8s_cluster, namespace)
    rows = [[c["name"].upper() for c in table["columnDefinitions"] if c["priority"] == 0]]
    rows += [
        [str(v) for v, c in zip(r["cells"], table["columnDefinitions"]) if c["priority"] == 0] for r in table["rows"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    with capsys.disabled():
        print("\n" + "\n".join("   ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows))
    assert rows[1][1:4] == ["True", "2/2", "1/1"]


def test_restart_converges_without_duplicates(k8s_cluster, operator_kubeconfig, namespace):
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    with operator(operator_kubeconfig, namespace):
        api.create("svc", SPEC)
        wait_for(lambda: len(api.deployments("svc")) == 3 and len(api.services("svc")) == 3, what="children")
        wait_for(lambda: (api.get("svc").get("status") or {}).get("observedGeneration") == 1, what="status written")

    # while the operator is down: the spec changes and a child disappears (as if a reconcile
    # had been cut off half way)
    api.patch("svc", {"decode": {"replicas": 3}})
    # `kubectl get ms` shows the status is stale: it describes an older generation
    (row,) = server_table(k8s_cluster, namespace)["rows"]
    cols = [c["name"] for c in server_table(k8s_cluster, namespace)["columnDefinitions"]]
    cells = dict(zip(cols, row["cells"]))
    assert cells["Generation"] == api.get("svc")["metadata"]["generation"] and cells["Observed"] < cells["Generation"]
    Kube(k8s_cluster.api_client).delete("v1", "Service", namespace, "svc-router")
    Kube(k8s_cluster.api_client).delete("apps/v1", "Deployment", namespace, "svc-prefill")

    with operator(operator_kubeconfig, namespace):
        wait_for(lambda: "svc-router" in api.services("svc") and "svc-prefill" in api.deployments("svc"),
                 what="deleted children recreated")
        wait_for(lambda: api.deployments("svc")["svc-decode"].spec.replicas == 3, what="decode scaled while down")
        became(api, kubelet, "svc", "Ready", "True")
    assert len(api.deployments("svc")) == 3 and len(api.services("svc")) == 3
    accounts = api.core.list_namespaced_service_account(namespace, label_selector="pdserve.io/modelserving=svc").items
    assert sorted(a.metadata.name for a in accounts) == ["svc-router", "svc-worker"]
    assert api.get("svc")["status"]["decode"]["ready"] == "3/3"
    assert api.get("svc")["status"]["observedGeneration"] == api.get("svc")["metadata"]["generation"]


def test_spec_the_schema_allows_but_operator_refuses(k8s_cluster, operator_kubeconfig, namespace):
    api = Api(k8s_cluster, namespace)
    with operator(operator_kubeconfig, namespace):
        api.create("bad", {**SPEC, "decode": {"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 2}}}})
        wait_for(lambda: api.condition("bad", "Degraded").get("reason") == "InvalidSpec", what="InvalidSpec")
        assert "tensorParallelSize is 4" in api.condition("bad", "Degraded")["message"]
        assert api.deployments("bad") == {}
        wait_for(lambda: ("Warning", "InvalidSpec") in api.events("bad"), what="InvalidSpec event")
        # fixing the spec recovers
        api.patch("bad", {"decode": {"resources": {"limits": {"nvidia.com/gpu": 4}}}})
        wait_for(lambda: len(api.deployments("bad")) == 3, what="children after the fix")
        wait_for(lambda: api.condition("bad", "Degraded").get("reason") != "InvalidSpec", what="InvalidSpec cleared")
        assert api.condition("bad", "Progressing")["reason"] == "RollingOut"


SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "ServiceMonitor",
            "plural": "servicemonitors",
            "singular": "servicemonitor",
            "listKind": "ServiceMonitorList",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


def test_optional_apis_hpa_and_service_monitor(k8s_cluster, operator_kubeconfig, namespace):
    api = Api(k8s_cluster, namespace)
    co, ext = api.co, client.ApiextensionsV1Api(k8s_cluster.api_client)
    kube = Kube(k8s_cluster.api_client)
    hpas = lambda: kube.list("autoscaling/v2beta2", "HorizontalPodAutoscaler", namespace, "pdserve.io/modelserving=opt")  # noqa: E731
    monitors = lambda: co.list_namespaced_custom_object("monitoring.coreos.com", "v1", namespace, "servicemonitors")[
        "items"
    ]  # noqa: E731
    spec = {**SPEC, "monitoring": {"serviceMonitor": True},
            "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 8}},
            "decode": {"replicas": 2}, "prefillDecodeRatio": {"min": 1, "max": 2}}
    with operator(operator_kubeconfig, namespace):
        api.create("opt", spec)
        # the ServiceMonitor CRD is not served yet: no ServiceMonitor, everything else works
        wait_for(lambda: len(api.deployments("opt")) == 3, what="children")
        (hpa,) = wait_for(hpas, what="an HPA (autoscaling/v2beta2 on 1.20)")
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 4)  # 1..2 prefill per decode, 2 decode
        assert hpa["spec"]["scaleTargetRef"]["name"] == "opt-prefill"
        # the HPA owns the replica count: the operator's Deployment leaves it alone
        (ours,) = [m for m in api.deployments("opt")["opt-prefill"].metadata.managed_fields
                   if m.manager == "pdserve-operator"]
        assert "f:replicas" not in ours.fields_v1["f:spec"]

        ext.create_custom_resource_definition(SERVICE_MONITOR_CRD)
        try:
            (sm,) = wait_for(monitors, what="a ServiceMonitor once its CRD is served")
            assert sm["spec"]["selector"] == {"matchLabels": {"pdserve.io/modelserving": "opt"}}
            # worker /metrics is keyed: the worker endpoint carries the generated key's Secret
            assert sm["spec"]["endpoints"][0]["bearerTokenSecret"] == {"name": "opt-worker-api-key", "key": "api-key"}
            assert api.core.read_namespaced_secret("opt-worker-api-key", namespace).data["api-key"]
            api.patch("opt", {"monitoring": {"serviceMonitor": False}, "prefill": {"autoscaling": None}})
            wait_for(lambda: not monitors() and not hpas(), what="ServiceMonitor and HPA pruned")
            wait_for(lambda: ("Normal", "Pruned") in api.events("opt"), what="Pruned event")
        finally:
            ext.delete_custom_resource_definition(SERVICE_MONITOR_CRD["metadata"]["name"])


def test_unschedulable_pods_make_it_degraded(k8s_cluster, operator_kubeconfig, namespace):
    """node-0 has 8 GPUs; a 16-way tensor-parallel decode worker can never be placed, and the
    real scheduler says so on the pod."""
    api, kubelet = Api(k8s_cluster, namespace), Kubelet(k8s_cluster, namespace)
    with operator(operator_kubeconfig, namespace):
        api.create("big", {**SPEC, "decode": {"tensorParallelSize": 16}})
        wait_for(lambda: api.condition("big", "Degraded").get("reason") == "Unschedulable", what="Unschedulable")
        message = api.condition("big", "Degraded")["message"]
        assert "pod big-decode-" in message and "Insufficient nvidia.com/gpu" in message
        wait_for(lambda: ("Warning", "Unschedulable") in api.events("big"), what="Unschedulable event")
        # shrinking the request lets the new pod schedule; once it is ready the rollout removes
        # the pending old one and Degraded clears
        api.patch("big", {"decode": {"tensorParallelSize": 2}})
        became(api, kubelet, "big", "Degraded", "False")
        became(api, kubelet, "big", "Ready", "True")


def test_pdserve_operator_command(k8s_cluster, operator_kubeconfig, namespace, tmp_path):
    """The real `pdserve operator` process (what the chart's Deployment runs), stopped by SIGTERM."""
    import os
    import signal
    import subprocess
    import sys

    api = Api(k8s_cluster, namespace)
    env = {**os.environ, "KUBECONFIG": str(operator_kubeconfig), "PDSERVE_OPERATOR_RESYNC_SECONDS": "1"}
    # Its log goes to a file: a pipe nobody reads until the end would stall a chatty operator
    # once the pipe's buffer (64 KiB) is full.
    log = tmp_path / "operator.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli.main", "operator", "--namespace", namespace],
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            api.create("cli", SPEC)
            wait_for(lambda: len(api.deployments("cli")) == 3, what="children from the pdserve operator process")
            wait_for(lambda: api.condition("cli", "Progressing").get("status") == "True", what="status written")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()[-3000:]


def test_lora_adapters_change_without_a_rollout(k8s_cluster, operator_kubeconfig, namespace):
    """spec.lora puts --enable-lora on both roles; editing the adapter list leaves the
    Deployments' templates alone (their generation does not move) and the timer reports
    status.lora (no pod is ready here, so nothing is loaded)."""
    api = Api(k8s_cluster, namespace)
    adapters = [{"name": "sql", "source": "pvc://adapters/sql"}]
    with operator(operator_kubeconfig, namespace):
        api.create("lora", {**SPEC, "lora": {"adapters": adapters}})
        wait_for(lambda: len(api.deployments("lora")) == 3, what="children")
        workers = {n: d for n, d in api.deployments("lora").items() if not n.endswith("-router")}
        for d in workers.values():
            assert "--enable-lora" in d.spec.template.spec.containers[0].args
        generations = {n: d.metadata.generation for n, d in workers.items()}
        added = [*adapters, {"name": "chat", "source": "hf://org/chat-lora"}]
        api.patch("lora", {"lora": {"adapters": added}})
        wait_for(lambda: (api.get("lora").get("status") or {}).get("observedGeneration") == 2, what="reconciled")
        wait_for(lambda: [a["name"] for a in (api.get("lora")["status"].get("lora") or {}).get("adapters", [])]
                 == ["sql", "chat"], what="status.lora")
        assert api.get("lora")["status"]["lora"]["workers"] == 0
        assert {n: d.metadata.generation for n, d in api.deployments("lora").items() if n in workers} == generations
