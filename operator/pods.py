"""Pieces of the pods the operator runs, shared by the worker and router Deployments (pure).

Secure by default: pods run as a non-root user with the RuntimeDefault seccomp profile, no
privilege escalation, every capability dropped and a read-only root filesystem; what must be
writable (/tmp, the Hugging Face cache) is an emptyDir or the user's PVC.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from pdserve.operator import naming
from pdserve.operator.spec import KVTuning, ModelServing, ModelSource, SecretKeyRef
from pdserve.protocol.contract import ENV_KV_SECRET, HTTP_PORT_NAME

MODEL_MOUNT = "/models"  # a pvc:// source, read-only
CACHE_MOUNT = "/cache"  # the Hugging Face cache (HF_HOME) and pinned downloads
HF_HOME = f"{CACHE_MOUNT}/huggingface"
TOKENIZER_DIR = f"{CACHE_MOUNT}/tokenizer"
# The image's non-root user; fsGroup makes a fresh PVC cache writable by it.
RUN_AS = 1000
# What the worker fetches from the Hub (worker/models/loader.py) and what a tokenizer needs.
MODEL_FILES = "*.json,*.safetensors,*.model,*.jinja,*.txt"
TOKENIZER_FILES = "*.json,*.model,*.jinja,*.txt,*.tiktoken"
# Download once, then start from local files: huggingface_hub skips files already present.
_FETCH = ("import sys; from huggingface_hub import snapshot_download; "
          "snapshot_download(sys.argv[1], revision=sys.argv[2], local_dir=sys.argv[3], "
          "allow_patterns=sys.argv[4].split(','))")
# After SIGTERM the worker drains for --shutdown-grace, then uvicorn gets 5 s more to close;
# the rest is margin before the kubelet's SIGKILL.
SHUTDOWN_SLACK_S = 10


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(kv: KVTuning | None = None) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if kv is not None and kv.rdma_resource:
        caps["add"] = ["IPC_LOCK"]  # RDMA registers (locks) memory
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": caps}


def probe(path: str, defaults: Mapping[str, int], overrides: Mapping[str, int] | None) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": HTTP_PORT_NAME}, **defaults, **(overrides or {})}


def pre_stop(ms: ModelServing) -> dict[str, Any]:
    """Sleep before SIGTERM: the pod is already out of the Endpoints (it is terminating), so
    routers and Services stop sending it new requests before it stops accepting them."""
    return {"preStop": {"exec": {"command": ["sleep", str(ms.spec.drain_pre_stop_s)]}}}


def termination_grace_s(ms: ModelServing) -> int:
    return ms.spec.drain_pre_stop_s + ms.spec.drain_timeout_s + SHUTDOWN_SLACK_S


def merge_env(ours: Iterable[Mapping[str, Any]], users: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The user's variables win by name (server-side apply refuses duplicate names)."""
    out = {e["name"]: dict(e) for e in ours}
    out.update({e["name"]: dict(e) for e in users})
    return list(out.values())


def downward_env() -> list[dict[str, Any]]:
    # POD_IP lets a worker advertise where its KV blocks can be pulled from.
    return [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": p}}}
            for n, p in (("POD_IP", "status.podIP"), ("POD_NAME", "metadata.name"),
                         ("POD_NAMESPACE", "metadata.namespace"))]


def hub_env(ms: ModelServing) -> list[dict[str, Any]]:
    """HOME and caches on writable volumes (the root filesystem is read-only), and the token."""
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": HF_HOME}]
    if ms.spec.hf_token_secret:
        env.append(secret_env("HF_TOKEN", ms.spec.hf_token_secret))
    return env


def kv_env(ms: ModelServing, kv: KVTuning) -> list[dict[str, Any]]:
    """UCX settings, and the side channel's shared secret: always set (the user's Secret or the
    generated one), as an env var from a secretKeyRef (arguments are visible in the process
    list, and the pod template names the Secret, not its value)."""
    env = [{"name": n, "value": v} for n, v in (("UCX_TLS", kv.ucx_tls), ("UCX_NET_DEVICES", kv.ucx_net_devices)) if v]
    env.append(secret_env(ENV_KV_SECRET, naming.kv_secret_ref(ms)))
    return env


def tracing_env(ms: ModelServing, role: str) -> list[dict[str, Any]]:
    """spec.tracing as the OpenTelemetry SDK's variables (the endpoint is a flag: tracing_args):
    the protocol, the sampler (a client's sampled traceparent is followed; a request without
    one is sampled at the ratio) and which ModelServing and role a span comes from."""
    t = ms.spec.tracing
    if t is None:
        return []
    return [{"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": t.protocol},
            {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
            {"name": "OTEL_TRACES_SAMPLER_ARG", "value": str(t.sampling_ratio)},
            {"name": "OTEL_RESOURCE_ATTRIBUTES",
             "value": f"k8s.namespace.name={ms.namespace},pdserve.modelserving={ms.name},pdserve.role={role}"}]


def tracing_args(ms: ModelServing) -> list[str]:
    t = ms.spec.tracing
    return [] if t is None else ["--otlp-traces-endpoint", t.endpoint]


def secret_env(name: str, ref: SecretKeyRef) -> dict[str, Any]:
    """An env var from a Secret key: the pod template names the Secret, never holds its value."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    return {"name": "tmp", "emptyDir": {}}, {"name": "tmp", "mountPath": "/tmp"}


def cache_volume(ms: ModelServing) -> tuple[dict[str, Any], dict[str, Any]]:
    """The user's PVC (shared across pods and restarts), else an emptyDir (survives container
    restarts, not rescheduling) capped at model.cache.sizeLimit."""
    s = ms.spec
    if s.cache_claim:
        volume = {"name": "cache", "persistentVolumeClaim": {"claimName": s.cache_claim}}
    else:
        volume = {"name": "cache", "emptyDir": {"sizeLimit": s.cache_size} if s.cache_size else {}}
    return volume, {"name": "cache", "mountPath": CACHE_MOUNT}


def model_pvc_volume(src: ModelSource) -> tuple[dict[str, Any], dict[str, Any]]:
    return ({"name": "model", "persistentVolumeClaim": {"claimName": src.claim, "readOnly": True}},
            {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})


def pinned_dir(src: ModelSource) -> str:
    return f"{CACHE_MOUNT}/models/{src.repo}/{src.revision}"


def fetch_container(ms: ModelServing, name: str, src: ModelSource, dest: str, files: str,
                    mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """An init container that downloads a pinned revision into `dest` (the worker engine has no
    revision flag: it is then started from the local directory)."""
    return {
        "name": name, "image": ms.spec.image, "imagePullPolicy": ms.spec.image_pull_policy,
        "command": ["python", "-c", _FETCH, src.repo, src.revision, dest, files],
        "env": hub_env(ms), "volumeMounts": mounts, "securityContext": container_security_context(),
    }


def model_argument(ms: ModelServing) -> str:
    """The worker's --model for the source."""
    src = ms.spec.model_source
    if src.kind == "hf":
        return pinned_dir(src) if src.revision else src.repo
    if src.kind == "pvc":
        return f"{MODEL_MOUNT}/{src.path}".rstrip("/")
    return src.path


def tokenizer_argument(ms: ModelServing) -> str:
    """The router's --tokenizer for the source (prefix-aware hashes the prompt's token ids)."""
    src = ms.spec.model_source
    if src.kind == "hf":
        return TOKENIZER_DIR if src.revision else src.repo
    return model_argument(ms)
