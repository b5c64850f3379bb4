"""Fixtures for the real-server operator tests: the CRD installed, and a kubeconfig that holds
only the operator's own minimal RBAC (so every operator test also proves that RBAC suffices)."""

from __future__ import annotations

from pathlib import Path

from kubernetes.client.rest import ApiException

import pytest
import yaml

from pdserve.operator.rbac import build_operator_cluster_role
from tests.k8s_cluster import Cluster, k8s_cluster, wait_for  # noqa: F401  (fixture re-export)

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "modelservings.pdserve.io.yaml"
# Distinct from what the chart installs (pdserve-operator), which may share this cluster.
OPERATOR_NS = "pdserve-operator-test"
OPERATOR_SA = "pdserve-operator-test"


@pytest.fixture(scope="session")
def crd(k8s_cluster: Cluster) -> dict:
    from kubernetes import client

    ext = client.ApiextensionsV1Api(k8s_cluster.api_client)
    body = yaml.safe_load(CRD_PATH.read_text())
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as e:
        if e.status != 409:  # another area of the session (the chart's tests) may have installed it
            raise

    def established():
        got = ext.read_custom_resource_definition(body["metadata"]["name"])
        return any(c.type == "Established" and c.status == "True" for c in got.status.conditions or ())

    wait_for(established, timeout=30, what="the ModelServing CRD to be established")
    return body


@pytest.fixture(scope="session")
def operator_kubeconfig(k8s_cluster: Cluster, crd, tmp_path_factory) -> Path:
    """A kubeconfig for a ServiceAccount bound to
    build_operator_cluster_role(), with a token from the TokenRequest API."""
    from kubernetes import client

    core, rbac = k8s_cluster.core(), client.RbacAuthorizationV1Api(k8s_cluster.api_client)
    core.create_namespace({"metadata": {"name": OPERATOR_NS}})
    core.create_namespaced_service_account(OPERATOR_NS, {"metadata": {"name": OPERATOR_SA}})
    rbac.create_cluster_role(build_operator_cluster_role(OPERATOR_SA))
    rbac.create_cluster_role_binding({
        "metadata": {"name": OPERATOR_SA},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPERATOR_SA},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NS}]})
    token = core.create_namespaced_service_account_token(
        OPERATOR_SA, OPERATOR_NS, {"spec": {"expirationSeconds": 24 * 3600}}).status.token
    admin = yaml.safe_load(k8s_cluster.kubeconfig.read_text())
    admin["users"] = [{"name": "admin", "user": {"token": token}}]
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    path.write_text(yaml.safe_dump(admin))
    return path


@pytest.fixture
def namespace(k8s_cluster: Cluster):
    name = k8s_cluster.create_namespace("ms")
    yield name
    k8s_cluster.delete_namespace(name)
