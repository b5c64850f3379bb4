"""Every manifest the chart renders, checked by a real Kubernetes 1.20 API server
(`kubectl apply --dry-run=server`): API versions it serves, object schemas, RBAC objects, and
the optional ModelServing against the CRD's own validation. The full install is e2e/test_k8s_stack.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.charts.conftest import CHART, _fetch
from tests.k8s_cluster import SHARED_K8S, k8s_cluster  # noqa: F401  (session fixture)

pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]


@pytest.fixture(scope="module")
def env(k8s_cluster):  # noqa: F811
    tools = os.path.dirname(_fetch(SHARED_K8S / "get-tools.sh", "helm"))
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "KUBECONFIG": str(k8s_cluster.kubeconfig)}
    crds = subprocess.run(["kubectl", "apply", "-f", str(CHART / "crds")], env=env, capture_output=True, text=True)
    assert crds.returncode == 0, crds.stderr
    return env


def server_dry_run(env: dict, ns: str, *sets: str) -> subprocess.CompletedProcess:
    args = ["helm", "template", "rel", str(CHART), "-n", ns]
    for s in sets:
        args += ["--set", s]
    rendered = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    return subprocess.run(["kubectl", "apply", "--dry-run=server", "-f", "-"], input=rendered, env=env,
                          capture_output=True, text=True)


def test_the_api_server_accepts_every_manifest(k8s_cluster, env):  # noqa: F811
    ns = k8s_cluster.create_namespace("chart")
    try:
        out = server_dry_run(env, ns, "modelServing.enabled=true", f"operator.watchNamespaces={{{ns}}}")
        assert out.returncode == 0, out.stderr
        for obj in (
            "deployment.apps/rel-operator",
            "serviceaccount/rel-operator",
            "clusterrole.rbac.authorization.k8s.io/rel-operator",
            "rolebinding.rbac.authorization.k8s.io/rel-operator",
            "configmap/rel-dashboard-workers",
            "modelserving.pdserve.io/rel",
        ):
            assert f"{obj} created (server dry run)" in out.stdout, out.stdout
    finally:
        k8s_cluster.delete_namespace(ns)


def test_a_bad_modelserving_from_values_is_refused_by_the_crd(k8s_cluster, env):  # noqa: F811
    ns = k8s_cluster.create_namespace("chart")
    try:
        out = server_dry_run(env, ns, "modelServing.enabled=true", "modelServing.spec.decode.replicas=-1")
        assert out.returncode != 0
        assert "spec.decode.replicas" in out.stderr and "greater than or equal to 0" in out.stderr, out.stderr
    finally:
        k8s_cluster.delete_namespace(ns)
