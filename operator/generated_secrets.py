"""Secrets the operator generates when the spec names none: the KV side channel's shared secret
and the workers' API key.

Each value must be the same in every pod that reads it (workers authenticate each other with
the KV secret; the router presents the API key the workers accept), and a running pod read it
once at start-up (env from a secretKeyRef). So a value is made once and never changed by a
reconcile: the Secret is created if missing and otherwise only read, never applied (server-side
apply of a fresh random value would rotate it on every pass). It is owned by the ModelServing,
so it goes with it.

If a generated Secret is deleted, the next reconcile makes a new one with a new uid, and the
uid rolls the pods that hold the old value: the KV secret's is part of the worker revision
(naming.revision), so old and new workers never pair; the API key's is a pod annotation on the
workers and the router (naming.ANNOTATION_WORKER_API_KEY_UID).
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from kubernetes.client.rest import ApiException

from pdserve.operator import naming
from pdserve.operator.kube import Kube, owned_by
from pdserve.operator.spec import ModelServing, SecretKeyRef, SpecError

# The worker refuses shorter KV secrets (worker/config/engine.py); token_urlsafe(32) gives 43 characters.
MIN_LENGTH = 16


@dataclass(frozen=True)
class GeneratedSecret:
    role: str  # the Secret's name suffix and component label: <ModelServing>-<role>
    spec_field: str  # what a user sets to bring their own Secret instead
    user_ref: Callable[[ModelServing], SecretKeyRef | None]
    ref: Callable[[ModelServing], SecretKeyRef]  # the user's, else the generated one


KV_SECRET = GeneratedSecret("kv-secret", "kvTransfer.secretRef", lambda ms: ms.spec.kv_secret, naming.kv_secret_ref)
WORKER_API_KEY = GeneratedSecret("worker-api-key", "workerApiKeySecret", lambda ms: ms.spec.worker_api_key_secret,
                                 naming.worker_api_key_ref)


def build_secret(ms: ModelServing, which: GeneratedSecret, value: str) -> dict[str, Any]:
    ref = which.ref(ms)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": naming.metadata(ms, which.role, name=ref.name),
            "data": {ref.key: base64.b64encode(value.encode()).decode()}}


def new_value() -> str:
    # URL-safe, so never a comma: PDSERVE_API_KEYS splits on commas.
    return secrets.token_urlsafe(32)


def check_secret(ms: ModelServing, which: GeneratedSecret, obj: dict[str, Any]) -> str:
    """The uid of an existing generated Secret, if it is ours and usable; else a SpecError that
    says what to do (the timer retries, so fixing it needs no spec edit)."""
    ref = which.ref(ms)
    where = f"spec.{which.spec_field} is unset, so the operator manages Secret {ref.name}"
    if not owned_by(obj, ms.uid):
        owners = obj["metadata"].get("ownerReferences") or ()
        hint = ("it belongs to a deleted ModelServing of this name; the garbage collector removes it shortly"
                if any(o.get("kind") == naming.KIND for o in owners)
                else f"set {which.spec_field} to use it, or delete it")
        raise SpecError(f"{where}, but a Secret of that name exists that this ModelServing does not own: {hint}")
    raw = (obj.get("data") or {}).get(ref.key)
    if raw is None or len(base64.b64decode(raw)) < MIN_LENGTH:
        raise SpecError(f"{where}; its key {ref.key} is missing or shorter than {MIN_LENGTH} characters: "
                        f"delete the Secret and the operator makes a new one (the pods then roll)")
    return obj["metadata"]["uid"]


def ensure_secret(kube: Kube, ms: ModelServing, which: GeneratedSecret) -> str:
    """Create the generated Secret if missing; return its uid ("" when the user names a Secret:
    its value is theirs to manage, and the operator does not read it)."""
    if which.user_ref(ms) is not None:
        return ""
    name = which.ref(ms).name
    obj = kube.get("v1", "Secret", ms.namespace, name)
    if obj is None:
        try:
            obj = kube.create(build_secret(ms, which, new_value()))
        except ApiException as e:
            if e.status != 409:
                raise
            # another reconcile created it between our read and create: use that one
            obj = kube.get("v1", "Secret", ms.namespace, name)
            if obj is None:
                raise
    return check_secret(ms, which, obj)
