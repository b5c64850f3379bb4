"""Deployments for the prefill workers, decode workers and the router (pure builders)."""

from __future__ import annotations

from typing import Any, Mapping

from pdserve.operator import naming
from pdserve.operator.spec import GPU_RESOURCE, ModelServing, RoleSpec

HTTP_PORT = 8000
KV_EVENTS_PORT = 5557  # the router's default; replays are served on the next port
MODEL_MOUNT = "/models"
# Big checkpoints take minutes to load: the startup probe allows 30 min before liveness counts.
STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 180


def model_argument(source: str) -> tuple[str, dict[str, Any] | None]:
    """`--model` value for a source, plus the read-only PVC volume it needs (if any)."""
    if source.startswith("hf://"):
        return source.removeprefix("hf://"), None
    if source.startswith("pvc://"):
        claim, _, path = source.removeprefix("pvc://").partition("/")
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return f"{MODEL_MOUNT}/{path}".rstrip("/"), volume
    return source, None


def worker_args(ms: ModelServing, role: str) -> list[str]:
    s, rs = ms.spec, ms.spec.role(role)
    model, _ = model_argument(s.source)
    args = ["--model", model, "--served-model-name", s.model_name, "--host", "0.0.0.0",
            "--port", str(HTTP_PORT), "--device", s.device, "--dtype", s.dtype, "--role", role,
            "--kv-transfer", s.kv_backend, "--kv-port", str(s.kv_port),
            "--tensor-parallel-size", str(rs.tensor_parallel_size)]
    if s.max_model_len is not None:
        args += ["--max-model-len", str(s.max_model_len)]
    if rs.max_num_seqs is not None:
        args += ["--max-num-seqs", str(rs.max_num_seqs)]
    r = s.router
    if "prefix-aware" in (r.policy, r.prefill_policy, r.decode_policy):
        # KV-cache-aware routing feeds on the workers' block events.
        args += ["--kv-events-port", str(KV_EVENTS_PORT)]
    return args + list(rs.args)


def quantities(resources: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Resources with every quantity as a string: server-side apply's typed schema (1.20)
    rejects a bare integer quantity with a 500."""
    return {kind: {k: str(v) for k, v in values.items()}
            for kind in ("limits", "requests") if (values := resources.get(kind))}


def worker_resources(ms: ModelServing, rs: RoleSpec) -> dict[str, Any]:
    """The user's resources, plus one GPU per tensor-parallel rank on cuda unless they set it."""
    limits = dict(rs.resources.get("limits") or {})
    if ms.spec.device == "cuda" and GPU_RESOURCE not in limits:
        limits[GPU_RESOURCE] = rs.tensor_parallel_size
    return quantities({**rs.resources, "limits": limits})


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures}


def _downward_env() -> list[dict[str, Any]]:
    # POD_IP lets a worker advertise where its KV blocks can be pulled from.
    return [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": p}}}
            for n, p in (("POD_IP", "status.podIP"), ("POD_NAME", "metadata.name"),
                         ("POD_NAMESPACE", "metadata.namespace"))]


def _secret_env(name: str, ref) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _scheduling(rs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rs.node_selector:
        out["nodeSelector"] = dict(rs.node_selector)
    if rs.tolerations:
        out["tolerations"] = [dict(t) for t in rs.tolerations]
    if rs.affinity:
        out["affinity"] = dict(rs.affinity)
    return out


def _deployment(ms: ModelServing, role: str, replicas: int | None, pod_labels: dict[str, str],
                pod_spec: dict[str, Any]) -> dict[str, Any]:
    meta = naming.metadata(ms, role)
    meta["labels"] = {**meta["labels"], **pod_labels}
    spec: dict[str, Any] = {
        "selector": {"matchLabels": naming.selector_labels(ms, role)},
        "template": {"metadata": {"labels": {**naming.labels(ms, role), **pod_labels}}, "spec": pod_spec},
    }
    # Left out when an autoscaler owns the count: server-side apply then leaves it alone.
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}


def build_worker_deployment(ms: ModelServing, role: str) -> dict[str, Any]:
    s, rs = ms.spec, ms.spec.role(role)
    _, model_volume = model_argument(s.source)
    env = _downward_env()
    if s.hf_token_secret:
        env.append(_secret_env("HF_TOKEN", s.hf_token_secret))
    env += [dict(e) for e in rs.env]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}]
    # NCCL/NIXL and the tokenizer's workers use /dev/shm, which a container caps at 64 MiB.
    volumes: list[dict[str, Any]] = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    if model_volume:
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
        volumes.append(model_volume)
    container = {
        "name": "worker",
        "image": s.image,
        "imagePullPolicy": s.image_pull_policy,
        "command": ["pdserve", "worker"],
        "args": worker_args(ms, role),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "kv", "containerPort": s.kv_port, "protocol": "TCP"}],
        "env": env,
        "resources": worker_resources(ms, rs),
        "volumeMounts": mounts,
        "startupProbe": _http_probe("/health", STARTUP_PERIOD_S, STARTUP_FAILURES),
        "readinessProbe": _http_probe("/health", 5, 3),
        "livenessProbe": _http_probe("/health", 10, 6),
    }
    pod_spec: dict[str, Any] = {"containers": [container], "volumes": volumes, **_scheduling(rs)}
    if s.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in s.image_pull_secrets]
    replicas = None if rs.autoscaling else rs.replicas
    return _deployment(ms, role, replicas, {naming.LABEL_REVISION: naming.revision(ms)}, pod_spec)


def router_args(ms: ModelServing) -> list[str]:
    r = ms.spec.router
    args = ["--host", "0.0.0.0", "--port", str(HTTP_PORT), "--discovery", "kubernetes",
            "--namespace", ms.namespace, "--selector", f"{naming.LABEL_MODELSERVING}={ms.name}"]
    for flag, value in (("--policy", r.policy), ("--prefill-policy", r.prefill_policy),
                        ("--decode-policy", r.decode_policy), ("--pd-min-prompt-tokens", r.pd_min_prompt_tokens)):
        if value is not None:
            args += [flag, str(value)]
    return args + list(r.args)


def build_router_deployment(ms: ModelServing) -> dict[str, Any]:
    s, r = ms.spec, ms.spec.router
    env = [dict(e) for e in r.env]
    if r.api_key_secret:
        env.insert(0, _secret_env("PDSERVE_API_KEYS", r.api_key_secret))
    container: dict[str, Any] = {
        "name": "router",
        "image": s.image,
        "imagePullPolicy": s.image_pull_policy,
        "command": ["pdserve", "router"],
        "args": router_args(ms),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "readinessProbe": _http_probe("/health", 5, 3),
        "livenessProbe": _http_probe("/health", 10, 6),
    }
    if env:
        container["env"] = env
    if r.resources:
        container["resources"] = quantities(r.resources)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": naming.child_name(ms, "router"),
        "containers": [container],
        **_scheduling(r),
    }
    if s.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in s.image_pull_secrets]
    return _deployment(ms, "router", r.replicas, {}, pod_spec)
