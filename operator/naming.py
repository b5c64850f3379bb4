"""Names, labels, owner references and the worker revision of a ModelServing's children.

Children have fixed names derived from the ModelServing's name, so every reconcile (and a
restarted operator) addresses the same objects: there is nothing to duplicate.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdserve.operator.spec import ModelServing, SecretKeyRef
from pdserve.protocol.contract import ROLE_PREFILL
# The labels the router selects and pairs workers by: defined once, with the router's side.
from pdserve.protocol.contract import LABEL_MODELSERVING, LABEL_REVISION, LABEL_ROLE  # noqa: F401

GROUP = "pdserve.io"
VERSION = "v1alpha1"
KIND = "ModelServing"
PLURAL = "modelservings"

MANAGED_BY = "pdserve-operator"
FIELD_MANAGER = "pdserve-operator"
KV_SECRET_KEY = "kv-secret"
WORKER_API_KEY_KEY = "api-key"
# On worker and router pod templates: the generated worker API key Secret's uid, so a re-created
# Secret (a new value) restarts every pod that read the old one at start-up.
ANNOTATION_WORKER_API_KEY_UID = "pdserve.io/worker-api-key-uid"


def child_name(ms: ModelServing, role: str) -> str:
    return f"{ms.name}-{role}"


KV_PORT_NAME = "kv"


def kv_ports(ms: ModelServing, role: str) -> list[tuple[str, int]]:
    """(name, number) of the KV side-channel ports a worker of this role opens: rank r of a
    prefill worker serves its cache shard on kvTransfer.port + r, so a TP=N prefill worker has N
    (`kv`, `kv-1`, … `kv-63`: within the 15-character port-name limit at the CRD's TP ≤ 64).
    Decode workers only dial out; they keep the one `kv` port they always declared."""
    n = ms.spec.role(role).tensor_parallel_size if role == ROLE_PREFILL else 1
    return [(KV_PORT_NAME if r == 0 else f"{KV_PORT_NAME}-{r}", ms.spec.kv_port + r) for r in range(n)]


def kv_secret_ref(ms: ModelServing) -> SecretKeyRef:
    """The Secret key every worker reads PDSERVE_KV_SECRET from: the user's
    kvTransfer.secretRef, else the one the operator generates (operator/generated_secrets.py)."""
    return ms.spec.kv_secret or SecretKeyRef(child_name(ms, "kv-secret"), KV_SECRET_KEY)


def worker_api_key_ref(ms: ModelServing) -> SecretKeyRef:
    """The Secret key holding the one API key workers accept (PDSERVE_API_KEYS) and the router
    presents to them (PDSERVE_WORKER_API_KEY): the user's workerApiKeySecret, else the one the
    operator generates."""
    return ms.spec.worker_api_key_secret or SecretKeyRef(child_name(ms, "worker-api-key"), WORKER_API_KEY_KEY)


def selector_labels(ms: ModelServing, role: str) -> dict[str, str]:
    """The Deployment selector: immutable, so it never carries the revision."""
    return {LABEL_MODELSERVING: ms.name, LABEL_ROLE: role}


def labels(ms: ModelServing, role: str) -> dict[str, str]:
    return {
        **selector_labels(ms, role),
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": ms.name,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def owner_reference(ms: ModelServing) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": ms.name,
        "uid": ms.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(ms: ModelServing, role: str, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or child_name(ms, role),
        "namespace": ms.namespace,
        "labels": labels(ms, role),
        "ownerReferences": [owner_reference(ms)],
    }


def revision(ms: ModelServing) -> str:
    """Hash of everything that decides whether a prefill and a decode worker can exchange KV.

    Both roles carry the same revision: the router pairs only workers of one revision, so a
    rollout never hands KV blocks across incompatible layouts (model, dtype, quantization, KV
    cache dtype, context length, image, transfer backend and secret, TP degrees, extra engine args). The secret
    counts by its
    Secret's name and key, plus the generated Secret's uid (a re-created Secret holds a new
    value). Replica counts, resources, env and scheduling fields roll pods out without changing it.
    """
    s = ms.spec
    relevant = {
        "source": s.source,
        "dtype": s.dtype,
        "maxModelLen": s.max_model_len,
        "image": s.image,
        "device": s.device,
        # old and new workers of one revision must still authenticate each other
        "kv": [s.kv_backend, s.kv_port, kv_secret_ref(ms).name, kv_secret_ref(ms).key, ms.kv_secret_uid],
        "tp": [s.prefill.tensor_parallel_size, s.decode.tensor_parallel_size],
        # extra args may set anything the engine reads (block size, quantization, ...)
        "args": [list(s.prefill.args), list(s.decode.args)],
    }
    # Set only when not the default, so adding them left every existing revision as it was.
    if s.kv_cache_dtype != "auto":
        relevant["kvCacheDtype"] = s.kv_cache_dtype
    if s.quantization != "none":
        relevant["quantization"] = s.quantization
    digest = hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()
    return digest[:10]
