"""Pure builder checks for running in production (issue 13): rollouts that need no spare GPU,
a router that can run every policy it is offered, honest probes, drain, the model cache,
secure defaults and the podTemplate escape hatch, UCX/RDMA, probe timings, /dev/shm."""

from __future__ import annotations

import pytest

from pdserve.operator import naming
from pdserve.operator.children import build_children
from pdserve.operator.merge import strategic_merge
from pdserve.operator.optional import ApiVersions
from pdserve.operator.spec import ModelServing, ModelServingSpec, SpecError
from pdserve.operator.workloads import build_router_deployment, build_worker_deployment

BASE = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "image": "reg/pdserve:1"}


def ms(**spec) -> ModelServing:
    return ModelServing("llama", "ns1", "uid-1", ModelServingSpec.from_dict({**BASE, **spec}))


def pod(dep):
    return dep["spec"]["template"]["spec"]


def container(dep, name=None):
    return next(c for c in pod(dep)["containers"] if name is None or c["name"] == name)


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


def env(c):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env") or ()}


# 1. rollouts -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, role, surge, unavailable", [
    ({}, "decode", 0, 1),                              # a GPU role needs no spare GPU to roll
    ({"device": "cpu"}, "decode", 1, 0),               # CPU workers surge: no capacity lost
    ({"decode": {"rollout": {"maxSurge": 1, "maxUnavailable": 0}}}, "decode", 1, 0),
    ({"prefill": {"rollout": {"maxUnavailable": "50%"}}}, "prefill", 0, "50%"),
])
def test_worker_rollout_strategy(spec, role, surge, unavailable):
    strategy = build_worker_deployment(ms(**spec), role)["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}


def test_router_rollout_surges_and_rollout_bounds_are_checked():
    assert build_router_deployment(ms())["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    with pytest.raises(SpecError, match=r"spec.decode.rollout: maxSurge and maxUnavailable cannot both be 0"):
        ms(decode={"rollout": {"maxSurge": 0, "maxUnavailable": 0}})


def test_progress_deadline_outlasts_the_startup_probe():
    dep = build_worker_deployment(ms(), "decode")
    startup = container(dep)["startupProbe"]
    assert dep["spec"]["progressDeadlineSeconds"] > startup["periodSeconds"] * startup["failureThreshold"]


# 2. prefix-aware in the cluster: the router gets a tokenizer from the model source ----------

@pytest.mark.parametrize("source, tokenizer, volume", [
    ("hf://org/m", "org/m", None),                          # fetched by the router into its HF_HOME
    ("hf://org/m@v2", "/cache/tokenizer", None),            # pinned: an init container fetches that revision
    ("pvc://models/org/m", "/models/org/m", {"claimName": "models", "readOnly": True}),
    ("/opt/model", "/opt/model", None),
])
def test_prefix_aware_router_gets_a_tokenizer(source, tokenizer, volume):
    m = ms(model={"source": source, "hfTokenSecret": {"name": "hf"}}, router={"policy": "prefix-aware"})
    dep = build_router_deployment(m)
    c = container(dep)
    assert flag(c["args"], "--policy") == "prefix-aware" and flag(c["args"], "--tokenizer") == tokenizer
    vols = {v["name"]: v for v in pod(dep)["volumes"]}
    if volume:
        assert vols["model"]["persistentVolumeClaim"] == volume
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    if source.startswith("hf://"):
        assert env(c)["HF_HOME"] == "/cache/huggingface" and env(c)["HF_TOKEN"]["secretKeyRef"]["name"] == "hf"
        assert vols["cache"]["emptyDir"] == {"sizeLimit": "1Gi"}
    init = pod(dep).get("initContainers") or []
    assert [i["name"] for i in init] == (["fetch-tokenizer"] if "@" in source else [])
    if init:
        assert init[0]["command"][-4:-1] == ["org/m", "v2", "/cache/tokenizer"]


def test_router_without_prefix_aware_needs_no_tokenizer():
    c = container(build_router_deployment(ms(router={"policy": "least-loaded"})))
    assert "--tokenizer" not in c["args"] and "HF_HOME" not in env(c)


def test_kv_event_ports_declared_only_when_consumed():
    ports = lambda m: {p["name"]: p["containerPort"] for p in container(build_worker_deployment(m, "decode"))["ports"]}  # noqa: E731
    assert ports(ms()) == {"http": 8000, "kv": 5600}
    assert ports(ms(router={"decodePolicy": "prefix-aware"})) == {
        "http": 8000,
        "kv": 5600,
        "kv-events": 5557,
        "kv-replay": 5558,
    }


# 3. router readiness and resources ----------------------------------------------------------

def test_router_ready_only_with_workers_behind_it_and_not_best_effort():
    c = container(build_router_deployment(ms()))
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"} and c["resources"]["limits"]["memory"]
    custom = container(build_router_deployment(ms(router={"resources": {"requests": {"cpu": "4"}}})))
    assert custom["resources"] == {"requests": {"cpu": "4"}}


# 4. drain -------------------------------------------------------------------------------------

@pytest.mark.parametrize("drain, grace, sleep, shutdown", [
    ({}, 45, "5", "30"),
    ({"timeoutSeconds": 120, "preStopSeconds": 10}, 140, "10", "120"),
])
def test_grace_period_covers_pre_stop_and_drain(drain, grace, sleep, shutdown):
    m = ms(drain=drain)
    for dep in (
        build_worker_deployment(m, "prefill"),
        build_worker_deployment(m, "decode"),
        build_router_deployment(m),
    ):
        assert pod(dep)["terminationGracePeriodSeconds"] == grace
        assert container(dep)["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", sleep]}}}
    assert flag(container(build_worker_deployment(m, "decode"))["args"], "--shutdown-grace") == shutdown
    live = container(build_worker_deployment(m, "decode"))["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= grace  # liveness never cuts a drain short


# 5. model cache and pinned revisions -----------------------------------------------------------

def test_cache_is_an_empty_dir_with_size_and_storage_request():
    dep = build_worker_deployment(ms(model={**BASE["model"], "cache": {"sizeLimit": "100Gi"}}), "decode")
    c, vols = container(dep), {v["name"]: v for v in pod(dep)["volumes"]}
    assert vols["cache"] == {"name": "cache", "emptyDir": {"sizeLimit": "100Gi"}}
    assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"]
    assert env(c)["HF_HOME"] == "/cache/huggingface"
    assert c["resources"]["requests"]["ephemeral-storage"] == "100Gi"
    assert flag(c["args"], "--model") == "meta-llama/Llama-3.1-8B-Instruct"


def test_cache_on_a_pvc_shared_by_workers():
    dep = build_worker_deployment(ms(model={**BASE["model"], "cache": {"claimName": "hf-cache"}}), "prefill")
    vols = {v["name"]: v for v in pod(dep)["volumes"]}
    assert vols["cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}
    assert "ephemeral-storage" not in str(container(dep)["resources"])
    assert pod(dep)["securityContext"]["fsGroup"] == 1000  # a fresh volume is writable by the pod's user
    with pytest.raises(SpecError, match="claimName .* or sizeLimit"):
        ms(model={**BASE["model"], "cache": {"claimName": "c", "sizeLimit": "1Gi"}})


def test_pinned_revision_is_fetched_once_and_changes_the_revision():
    pinned = ms(model={"source": "hf://org/m@0123abcd", "hfTokenSecret": {"name": "hf"}})
    dep = build_worker_deployment(pinned, "decode")
    (init,) = pod(dep)["initContainers"]
    assert init["name"] == "fetch-model" and init["command"][:2] == ["python", "-c"]
    assert init["command"][-4:-1] == ["org/m", "0123abcd", "/cache/models/org/m/0123abcd"]
    assert env(init)["HF_TOKEN"]["secretKeyRef"]["name"] == "hf" and env(init)["HF_HOME"] == "/cache/huggingface"
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    c = container(dep)
    assert flag(c["args"], "--model") == "/cache/models/org/m/0123abcd"
    assert flag(c["args"], "--served-model-name") == "org/m"  # clients don't type the revision
    revisions = {naming.revision(ms(model={"source": s})) for s in ("hf://org/m", "hf://org/m@0123abcd", "hf://org/m@v2")}
    assert len(revisions) == 3  # two revisions of one repo never pair


# 6. secure defaults and the podTemplate override -------------------------------------------------

def test_secure_defaults():
    m = ms()
    for dep in (build_worker_deployment(m, "decode"), build_router_deployment(m)):
        p, c = pod(dep), container(dep)
        assert p["securityContext"]["runAsNonRoot"] is True and p["securityContext"]["seccompProfile"] == {
            "type": "RuntimeDefault"
        }
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"] and env(c)["HOME"] == "/tmp"
    worker = pod(build_worker_deployment(m, "prefill"))
    assert worker["serviceAccountName"] == "llama-worker" and worker["automountServiceAccountToken"] is False
    (sa,) = [
        c
        for c in build_children(m, ApiVersions(), {})
        if c["kind"] == "ServiceAccount" and c["metadata"]["name"] == "llama-worker"
    ]
    assert sa["automountServiceAccountToken"] is False


def test_pod_template_is_merged_strategically():
    template = {
        "metadata": {
            "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"},
            "labels": {"team": "ml", "pdserve.io/role": "hijack"},
        },
        "spec": {
            "priorityClassName": "inference",
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
            "volumes": [{"name": "extra", "configMap": {"name": "cfg"}}],
            "containers": [
                {
                    "name": "worker",
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                    "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra"}],
                },
                {"name": "sidecar", "image": "busybox"},
            ],
        },
    }
    dep = build_worker_deployment(ms(decode={"podTemplate": template}), "decode")
    meta, p, c = dep["spec"]["template"]["metadata"], pod(dep), container(dep, "worker")
    assert meta["annotations"] == {"k8s.v1.cni.cncf.io/networks": "rdma-net"} and meta["labels"]["team"] == "ml"
    assert meta["labels"]["pdserve.io/role"] == "decode"  # the selector labels stay the operator's
    assert p["priorityClassName"] == "inference" and p["topologySpreadConstraints"][0]["topologyKey"] == "zone"
    assert {v["name"] for v in p["volumes"]} >= {"extra", "shm", "tmp", "cache"}
    assert env(c)["NCCL_DEBUG"] == "INFO" and "POD_IP" in env(c)  # merged by name, ours kept
    assert c["command"] == ["pdserve", "worker"] and [x["name"] for x in p["containers"]] == ["worker", "sidecar"]
    # other roles are untouched
    assert "priorityClassName" not in pod(build_worker_deployment(ms(decode={"podTemplate": template}), "prefill"))


def test_pod_template_can_relax_a_default():
    """e.g. an engine that must write to its root filesystem, or a root-only RDMA setup."""
    dep = build_router_deployment(ms(router={"podTemplate": {"spec": {
        "securityContext": {"runAsNonRoot": None, "runAsUser": 0},
        "containers": [{"name": "router", "securityContext": {"readOnlyRootFilesystem": False}}]}}}))
    assert pod(dep)["securityContext"]["runAsUser"] == 0 and "runAsNonRoot" not in pod(dep)["securityContext"]
    assert container(dep)["securityContext"]["readOnlyRootFilesystem"] is False


@pytest.mark.parametrize(
    "base, patch, field, expect",
    [
        ({"a": 1, "b": {"c": 2}}, {"b": {"d": 3}, "a": None}, None, {"b": {"c": 2, "d": 3}}),
        (
            [{"name": "x", "v": 1}, {"name": "y"}],
            [{"name": "x", "v": 2}, {"name": "z"}],
            "env",
            [{"name": "x", "v": 2}, {"name": "y"}, {"name": "z"}],
        ),
        ([{"name": "x"}, {"name": "y"}], [{"name": "x", "$patch": "delete"}], "volumes", [{"name": "y"}]),
        (["--a"], ["--b"], "args", ["--b"]),  # lists without a merge key are replaced
        (
            [{"containerPort": 1, "name": "a"}],
            [{"containerPort": 2}],
            "ports",
            [{"containerPort": 1, "name": "a"}, {"containerPort": 2}],
        ),
    ],
)
def test_strategic_merge(base, patch, field, expect):
    assert strategic_merge(base, patch, field) == expect


def test_pod_template_item_without_merge_key_is_a_spec_error():
    with pytest.raises(
        SpecError, match=r"spec.prefill.podTemplate: every item of containers needs its merge key 'name'"
    ):
        build_worker_deployment(ms(prefill={"podTemplate": {"spec": {"containers": [{"image": "x"}]}}}), "prefill")


# 7. UCX/NIXL per role, probe timings, /dev/shm ----------------------------------------------------

def test_ucx_and_rdma_per_role_over_spec_wide():
    m = ms(kvTransfer={"ucxTls": "rc,cuda_copy", "rdma": {"resource": "rdma/ib", "count": 1}},
           decode={"kvTransfer": {"ucxNetDevices": "mlx5_1:1", "rdma": {"resource": "rdma/hca", "count": 2}}})
    p, d = container(build_worker_deployment(m, "prefill")), container(build_worker_deployment(m, "decode"))
    assert env(p)["UCX_TLS"] == "rc,cuda_copy" and "UCX_NET_DEVICES" not in env(p)
    assert env(d)["UCX_TLS"] == "rc,cuda_copy" and env(d)["UCX_NET_DEVICES"] == "mlx5_1:1"
    assert p["resources"]["limits"]["rdma/ib"] == "1" and d["resources"]["limits"]["rdma/hca"] == "2"
    assert d["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert "UCX_TLS" not in env(container(build_worker_deployment(ms(), "decode")))  # the engine's default


def test_user_env_wins_by_name_without_duplicates():
    c = container(
        build_worker_deployment(
            ms(kvTransfer={"ucxTls": "tcp"}, decode={"env": [{"name": "UCX_TLS", "value": "rc"}]}), "decode"
        )
    )
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names)) and env(c)["UCX_TLS"] == "rc"


def test_probe_timings():
    c = container(
        build_worker_deployment(
            ms(decode={"probes": {"readiness": {"timeoutSeconds": 10, "periodSeconds": 2}}}), "decode"
        )
    )
    assert c["readinessProbe"] == {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2,
                                   "timeoutSeconds": 10, "failureThreshold": 3}
    for kind in ("startupProbe", "livenessProbe"):
        assert c[kind]["timeoutSeconds"] == 5  # never the 1 s default
    r = container(build_router_deployment(ms(router={"probes": {"liveness": {"failureThreshold": 9}}})))
    assert r["livenessProbe"]["failureThreshold"] == 9 and r["readinessProbe"]["timeoutSeconds"] == 5


def test_shm_size():
    vols = lambda m, r: {v["name"]: v for v in pod(build_worker_deployment(m, r))["volumes"]}  # noqa: E731
    assert vols(ms(), "decode")["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert vols(ms(prefill={"shmSize": "32Gi"}), "prefill")["shm"]["emptyDir"]["sizeLimit"] == "32Gi"


def test_fetch_command_runs(tmp_path):
    """The init container's command as built, run with this environment's Python and the Hub
    offline (no downloads in tests): it reaches snapshot_download with the pinned revision."""
    import os
    import subprocess
    import sys

    (init,) = pod(build_worker_deployment(ms(model={"source": "hf://org/m@0123abcd"}), "decode"))["initContainers"]
    command = [sys.executable, *init["command"][1:]]
    command[-2] = str(tmp_path / "dest")
    out = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "LocalEntryNotFoundError" in out.stderr and "revision" in out.stderr


def test_decode_pulls_only_from_allowed_peers_and_authenticates():
    """A forged kv_transfer_params must not make a decode worker connect anywhere: by default
    only private (pod network) ranges, never link-local metadata addresses or the internet."""
    d = container(build_worker_deployment(ms(), "decode"))
    allowed = d["args"][d["args"].index("--kv-peer-allow") + 1:]
    # Only the prefill KV port (issue 23: an allowed address on another port, e.g. one an attacker
    # listens on, is refused).
    assert allowed == ["10.0.0.0/8:5600", "172.16.0.0/12:5600", "192.168.0.0/16:5600", "100.64.0.0/10:5600",
                       "[fd00::/8]:5600"]
    # A prefill worker pulls a prefix another prefill worker holds (the router's peer prefix):
    # from the same peers, on the same ports.
    p = container(build_worker_deployment(ms(), "prefill"))
    assert p["args"][p["args"].index("--kv-peer-allow") + 1:][:len(allowed)] == allowed
    m = ms(kvTransfer={"peerAllow": ["10.8.0.0/14", "prefill.example:7000-7001"], "secretRef": {"name": "kv"},
                       "port": 6000}, prefill={"replicas": 1, "tensorParallelSize": 2})
    d = container(build_worker_deployment(m, "decode"))
    at = d["args"].index("--kv-peer-allow")
    # Every prefill rank's port (rank r on port + r); an entry naming its own ports keeps them.
    assert d["args"][at + 1:at + 3] == ["10.8.0.0/14:6000-6001", "prefill.example:7000-7001"]
    p = container(build_worker_deployment(m, "prefill"))
    at = p["args"].index("--kv-peer-allow")
    assert p["args"][at + 1:at + 3] == ["10.8.0.0/14:6000-6001", "prefill.example:7000-7001"]
    for role in ("prefill", "decode"):
        assert env(container(build_worker_deployment(m, role)))["PDSERVE_KV_SECRET"] == \
            {"secretKeyRef": {"name": "kv", "key": "kv-secret"}}
    assert naming.revision(m) != naming.revision(ms())  # a new secret: old and new pods would not authenticate


def test_worker_accepts_the_args_as_built():
    """The worker's own argument parser and config take the operator's args (no engine starts),
    a host KV tier beside P/D transfer included."""
    import argparse

    for role in ("prefill", "decode"):
        c = container(build_worker_deployment(ms(router={"policy": "prefix-aware"}, device="cpu",
                                                 kvTransfer={"backend": "tcp"}, kvCache={"offloadGiB": 2}), role))
        parser = argparse.ArgumentParser()
        from pdserve.worker.server.main import add_arguments, configs_from_args
        add_arguments(parser)
        # As in the pod: the KV secret from its Secret (a worker serving KV beyond loopback needs it).
        config, server = configs_from_args(parser.parse_args(c["args"]), environ={"PDSERVE_KV_SECRET": "k" * 32})
        assert config.role == role
        assert server.host == "0.0.0.0" and config.kv_listen_host == "0.0.0.0"  # the pod IP, not loopback
        assert "PDSERVE_KV_SECRET" in env(c)
        assert "10.0.0.0/8:5600" in config.kv_peer_allow  # decode: the hand-off; prefill: a peer's prefix
        assert config.kv_offloading_size == 2
