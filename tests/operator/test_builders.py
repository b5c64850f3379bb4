"""Child manifests from the pure builders, checked without a cluster."""

from __future__ import annotations

import pytest

from pdserve.operator import naming
from pdserve.operator.children import autoscaler_bounds, build_children
from pdserve.operator.optional import ApiVersions, hpa_bounds
from pdserve.operator.spec import Autoscaling, ModelServing, ModelServingSpec, SpecError
from pdserve.operator.workloads import build_router_deployment, build_worker_deployment

BASE = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "image": "reg/pdserve:1"}
ALL_APIS = ApiVersions("autoscaling/v2", "policy/v1", "monitoring.coreos.com/v1")


def ms(**spec) -> ModelServing:
    return ModelServing("llama", "ns1", "uid-1", ModelServingSpec.from_dict({**BASE, **spec}))


def container(dep):
    return dep["spec"]["template"]["spec"]["containers"][0]


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("spec, role, expect", [
    # defaults: HF id passed as is, cuda, one GPU, nixl, served name from the id
    ({}, "prefill", {"--model": "meta-llama/Llama-3.1-8B-Instruct", "--role": "prefill", "--device": "cuda",
                     "--kv-transfer": "nixl", "--kv-port": "5600", "--tensor-parallel-size": "1",
                     "--served-model-name": "meta-llama/Llama-3.1-8B-Instruct", "--dtype": "auto",
                     "--max-model-len": None}),
    ({"model": {"source": "pvc://models/llama/8b", "servedName": "llama", "dtype": "bfloat16", "maxModelLen": 8192}},
     "decode", {"--model": "/models/llama/8b", "--served-model-name": "llama", "--dtype": "bfloat16",
                "--max-model-len": "8192", "--role": "decode"}),
    ({"model": {"source": "/opt/model"}, "device": "cpu", "kvTransfer": {"backend": "tcp", "port": 7000}},
     "decode", {"--model": "/opt/model", "--device": "cpu", "--kv-transfer": "tcp", "--kv-port": "7000"}),
    ({"decode": {"tensorParallelSize": 4, "maxNumSeqs": 64, "args": ["--block-size", "32"]}},
     "decode", {"--tensor-parallel-size": "4", "--max-num-seqs": "64", "--block-size": "32"}),
    # KV events only when a KV-cache-aware policy will consume them
    ({}, "decode", {"--kv-events-port": None}),
    ({"router": {"policy": "prefix-aware"}}, "decode", {"--kv-events-port": "5557"}),
    ({"router": {"prefillPolicy": "prefix-aware"}}, "prefill", {"--kv-events-port": "5557"}),
    # FP8: weights quantized at load, and the KV cache dtype (both roles alike); defaults pass nothing
    ({}, "prefill", {"--quantization": None, "--kv-cache-dtype": None}),
    ({"model": {**BASE["model"], "quantization": "none"}, "kvCacheDtype": "auto"}, "decode",
     {"--quantization": None, "--kv-cache-dtype": None}),
    ({"model": {**BASE["model"], "quantization": "fp8"}, "kvCacheDtype": "fp8"}, "prefill",
     {"--quantization": "fp8", "--kv-cache-dtype": "fp8"}),
    ({"kvCacheDtype": "fp8"}, "decode", {"--quantization": None, "--kv-cache-dtype": "fp8"}),
])
def test_worker_args(spec, role, expect):
    c = container(build_worker_deployment(ms(**spec), role))
    assert c["command"] == ["pdserve", "worker"]
    for name, value in expect.items():
        assert flag(c["args"], name) == value, name


@pytest.mark.parametrize(
    "spec, role, gpus",
    [
        ({}, "prefill", "1"),
        ({"prefill": {"tensorParallelSize": 4}}, "prefill", "4"),
        (
            {"decode": {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 8, "memory": "64Gi"}}}},
            "decode",
            "8",
        ),
        ({"device": "cpu", "prefill": {"tensorParallelSize": 2}}, "prefill", None),
    ],
)
def test_gpu_resources(spec, role, gpus):
    res = container(build_worker_deployment(ms(**spec), role)).get("resources", {})
    assert res.get("limits", {}).get("nvidia.com/gpu") == gpus


def test_too_few_gpus_for_tp_is_a_spec_error():
    with pytest.raises(
        SpecError, match=r"spec.decode.resources.limits\[nvidia.com/gpu\] is 1 but tensorParallelSize is 2"
    ):
        ms(decode={"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}})


def test_worker_pod_shape():
    dep = build_worker_deployment(ms(model={"source": "pvc://models/x", "hfTokenSecret": {"name": "hf"}},
                                     imagePullSecrets=[{"name": "regcred"}],
                                     prefill={"replicas": 3, "nodeSelector": {"gpu": "h100"},
                                              "tolerations": [{"key": "gpu", "operator": "Exists"}],
                                              "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}), "prefill")
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert dep["spec"]["replicas"] == 3
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "kv": 5600}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert env["NCCL_DEBUG"]["value"] == "INFO" and "POD_IP" in env
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"][0]["key"] == "gpu"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_labels_owner_and_immutable_selector():
    m = ms()
    dep = build_worker_deployment(m, "decode")
    tmpl = dep["spec"]["template"]["metadata"]["labels"]
    assert tmpl[naming.LABEL_MODELSERVING] == "llama" and tmpl[naming.LABEL_ROLE] == "decode"
    assert tmpl[naming.LABEL_REVISION] == naming.revision(m)
    # the selector must not contain the revision: Deployment selectors are immutable
    assert dep["spec"]["selector"]["matchLabels"] == {naming.LABEL_MODELSERVING: "llama", naming.LABEL_ROLE: "decode"}
    for child in build_children(m, ALL_APIS, {}):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-1" and ref["controller"] is True and ref["kind"] == "ModelServing"
        assert child["metadata"]["namespace"] == "ns1"


@pytest.mark.parametrize("change, same", [
    ({"prefill": {"replicas": 5}}, True),
    ({"decode": {"env": [{"name": "A", "value": "1"}]}}, True),
    ({"router": {"policy": "least-loaded"}}, True),
    ({"image": "reg/pdserve:2"}, False),
    ({"model": {**BASE["model"], "dtype": "float16"}}, False),
    ({"kvCacheDtype": "fp8"}, False),  # fp8 and bf16 KV workers must never be paired
    ({"kvCacheDtype": "auto"}, True),  # the default, spelled out: existing revisions unchanged
    ({"model": {**BASE["model"], "quantization": "fp8"}}, False),
    ({"model": {**BASE["model"], "quantization": "none"}}, True),
    ({"decode": {"tensorParallelSize": 2}}, False),
    ({"kvTransfer": {"backend": "tcp"}}, False),
    ({"prefill": {"args": ["--block-size", "32"]}}, False),
])
def test_revision_tracks_kv_compatibility_only(change, same):
    assert (naming.revision(ms(**change)) == naming.revision(ms())) is same
    # prefill and decode pods always share it, so the router can pair them
    m = ms(**change)
    labels = [build_worker_deployment(m, r)["spec"]["template"]["metadata"]["labels"][naming.LABEL_REVISION]
              for r in ("prefill", "decode")]
    assert labels[0] == labels[1]


def test_router_deployment():
    dep = build_router_deployment(ms(router={"replicas": 2, "policy": "least-loaded", "pdMinPromptTokens": 64,
                                             "apiKeySecret": {"name": "keys"}}))
    c = container(dep)
    assert dep["spec"]["replicas"] == 2
    assert c["command"] == ["pdserve", "router"]
    assert flag(c["args"], "--discovery") == "kubernetes" and flag(c["args"], "--namespace") == "ns1"
    assert flag(c["args"], "--selector") == "pdserve.io/modelserving=llama"
    assert flag(c["args"], "--policy") == "least-loaded" and flag(c["args"], "--pd-min-prompt-tokens") == "64"
    assert {"name": "PDSERVE_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-keys"}}} in c["env"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "llama-router"
    assert "nvidia.com/gpu" not in str(dep)


def test_router_decode_prefix_decider():
    dep = build_router_deployment(ms(router={"decodePolicy": "prefix-aware", "pdMinUncachedTokens": 256}))
    args = container(dep)["args"]
    assert flag(args, "--decode-policy") == "prefix-aware" and flag(args, "--pd-min-uncached-tokens") == "256"
    assert flag(args, "--tokenizer")  # prefix-aware hashes token ids
    # Without prefix-aware decode routing the router would refuse the flag: the spec says so first.
    with pytest.raises(SpecError, match="pdMinUncachedTokens needs decodePolicy"):
        ms(router={"policy": "least-loaded", "pdMinUncachedTokens": 256})


@pytest.mark.parametrize(
    "apis, spec, kinds",
    [
        (ApiVersions(), {}, set()),
        (ALL_APIS, {}, {"PodDisruptionBudget"}),
        (ALL_APIS, {"monitoring": {"serviceMonitor": True}}, {"PodDisruptionBudget", "ServiceMonitor"}),
        (ApiVersions(pdb="policy/v1beta1"), {"monitoring": {"serviceMonitor": True}}, {"PodDisruptionBudget"}),
        (
            ApiVersions(hpa="autoscaling/v2beta2"),
            {"decode": {"autoscaling": {"maxReplicas": 4}}},
            {"HorizontalPodAutoscaler"},
        ),
    ],
)
def test_optional_children_follow_served_apis(apis, spec, kinds):
    children = build_children(ms(**spec), apis, {})
    core = {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
        "NetworkPolicy",
    }  # NetworkPolicy: always served
    assert {c["kind"] for c in children} - core == kinds
    for c in children:
        if c["kind"] in ("HorizontalPodAutoscaler", "PodDisruptionBudget"):
            assert c["apiVersion"] == (apis.hpa if c["kind"] == "HorizontalPodAutoscaler" else apis.pdb)


def test_autoscaled_deployment_leaves_replicas_to_the_hpa():
    m = ms(decode={"replicas": 3, "autoscaling": {"minReplicas": 2, "maxReplicas": 6}})
    assert "replicas" not in build_worker_deployment(m, "decode")["spec"]
    (hpa,) = [c for c in build_children(m, ALL_APIS, {}) if c["kind"] == "HorizontalPodAutoscaler"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["scaleTargetRef"]["name"] == "llama-decode"
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm:num_requests_waiting"


@pytest.mark.parametrize("a, other, lo, hi, expect", [
    (Autoscaling(max_replicas=10), None, 0.5, 2, (1, 10)),    # other role unknown: user's bounds
    (Autoscaling(max_replicas=10), 4, 0.5, 2, (2, 8)),        # 0.5*4 .. 2*4
    (Autoscaling(max_replicas=10, min_replicas=3), 2, 0.5, 1, (3, 3)),  # user's min wins over ratio max
    (Autoscaling(max_replicas=5), 8, 1, None, (5, 5)),        # user's max wins over ratio min
])
def test_hpa_ratio_bounds(a, other, lo, hi, expect):
    assert hpa_bounds(a, other, lo, hi) == expect


def test_decode_hpa_follows_prefill_when_only_decode_autoscales():
    m = ms(
        prefill={"replicas": 2}, decode={"autoscaling": {"maxReplicas": 20}}, prefillDecodeRatio={"min": 0.25, "max": 1}
    )
    # decode per prefill must lie in [1/1, 1/0.25] * 2 prefill = [2, 8]
    assert autoscaler_bounds(m, "decode", {"prefill": 2}) == (2, 8)


@pytest.mark.parametrize("spec, message", [
    ({"prefill": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}, "spec.prefill.autoscaling.minReplicas"),
    ({"prefillDecodeRatio": {"min": 2, "max": 1}}, "spec.prefillDecodeRatio.min"),
    ({"prefill": {"resources": {"limits": {"nvidia.com/gpu": "lots"}}}}, "whole number of GPUs"),
])
def test_cross_field_errors(spec, message):
    with pytest.raises(SpecError, match=message):
        ms(**spec)


def test_router_flow_control_becomes_its_flags_and_the_router_takes_them():
    import argparse

    from pdserve.router.main import add_arguments, config_from_args

    assert "--flow-control-max-inflight" not in container(build_router_deployment(ms()))["args"]  # off by default
    dep = build_router_deployment(ms(router={"flowControl": {
        "maxInflight": 64, "maxQueue": 500, "queueTimeoutSeconds": 20, "bands": [-2, 0, 3],
        "tenantMaxInflight": 8, "tenantTokensPerMinute": 100000, "workerMaxWaiting": 4, "workerMaxKVUsage": 0.9}}))
    args = container(dep)["args"]
    assert flag(args, "--flow-control-max-inflight") == "64" and flag(args, "--flow-control-max-queue") == "500"
    assert flag(args, "--flow-control-tenant-tokens-per-minute") == "100000"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(args), {})
    assert config.flow_control_bands == (-2, 0, 3) and config.flow_control_queue_timeout_s == 20
    assert config.flow_control_tenant_max_inflight == 8 and config.flow_control_worker_max_kv_usage == 0.9
    with pytest.raises(SpecError, match="maxInflight"):
        ms(router={"flowControl": {"maxQueue": 4}})


def test_tracing_reaches_every_pod():
    """spec.tracing: the endpoint as each process's --otlp-traces-endpoint, the protocol and the
    sampling ratio as the SDK's variables; without it no pod has either."""
    traced = ms(tracing={"endpoint": "http://tempo.obs:4318/v1/traces", "protocol": "http/protobuf",
                         "samplingRatio": 0.25})
    for dep, role in ((build_worker_deployment(traced, "prefill"), "prefill"),
                      (build_worker_deployment(traced, "decode"), "decode"),
                      (build_router_deployment(traced), "router")):
        c = container(dep)
        assert flag(c["args"], "--otlp-traces-endpoint") == "http://tempo.obs:4318/v1/traces"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
        assert f"pdserve.role={role}" in env["OTEL_RESOURCE_ATTRIBUTES"]
    plain = ms()
    for dep in (build_worker_deployment(plain, "decode"), build_router_deployment(plain)):
        c = container(dep)
        assert "--otlp-traces-endpoint" not in c["args"]
        assert not any(e["name"].startswith("OTEL_") for e in c["env"])
    for bad in ({"endpoint": "jaeger:4317"}, {"endpoint": "http://j:4317", "protocol": "thrift"},
                {"endpoint": "http://j:4317", "samplingRatio": 2}, {"protocol": "grpc"}):
        with pytest.raises(SpecError):
            ms(tracing=bad)


@pytest.mark.parametrize("spec, role, flag_value, memory", [
    ({}, "decode", None, {}),  # off by default: no flag, resources untouched
    ({"kvCache": {"offloadGiB": 32}}, "prefill", "32", {"requests": "32Gi"}),  # spec-wide: both roles
    ({"kvCache": {"offloadGiB": 32}}, "decode", "32", {"requests": "32Gi"}),
    # a role's own value wins over the spec-wide one, 0 included
    ({"kvCache": {"offloadGiB": 32}, "decode": {"kvCache": {"offloadGiB": 0}}}, "decode", None, {}),
    ({"decode": {"kvCache": {"offloadGiB": 1.5}}}, "prefill", None, {}),
    # the request and a limit the user set grow by the tier; no limit is invented
    ({"decode": {"kvCache": {"offloadGiB": 1.5},
                 "resources": {"requests": {"memory": "16Gi"}, "limits": {"memory": "20G"}}}},
     "decode", "1.5", {"requests": "17920Mi", "limits": f"{(20 * 10**9 + 3 * 2**29) // 1024}Ki"}),
])
def test_host_kv_tier_flag_and_memory(spec, role, flag_value, memory):
    c = container(build_worker_deployment(ms(**spec), role))
    assert flag(c["args"], "--kv-offloading-size") == flag_value
    got = {kind: v["memory"] for kind, v in c.get("resources", {}).items() if "memory" in v}
    assert got == memory


@pytest.mark.parametrize("spec, message", [
    ({"kvCache": {"offloadGiB": -1}}, "spec.kvCache.offloadGiB"),
    ({"prefill": {"kvCache": {"offloadGiB": "lots"}}}, "spec.prefill.kvCache.offloadGiB"),
])
def test_host_kv_tier_bad_sizes(spec, message):
    with pytest.raises(SpecError, match=message):
        ms(**spec)


def test_host_kv_tier_bad_memory_quantity_names_the_field():
    m = ms(decode={"kvCache": {"offloadGiB": 1}, "resources": {"requests": {"memory": "lots"}}})
    with pytest.raises(SpecError, match=r"spec.decode.resources.requests.memory"):
        build_worker_deployment(m, "decode")
