"""charts/pdserve rendered by Helm 4 and Helm 3 (no cluster): lint, what each template makes,
values.schema.json refusing bad values, and the copies charts/sync.py keeps in step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from pdserve.operator.rbac import build_operator_cluster_role
from tests.charts.conftest import CHART, ROOT

APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def run(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "KUBECONFIG": "/nonexistent"})


def render(helm: str, *sets: str, api_versions: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", "rel", str(CHART), "-n", "pd"]
    for s in sets:
        args += ["--set", s]
    for v in api_versions:
        args += ["--api-versions", v]
    out = run(helm, *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


def test_lint(helm):
    out = run(helm, "lint", str(CHART), "--strict")
    assert out.returncode == 0, out.stdout + out.stderr


def test_copies_are_in_sync_with_their_sources():
    out = subprocess.run([sys.executable, str(ROOT / "charts" / "sync.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (CHART / "crds" / "modelservings.pdserve.io.yaml").read_bytes() == \
        (ROOT / "crds" / "modelservings.pdserve.io.yaml").read_bytes()


def test_cluster_role_is_the_operators_own_builder(helm):
    docs = render(helm)
    role = one(docs, "ClusterRole")
    assert role["rules"] == build_operator_cluster_role()["rules"]
    binding = one(docs, "ClusterRoleBinding")
    sa = one(docs, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "pd"}]


def test_watched_namespaces_bind_the_role_only_there(helm):
    docs = render(helm, "operator.watchNamespaces={a,b}")
    full = build_operator_cluster_role()["rules"]
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    assert roles["rel-operator"]["rules"] == full
    assert all(rule in full for rule in roles["rel-operator-cluster-reader"]["rules"])  # a subset, cluster-scoped
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["a", "b"]
    assert {b["roleRef"]["name"] for b in bindings} == {"rel-operator"}
    assert [d["roleRef"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding"] == ["rel-operator-cluster-reader"]


def test_operator_deployment(helm):
    docs = render(helm)
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert dep["spec"]["replicas"] == 1  # kopf runs standalone: never two operators
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert c["image"] == f"ghcr.io/pdserve/pdserve:{APP_VERSION}"
    assert c["command"] == ["pdserve", "operator"]
    assert "--all-namespaces" in c["args"]
    assert {"name": "PDSERVE_OPERATOR_DEFAULT_IMAGE", "value": c["image"]} in c["env"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # ...so /tmp is a volume: the Kubernetes client's discovery cache writes there (without it the
    # operator crashed at start in its container, found by the containerized e2e)
    tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
    assert next(v for v in pod["volumes"] if v["name"] == tmp["name"])["emptyDir"] == {}


def test_image_and_namespaces_from_values(helm):
    c = one(render(helm, "image.repository=reg.example/pd", "image.tag=9.9",
                   "operator.watchNamespaces={a,b}"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "reg.example/pd:9.9"
    assert {"name": "PDSERVE_OPERATOR_DEFAULT_IMAGE", "value": "reg.example/pd:9.9"} in c["env"]
    assert c["args"][:2] == ["--namespace=a", "--namespace=b"] and "--all-namespaces" not in c["args"]


def test_one_configmap_per_dashboard_for_the_grafana_sidecar(helm):
    maps = [d for d in render(helm) if d["kind"] == "ConfigMap"]
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert len(files) == 4 and sorted(k for m in maps for k in m["data"]) == files
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        (name, text), = m["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / name).read_text())
    assert not [d for d in render(helm, "dashboards.enabled=false") if d["kind"] == "ConfigMap"]


def test_monitors_need_the_prometheus_operator_api(helm):
    out = run(helm, "template", "rel", str(CHART), "--set", "monitoring.podMonitor.enabled=true")
    assert out.returncode != 0 and "monitoring.coreos.com/v1" in out.stderr
    docs = render(helm, "monitoring.podMonitor.enabled=true", "monitoring.serviceMonitor.enabled=true",
                  api_versions=("monitoring.coreos.com/v1",))
    pm, sm = one(docs, "PodMonitor"), one(docs, "ServiceMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "pdserve-operator"}
    targets = {r["targetLabel"] for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    assert {"role", "modelserving", "namespace", "pod"} <= targets  # what the dashboards filter and group on
    assert sm["spec"]["endpoints"][0]["port"] == "http"
    assert not [d for d in render(helm) if d["kind"] in ("PodMonitor", "ServiceMonitor")]


def test_optional_modelserving(helm):
    assert not [d for d in render(helm) if d["kind"] == "ModelServing"]
    ms = one(render(helm, "modelServing.enabled=true", "modelServing.spec.decode.replicas=3"), "ModelServing")
    assert ms["metadata"]["name"] == "rel" and ms["spec"]["decode"] == {"replicas": 3}
    assert ms["spec"]["model"]["source"].startswith("hf://")


@pytest.mark.parametrize("bad, words", [
    ("operator.resyncSeconds=0", ["resyncSeconds"]),
    ("image.pullPolicy=Sometimes", ["pullPolicy"]),
    ("operatr.verbose=true", ["operatr"]),
    ("operator.watchNamespaces={Bad_NS}", ["watchNamespaces"]),
    ("monitoring.podMonitor.interval=soon", ["interval"]),
    ("monitoring.workerApiKeySecret.name=Not_A_Name", ["workerApiKeySecret", "name"]),
])
def test_schema_refuses_bad_values(helm, bad, words):
    out = run(helm, "template", "rel", str(CHART), "--set", bad)
    assert out.returncode != 0
    for w in words:
        assert w in out.stderr, out.stderr


def test_notes_say_how_to_reach_router_and_dashboards():
    """NOTES.txt renders only on install; Helm 4's client-side dry run needs no cluster."""
    from tests.charts.conftest import _fetch
    from tests.k8s_cluster import SHARED_K8S

    helm4 = _fetch(SHARED_K8S / "get-tools.sh", "helm")
    out = run(helm4, "install", "rel", str(CHART), "-n", "pd", "--dry-run=client")
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/NAME-router" in notes and "grafana_dashboard=1" in notes



def test_monitors_send_the_worker_api_key_when_named(helm):
    """Workers serve /metrics only with their API key: the chart's monitors carry it from the
    Secret named in monitoring.workerApiKeySecret, and nothing when it is unset."""
    on = ("monitoring.podMonitor.enabled=true", "monitoring.serviceMonitor.enabled=true")
    api = ("monitoring.coreos.com/v1",)
    docs = render(helm, *on, api_versions=api)
    assert "bearerTokenSecret" not in one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert "bearerTokenSecret" not in one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    docs = render(helm, *on, "monitoring.workerApiKeySecret.name=scrape-key", api_versions=api)
    for endpoint in (
        one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0],
        one(docs, "ServiceMonitor")["spec"]["endpoints"][0],
    ):
        assert endpoint["bearerTokenSecret"] == {"name": "scrape-key", "key": "api-key"}
        assert endpoint["relabelings"]  # still there after the token


def test_the_operators_service_monitor_relabels_as_the_charts_monitors_do(helm):
    """The dashboards filter on role, modelserving, revision, namespace and pod: a ModelServing's
    own ServiceMonitor (spec.monitoring.serviceMonitor) gives its series the same labels."""
    from pdserve.operator.optional import build_service_monitor
    from pdserve.operator.spec import ModelServing, ModelServingSpec

    chart = one(render(helm, "monitoring.podMonitor.enabled=true", api_versions=("monitoring.coreos.com/v1",)),
                "PodMonitor")["spec"]["podMetricsEndpoints"][0]["relabelings"]
    m = ModelServing("llama", "ns", "u", ModelServingSpec.from_dict({"model": {"source": "hf://m/x"}, "image": "i"}))
    endpoints = build_service_monitor(m)["spec"]["endpoints"]
    assert len(endpoints) == 2
    for endpoint in endpoints:
        assert endpoint["relabelings"][0]["action"] == "keep"  # its role filter, then the chart's labels
        assert endpoint["relabelings"][1:] == chart
