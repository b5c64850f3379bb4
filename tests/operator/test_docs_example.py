"""docs/operator.md's ModelServing examples work as written: the operator builds every child
from them, and a real Kubernetes 1.20 API server accepts them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from pdserve.operator.children import build_children
from pdserve.operator.optional import ApiVersions
from pdserve.operator.spec import ModelServing

DOC = Path(__file__).resolve().parents[2] / "docs" / "operator.md"


def examples() -> list[dict]:
    """Every ModelServing in the page: YAML blocks, and the heredoc of the quick start."""
    text = DOC.read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S) + re.findall(r"<<'EOF'\n(.*?)EOF", text, re.S)
    docs = [yaml.safe_load(b) for b in blocks]
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "ModelServing"]


def test_the_page_has_the_examples():
    names = {d["metadata"]["name"] for d in examples()}
    assert names == {"llama", "qwen"}


def test_spec_fields_table_names_every_field():
    """Every property of the CRD's spec schema is named in the page's "Spec fields" section."""
    from tests.operator.test_crd import schema

    section = DOC.read_text().split("## Spec fields")[1].split("\n## ")[0]
    names: set[str] = set()

    def walk(s):
        for key, sub in (s.get("properties") or {}).items():
            names.add(key)
            if key != "podTemplate":  # free-form: a pod template's own fields
                walk(sub.get("items", sub))
    walk(schema()["properties"]["spec"])
    missing = sorted(n for n in names if not re.search(rf"\b{re.escape(n)}\b", section))
    assert not missing, f"docs/operator.md's Spec fields section does not mention {missing}"


@pytest.mark.parametrize("name", ["llama", "qwen"])
def test_examples_build(name):
    (doc,) = [d for d in examples() if d["metadata"]["name"] == name]
    ms = ModelServing.from_body({**doc, "metadata": {**doc["metadata"], "namespace": "default", "uid": "u"}})
    children = build_children(ms, ApiVersions("autoscaling/v2", "policy/v1", "monitoring.coreos.com/v1"), {})
    assert {c["kind"] for c in children} >= {"Deployment", "Service", "ServiceAccount"}


@pytest.mark.k8s
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_examples_accepted_by_the_api_server(k8s_cluster, crd, namespace):
    co = client.CustomObjectsApi(k8s_cluster.api_client)
    for doc in examples():
        created = co.create_namespaced_custom_object("pdserve.io", "v1alpha1", namespace, "modelservings", doc)
        assert created["spec"]["model"] == {**doc["spec"]["model"], **created["spec"]["model"]}
