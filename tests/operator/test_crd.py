"""The CRD file itself: structural-schema rules for Kubernetes 1.20, and defaults that agree
with the operator's spec model (the server defaults a stored object; the builders default a
hand-written dict; both must give the same children)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pdserve.operator.children import build_children
from pdserve.operator.optional import ApiVersions
from pdserve.operator.spec import ModelServing, ModelServingSpec

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "modelservings.pdserve.io.yaml"


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def schema() -> dict[str, Any]:
    (version,) = load_crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def apply_defaults(value: Any, s: dict[str, Any]) -> Any:
    """What the API server's structural defaulting does, for the subset of schema we use."""
    if s.get("type") == "object" and isinstance(value, dict):
        out = dict(value)
        for key, sub in (s.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = sub["default"]
            if key in out:
                out[key] = apply_defaults(out[key], sub)
        return out
    if s.get("type") == "array" and isinstance(value, list):
        return [apply_defaults(v, s.get("items") or {}) for v in value]
    return value


def walk(s: dict[str, Any], path: str = ""):
    yield path, s
    for key, sub in (s.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if "items" in s:
        yield from walk(s["items"], f"{path}[]")


def test_no_cel_and_every_node_typed():
    text = CRD_PATH.read_text()
    assert "x-kubernetes-validations" not in text  # CEL does not exist on 1.20
    for path, node in walk(schema()):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"untyped schema node {path}"


def test_printer_columns_and_subresource():
    (version,) = load_crd()["spec"]["versions"]
    assert version["subresources"]["status"] == {}
    # `kubectl scale ms` sizes decode; its selector is in the status the operator writes
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.decode.replicas",
                                                "statusReplicasPath": ".status.decode.replicas",
                                                "labelSelectorPath": ".status.decode.selector"}
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    assert cols[:4] == ["Ready", "Prefill", "Decode", "Endpoint"] and cols[-1] == "Age"
    assert {"Generation", "Observed"} <= set(cols)  # a stale status is visible
    assert "ms" in load_crd()["spec"]["names"]["shortNames"]


SPECS = [
    {"model": {"source": "hf://m/x"}, "image": "img"},
    {
        "model": {"source": "pvc://c/p", "hfTokenSecret": {"name": "hf"}},
        "image": "img",
        "device": "cpu",
        "prefill": {"autoscaling": {"maxReplicas": 3}},
        "decode": {"tensorParallelSize": 2},
        "router": {"apiKeySecret": {"name": "k"}, "service": {"type": "NodePort"}},
        "workerApiKeySecret": {"name": "wk"},
        "monitoring": {"serviceMonitor": True},
        "tracing": {"endpoint": "http://jaeger:4317"},
    },
    {
        "model": {"source": "hf://m/x@v1.0", "cache": {"sizeLimit": "50Gi"}},
        "kvTransfer": {"rdma": {"resource": "rdma/ib"}},
        "decode": {"kvTransfer": {"rdma": {"resource": "rdma/hca"}}, "rollout": {"maxSurge": 1}},
        "router": {"policy": "prefix-aware"},
        "drain": {"timeoutSeconds": 60},
    },
]


def test_policy_enum_is_the_routers_registry():
    """A policy the router does not know is refused by the API server, not by a crash-looping
    router pod."""
    from pdserve.operator.spec import POLICIES
    from pdserve.router.policies import available  # the router's registry (no plugins installed here)

    router = schema()["properties"]["spec"]["properties"]["router"]["properties"]
    for field in ("policy", "prefillPolicy", "decodePolicy"):
        assert router[field]["enum"] == list(POLICIES)
    assert sorted(POLICIES) == available()


def test_kv_cache_dtype_enum_is_the_workers():
    """Every kvCacheDtype the API server admits is a --kv-cache-dtype the worker takes."""
    from pdserve.worker.config.engine import KV_CACHE_DTYPES

    spec = schema()["properties"]["spec"]["properties"]
    assert set(spec["kvCacheDtype"]["enum"]) <= set(KV_CACHE_DTYPES) and spec["kvCacheDtype"]["default"] == "auto"
    assert spec["model"]["properties"]["quantization"]["enum"] == ["none", "fp8"]


def test_operator_defaults_match_schema_defaults():
    spec_schema = schema()["properties"]["spec"]
    apis = ApiVersions("autoscaling/v2beta2", "policy/v1beta1", "monitoring.coreos.com/v1")
    for raw in SPECS:
        defaulted = apply_defaults(raw, spec_schema)
        assert defaulted != raw  # the schema did fill something in
        a, b = (ModelServing("x", "ns", "u", ModelServingSpec.from_dict(s)) for s in (raw, defaulted))
        assert a == b
        assert build_children(a, apis, {}) == build_children(b, apis, {})


def test_tracing_protocols_are_the_exporters():
    from pdserve.protocol.tracing import PROTOCOLS

    tracing = schema()["properties"]["spec"]["properties"]["tracing"]
    assert set(tracing["properties"]["protocol"]["enum"]) == set(PROTOCOLS)
