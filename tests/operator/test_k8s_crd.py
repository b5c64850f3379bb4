"""The CRD on a real Kubernetes 1.20 API server: accepted, defaulted, and bad specs rejected by
the server itself with messages that name the field."""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from pdserve.operator.kube import Kube

pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

GOOD = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "image": "reg/pdserve:1"}


def create(k8s_cluster, namespace, spec, name="m"):
    return client.CustomObjectsApi(k8s_cluster.api_client).create_namespaced_custom_object(
        "pdserve.io", "v1alpha1", namespace, "modelservings",
        {"apiVersion": "pdserve.io/v1alpha1", "kind": "ModelServing", "metadata": {"name": name}, "spec": spec})


def test_minimal_spec_is_accepted_and_defaulted(k8s_cluster, crd, namespace):
    obj = create(k8s_cluster, namespace, GOOD)
    spec = obj["spec"]
    assert spec["prefill"] == {"replicas": 1, "tensorParallelSize": 1}
    assert spec["decode"] == {"replicas": 1, "tensorParallelSize": 1}
    assert spec["router"] == {"replicas": 1, "service": {"type": "ClusterIP", "port": 80}}
    assert spec["kvTransfer"] == {"backend": "nixl", "port": 5600}
    assert spec["model"]["dtype"] == "auto" and spec["device"] == "cuda" and spec["imagePullPolicy"] == "IfNotPresent"
    assert spec["monitoring"] == {"serviceMonitor": False}
    assert spec["networkPolicy"] == {"enabled": True}  # secure by default


def test_full_spec_round_trips(k8s_cluster, crd, namespace):
    spec = {
        **GOOD,
        "model": {
            "source": "pvc://models/llama",
            "servedName": "llama",
            "dtype": "bfloat16",
            "maxModelLen": 8192,
            "hfTokenSecret": {"name": "hf"},
            "quantization": "fp8",
        },
        "kvCacheDtype": "fp8",
        "imagePullSecrets": [{"name": "regcred"}],
        "prefill": {
            "replicas": 2,
            "tensorParallelSize": 2,
            "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "80Gi"}},
            "args": ["--block-size", "32"],
            "env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"podAntiAffinity": {}},
            "autoscaling": {"maxReplicas": 4},
        },
        "router": {
            "policy": "prefix-aware",
            "apiKeySecret": {"name": "keys"},
            "pdMinPromptTokens": 32,
            "rollout": {"maxSurge": "25%"},
            "probes": {"readiness": {"timeoutSeconds": 3}},
        },
        "decode": {
            "rollout": {"maxSurge": 0, "maxUnavailable": 1},
            "shmSize": "16Gi",
            "kvTransfer": {"ucxNetDevices": "mlx5_0:1", "rdma": {"resource": "rdma/hca"}},
            "podTemplate": {
                "metadata": {"annotations": {"k8s.v1.cni.cncf.io/networks": "rdma"}},
                "spec": {"containers": [{"name": "sidecar", "image": "busybox"}]},
            },
        },
        "kvTransfer": {"ucxTls": "rc,cuda_copy"},
        "drain": {"timeoutSeconds": 60, "preStopSeconds": 3},
        "prefillDecodeRatio": {"min": 0.5, "max": 2},
    }
    obj = create(k8s_cluster, namespace, spec)
    assert obj["spec"]["prefill"]["env"] == spec["prefill"]["env"]  # preserved, not pruned
    assert obj["spec"]["prefill"]["autoscaling"] == {"maxReplicas": 4, "minReplicas": 1,
                                                      "metric": "vllm:num_requests_waiting", "targetAverageValue": "4"}
    assert obj["spec"]["router"]["apiKeySecret"] == {"name": "keys", "key": "api-keys"}
    # free-form pod overrides are kept as written; the RDMA count is defaulted
    assert obj["spec"]["decode"]["podTemplate"] == spec["decode"]["podTemplate"]
    assert obj["spec"]["decode"]["kvTransfer"]["rdma"] == {"resource": "rdma/hca", "count": 1}
    assert obj["spec"]["router"]["rollout"] == {"maxSurge": "25%"} and obj["spec"]["drain"] == spec["drain"]


def test_lora_adapters_are_accepted_and_defaulted(k8s_cluster, crd, namespace):
    adapters = [{"name": "sql", "source": "pvc://adapters/sql"}, {"name": "chat", "source": "hf://org/chat-lora"},
                {"name": "local", "source": "/opt/adapters/x"}]
    obj = create(k8s_cluster, namespace, {**GOOD, "lora": {"adapters": adapters}})
    assert obj["spec"]["lora"] == {"adapters": adapters, "maxLoras": 4, "maxLoraRank": 16}


@pytest.mark.parametrize("source", ["hf://org/model@main", "hf://org/model@0123abcd", "hf://org/model@refs/pr/1"])
def test_pinned_hub_revisions_are_accepted(k8s_cluster, crd, namespace, source):
    spec = {**GOOD, "model": {"source": source, "cache": {"sizeLimit": "100Gi"}}}
    assert create(k8s_cluster, namespace, spec)["spec"]["model"]["source"] == source


@pytest.mark.parametrize(
    "spec, expect",
    [
        ({"image": "x"}, ["spec.model", "Required value"]),
        ({**GOOD, "model": {"source": "s3://bucket/model"}}, ["spec.model.source", "should match"]),
        ({**GOOD, "model": {"source": "hf://org/model@"}}, ["spec.model.source", "should match"]),
        # a policy the router does not have never reaches a router pod
        ({**GOOD, "router": {"policy": "kv-aware"}}, ["spec.router.policy", "Unsupported value", "prefix-aware"]),
        ({**GOOD, "router": {"decodePolicy": "random"}}, ["spec.router.decodePolicy", "Unsupported value"]),
        ({**GOOD, "drain": {"timeoutSeconds": -1}}, ["spec.drain.timeoutSeconds", "greater than or equal to 0"]),
        (
            {**GOOD, "decode": {"probes": {"readiness": {"timeoutSeconds": 0}}}},
            ["spec.decode.probes.readiness.timeoutSeconds", "greater than or equal to 1"],
        ),
        ({**GOOD, "model": {**GOOD["model"], "dtype": "int4"}}, ["spec.model.dtype", "Unsupported value", "bfloat16"]),
        (
            {**GOOD, "model": {**GOOD["model"], "quantization": "int4"}},
            ["spec.model.quantization", "Unsupported value", "fp8"],
        ),
        ({**GOOD, "kvCacheDtype": "fp8_e5m2"}, ["spec.kvCacheDtype", "Unsupported value", "fp8"]),
        ({**GOOD, "prefill": {"replicas": -1}}, ["spec.prefill.replicas", "greater than or equal to 0"]),
        (
            {**GOOD, "decode": {"tensorParallelSize": 0}},
            ["spec.decode.tensorParallelSize", "greater than or equal to 1"],
        ),
        ({**GOOD, "kvTransfer": {"backend": "rdma"}}, ["spec.kvTransfer.backend", "Unsupported value", "nixl"]),
        ({**GOOD, "router": {"service": {"port": 70000}}}, ["spec.router.service.port", "less than or equal to 65535"]),
        ({**GOOD, "router": {"service": {"type": "ExternalName"}}}, ["spec.router.service.type", "Unsupported value"]),
        (
            {**GOOD, "prefill": {"autoscaling": {"minReplicas": 2}}},
            ["spec.prefill.autoscaling.maxReplicas", "Required value"],
        ),
        ({**GOOD, "decode": {"replicas": "two"}}, ["spec.decode.replicas", "integer"]),
        ({**GOOD, "lora": {"adapters": [{"name": "a", "source": "s3://b/a"}]}},
         ["spec.lora.adapters.source", "should match"]),
        ({**GOOD, "lora": {"adapters": [{"name": "a b", "source": "/a"}]}},
         ["spec.lora.adapters.name", "should match"]),
    ],
)
def test_invalid_specs_are_rejected_by_the_server(k8s_cluster, crd, namespace, spec, expect):
    with pytest.raises(ApiException) as e:
        create(k8s_cluster, namespace, spec)
    assert e.value.status == 422
    message = json.loads(e.value.body)["message"]
    for text in expect:
        assert text in message, message


def server_table(k8s_cluster, namespace) -> dict:
    """What `kubectl get modelservings` shows: the server's Table for the CRD's columns."""
    return Kube(k8s_cluster.api_client).dyn.request(
        "GET", f"/apis/pdserve.io/v1alpha1/namespaces/{namespace}/modelservings",
        header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}).to_dict()


def test_printer_columns_served(k8s_cluster, crd, namespace):
    create(k8s_cluster, namespace, GOOD, name="llama")
    table = server_table(k8s_cluster, namespace)
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names == ["Name", "Ready", "Prefill", "Decode", "Endpoint", "Generation", "Observed", "Revision", "Age"]
    assert table["rows"][0]["cells"][0] == "llama"
