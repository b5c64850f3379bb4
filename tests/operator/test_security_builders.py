"""Pure builder checks for the secure defaults of the KV data path (issue 15: the generated
Secrets, the workers' NetworkPolicy, the operator's RBAC for them) and for tensor-parallel
workers (issue 18: GPUs, the flag, /dev/shm)."""

from __future__ import annotations

import base64

import pytest

from pdserve.operator import naming
from pdserve.operator.children import build_children
from pdserve.operator.generated_secrets import KV_SECRET, WORKER_API_KEY, build_secret, check_secret, new_value
from pdserve.operator.networking import build_worker_network_policy, build_worker_service
from pdserve.operator.optional import ApiVersions
from pdserve.operator.rbac import build_operator_cluster_role
from pdserve.operator.spec import ModelServing, ModelServingSpec, SpecError
from pdserve.operator.workloads import build_router_deployment, build_worker_deployment

BASE = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "image": "reg/pdserve:1"}


def ms(uid="uid-1", kv_secret_uid="", **spec) -> ModelServing:
    return ModelServing("llama", "ns1", uid, ModelServingSpec.from_dict({**BASE, **spec}), kv_secret_uid=kv_secret_uid)


def worker(m, role):
    return build_worker_deployment(m, role)["spec"]["template"]["spec"]["containers"][0]


def env(c):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or ()}


# the KV secret ------------------------------------------------------------------------------

def test_every_worker_reads_the_generated_secret_by_default_and_the_router_never():
    for role in ("prefill", "decode"):
        assert env(worker(ms(), role))["PDSERVE_KV_SECRET"] == \
            {"secretKeyRef": {"name": "llama-kv-secret", "key": "kv-secret"}}
    router = build_router_deployment(ms())["spec"]["template"]["spec"]["containers"][0]
    assert "PDSERVE_KV_SECRET" not in env(router)


def test_a_user_secret_ref_replaces_the_generated_one():
    m = ms(kvTransfer={"secretRef": {"name": "mine", "key": "k"}})
    assert env(worker(m, "prefill"))["PDSERVE_KV_SECRET"] == {"secretKeyRef": {"name": "mine", "key": "k"}}
    assert env(worker(ms(kvTransfer={"secretRef": {"name": "mine"}}), "decode"))["PDSERVE_KV_SECRET"] == \
        {"secretKeyRef": {"name": "mine", "key": "kv-secret"}}


def test_revision_follows_the_generated_secrets_identity_not_the_reconcile():
    """The same Secret (uid) gives the same revision every time; a re-created Secret (a new
    value, a new uid) gives a new one, so old and new pods are never paired."""
    a, b = ms(kv_secret_uid="s-1"), ms(kv_secret_uid="s-1")
    assert naming.revision(a) == naming.revision(b)
    assert naming.revision(ms(kv_secret_uid="s-2")) != naming.revision(a)
    assert naming.revision(ms(kvTransfer={"secretRef": {"name": "other"}})) != naming.revision(ms())


# (Secret name, data key, the spec field that replaces it) of each generated Secret
GENERATED = [(KV_SECRET, "llama-kv-secret", "kv-secret", "kvTransfer.secretRef"),
             (WORKER_API_KEY, "llama-worker-api-key", "api-key", "workerApiKeySecret")]


@pytest.mark.parametrize("which, name, key, field", GENERATED)
def test_generated_secret_is_owned_random_and_long_enough(which, name, key, field):
    s = build_secret(ms(), which, new_value())
    assert (s["kind"], s["type"], s["metadata"]["name"]) == ("Secret", "Opaque", name)
    (ref,) = s["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"]) == ("ModelServing", "uid-1", True)
    value = base64.b64decode(s["data"][key]).decode()
    assert len(value) >= 32 and value != new_value()
    assert "," not in value  # PDSERVE_API_KEYS is comma-separated: one key must stay one key


@pytest.mark.parametrize("which, name, key, field", GENERATED)
@pytest.mark.parametrize("owners, data, message", [
    ([], "x" * 40, "set {field} to use it, or delete it"),
    ([{"kind": "ModelServing", "uid": "old-uid"}], "x" * 40, "belongs to a deleted ModelServing of this name"),
    ([{"kind": "ModelServing", "uid": "uid-1"}], "short", "its key {key} is missing or shorter than 16 characters"),
    ([{"kind": "ModelServing", "uid": "uid-1"}], None, "its key {key} is missing"),
])
def test_an_existing_secret_that_is_not_ours_or_not_usable_is_refused(which, name, key, field, owners, data, message):
    obj = {"metadata": {"name": name, "uid": "s-1", "ownerReferences": owners},
           "data": {} if data is None else {key: base64.b64encode(data.encode()).decode()}}
    with pytest.raises(SpecError, match=message.format(field=field, key=key).replace(".", r"\.")) as e:
        check_secret(ms(), which, obj)
    assert str(e.value).startswith(f"spec.{field} is unset, so the operator manages Secret {name}")


@pytest.mark.parametrize("which, name, key, field", GENERATED)
def test_our_secret_is_used_as_it_is(which, name, key, field):
    obj = {"metadata": {"name": name, "uid": "s-1", "ownerReferences": [{"kind": "ModelServing", "uid": "uid-1"}]},
           "data": {key: base64.b64encode(b"y" * 43).decode()}}
    assert check_secret(ms(), which, obj) == "s-1"


# the NetworkPolicy --------------------------------------------------------------------------

def rules(policy):
    return {tuple(sorted(str(p) for p in r["from"])): r["ports"] for r in policy["spec"]["ingress"]}


def test_network_policy_admits_only_this_modelservings_pods():
    p = build_worker_network_policy(ms())
    assert (p["apiVersion"], p["metadata"]["name"]) == ("networking.k8s.io/v1", "llama-workers")
    assert p["spec"]["policyTypes"] == ["Ingress"]  # egress (DNS, the Hub) untouched
    workers = {"matchExpressions": [{"key": "pdserve.io/modelserving", "operator": "In", "values": ["llama"]},
                                    {"key": "pdserve.io/role", "operator": "In", "values": ["prefill", "decode"]}]}
    assert p["spec"]["podSelector"] == workers
    worker_rule, router_rule = p["spec"]["ingress"]
    # workers: every TCP port (UCX's TCP transport listens on ephemeral ports)
    assert worker_rule == {"from": [{"podSelector": workers}], "ports": [{"protocol": "TCP"}]}
    # the router: HTTP only, and only this ModelServing's router
    assert router_rule == {"from": [{"podSelector": {"matchLabels": {"pdserve.io/modelserving": "llama",
                                                                     "pdserve.io/role": "router"}}}],
                           "ports": [{"protocol": "TCP", "port": 8000}]}
    assert len(p["spec"]["ingress"]) == 2  # no scrapers without monitoring


def test_network_policy_selects_what_the_pods_carry():
    """The selectors match the labels of the pods the Deployments make, and no other role's."""
    m = ms()
    p = build_worker_network_policy(m)

    def selects(selector, labels):
        return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", ())) and \
            all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    pod_labels = {role: build_worker_deployment(m, role)["spec"]["template"]["metadata"]["labels"]
                  for role in ("prefill", "decode")}
    pod_labels["router"] = build_router_deployment(m)["spec"]["template"]["metadata"]["labels"]
    assert [r for r in pod_labels if selects(p["spec"]["podSelector"], pod_labels[r])] == ["prefill", "decode"]
    worker_from, router_from = (r["from"][0]["podSelector"] for r in p["spec"]["ingress"])
    assert [r for r in pod_labels if selects(worker_from, pod_labels[r])] == ["prefill", "decode"]
    assert [r for r in pod_labels if selects(router_from, pod_labels[r])] == ["router"]
    other = {**pod_labels["decode"], "pdserve.io/modelserving": "other"}
    assert not selects(worker_from, other)


def test_prefix_aware_routers_also_reach_the_kv_event_ports():
    p = build_worker_network_policy(ms(router={"policy": "prefix-aware"}))
    assert [x["port"] for x in p["spec"]["ingress"][1]["ports"]] == [8000, 5557, 5558]


@pytest.mark.parametrize(
    "spec, scrapers",
    [
        (
            {"monitoring": {"serviceMonitor": True}},
            [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
        ),
        (
            {
                "monitoring": {"serviceMonitor": True},
                "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]},
            },
            [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}],
        ),
        (
            {"networkPolicy": {"metricsFrom": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]}},
            [{"ipBlock": {"cidr": "10.1.0.0/16"}}],
        ),
        ({"monitoring": {"serviceMonitor": True}, "networkPolicy": {"metricsFrom": []}}, None),
    ],
)
def test_metric_scrapers_reach_the_http_port_only(spec, scrapers):
    ingress = build_worker_network_policy(ms(**spec))["spec"]["ingress"]
    if scrapers is None:
        assert len(ingress) == 2
    else:
        assert ingress[2] == {"from": scrapers, "ports": [{"protocol": "TCP", "port": 8000}]}


def test_network_policy_is_on_by_default_and_can_be_turned_off():
    apis = ApiVersions()
    kinds = lambda m: [c["kind"] for c in build_children(m, apis, {})]  # noqa: E731
    assert kinds(ms()).count("NetworkPolicy") == 1
    assert "NetworkPolicy" not in kinds(ms(networkPolicy={"enabled": False}))
    assert "Secret" not in kinds(ms())  # created once by reconcile, never applied


# the operator's RBAC --------------------------------------------------------------------------

def verbs(resource, group=""):
    rules = build_operator_cluster_role()["rules"]
    return {v for r in rules if resource in r["resources"] and group in r["apiGroups"] for v in r["verbs"]}


def test_operator_may_create_and_read_secrets_but_not_change_list_or_delete_them():
    assert verbs("secrets") == {"get", "create"}
    assert verbs("networkpolicies", "networking.k8s.io") == {"get", "list", "create", "patch", "delete"}


# tensor parallelism ---------------------------------------------------------------------------

@pytest.mark.parametrize("role_spec, gpus, shm", [
    ({}, "1", "8Gi"),
    ({"tensorParallelSize": 2}, "2", "8Gi"),
    ({"tensorParallelSize": 4}, "4", "16Gi"),
    ({"tensorParallelSize": 8}, "8", "32Gi"),
    ({"tensorParallelSize": 4, "shmSize": "10Gi"}, "4", "10Gi"),  # the user's size wins
    ({"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 4}}}, "4", "8Gi"),  # the user's count wins
    ({"tensorParallelSize": 2, "resources": {"requests": {"nvidia.com/gpu": 2}}}, "2", "8Gi"),
])
def test_tensor_parallel_workers_get_a_gpu_per_rank_the_flag_and_shm(role_spec, gpus, shm):
    dep = build_worker_deployment(ms(decode=role_spec), "decode")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == str(role_spec.get("tensorParallelSize", 1))
    (vol,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"]
    assert vol["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}
    prefill = build_worker_deployment(ms(decode=role_spec), "prefill")["spec"]["template"]["spec"]["containers"][0]
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == "1"  # per role


def test_cpu_tensor_parallel_workers_get_no_gpus():
    c = worker(ms(device="cpu", decode={"tensorParallelSize": 2}), "decode")
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"


@pytest.mark.parametrize("role_spec, message", [
    ({"tensorParallelSize": 4, "resources": {"requests": {"nvidia.com/gpu": 2}}},
     r"spec.prefill.resources.requests\[nvidia.com/gpu\] is 2 but tensorParallelSize is 4"),
    ({"resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 2}}},
     r"spec.prefill.resources: requests\[nvidia.com/gpu\] \(1\) must equal limits\[nvidia.com/gpu\] \(2\)"),
])
def test_gpu_counts_that_cannot_serve_the_ranks_are_spec_errors(role_spec, message):
    with pytest.raises(SpecError, match=message):
        ms(prefill=role_spec)


def test_tensor_parallel_sizes_are_in_the_revision():
    assert naming.revision(ms(decode={"tensorParallelSize": 2})) != naming.revision(ms())


# tensor-parallel prefill workers serve rank r's KV shard on kvTransfer.port + r ---------------

def ports(m, role):
    c = worker(m, role)
    svc = build_worker_service(m, role)["spec"]["ports"]
    return ([(p["name"], p["containerPort"]) for p in c["ports"]],
            [(p["name"], p["port"], p["targetPort"]) for p in svc])


def test_tp1_workers_keep_the_http_and_one_kv_port():
    for role in ("prefill", "decode"):
        container, service = ports(ms(), role)
        assert container == [("http", 8000), ("kv", 5600)]
        assert service == [("http", 8000, "http"), ("kv", 5600, "kv")]


@pytest.mark.parametrize("tp, expected", [
    (2, [("kv", 5600), ("kv-1", 5601)]),
    (4, [("kv", 5600), ("kv-1", 5601), ("kv-2", 5602), ("kv-3", 5603)]),
])
def test_tp_prefill_workers_open_a_kv_port_per_rank_in_pod_and_service(tp, expected):
    m = ms(prefill={"tensorParallelSize": tp}, decode={"tensorParallelSize": tp}, kvTransfer={"port": 5600})
    container, service = ports(m, "prefill")
    assert container == [("http", 8000)] + expected
    assert service == [("http", 8000, "http")] + [(n, p, n) for n, p in expected]
    assert worker(m, "prefill")["args"][worker(m, "prefill")["args"].index("--kv-port") + 1] == "5600"
    # decode ranks only dial out: the decode pods keep their one kv port
    assert ports(m, "decode") == ([("http", 8000), ("kv", 5600)], [("http", 8000, "http"), ("kv", 5600, "kv")])


def test_the_network_policy_admits_every_prefill_ranks_kv_port_from_the_workers():
    """Workers of this ModelServing reach each other on every TCP port (UCX's ephemeral
    listeners), which covers kvTransfer.port + r for every rank; nobody else reaches them."""
    p = build_worker_network_policy(ms(prefill={"tensorParallelSize": 4}))
    worker_rule, router_rule = p["spec"]["ingress"]
    assert worker_rule["ports"] == [{"protocol": "TCP"}]  # no port: kvTransfer.port .. + 3 included
    assert all(r["port"] not in range(5600, 5604) for r in router_rule["ports"])


@pytest.mark.parametrize("spec, message", [
    ({"kvTransfer": {"port": 65534}, "prefill": {"tensorParallelSize": 4}},
     r"spec.kvTransfer.port \(65534\) \+ spec.prefill.tensorParallelSize - 1 is 65537, past 65535"),
    ({"kvTransfer": {"port": 7998}, "prefill": {"tensorParallelSize": 4}},
     r"spec.kvTransfer.port: the prefill KV ports 7998..8001 .* include 8000"),
    ({"kvTransfer": {"port": 5556}, "prefill": {"tensorParallelSize": 2}, "router": {"policy": "prefix-aware"}},
     r"spec.kvTransfer.port: the prefill KV ports 5556..5557 .* include 5557"),
])
def test_a_prefill_kv_port_range_that_cannot_be_bound_is_a_spec_error(spec, message):
    with pytest.raises(SpecError, match=message):
        ms(**spec)


def test_kv_port_ranges_clear_of_the_other_ports_are_fine():
    ms(kvTransfer={"port": 5556}, prefill={"tensorParallelSize": 2})  # no KV events without prefix-aware
    ms(kvTransfer={"port": 65532}, prefill={"tensorParallelSize": 4})  # ends at 65535
    ms(kvTransfer={"port": 7996}, decode={"tensorParallelSize": 8})  # decode ranks listen on nothing
