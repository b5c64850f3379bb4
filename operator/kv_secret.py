"""The KV side channel's shared secret, generated when the user names none.

Every prefill and decode worker of a ModelServing must hold the same value (they authenticate
each other with it), and a running worker read it once at start-up (env from a secretKeyRef).
So the value is made once and never changed by a reconcile: the Secret is created if missing
and otherwise only read, never applied (server-side apply of a fresh random value would rotate
it on every pass). It is owned by the ModelServing, so it goes with it.

If the Secret is deleted, the next reconcile makes a new one with a new uid; the uid is part
of the worker revision (naming.revision), so the workers roll to a revision that never pairs
with pods still holding the old value.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from kubernetes.client.rest import ApiException

from pdserve.operator import naming
from pdserve.operator.kube import Kube, owned_by
from pdserve.operator.spec import ModelServing, SpecError

# The worker refuses shorter secrets (worker/config.py); token_urlsafe(32) gives 43 characters.
MIN_LENGTH = 16


def build_kv_secret(ms: ModelServing, value: str) -> dict[str, Any]:
    ref = naming.kv_secret_ref(ms)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": naming.metadata(ms, "kv-secret", name=ref.name),
            "data": {ref.key: base64.b64encode(value.encode()).decode()}}


def new_value() -> str:
    return secrets.token_urlsafe(32)


def check_kv_secret(ms: ModelServing, obj: dict[str, Any]) -> str:
    """The uid of an existing generated Secret, if it is ours and usable; else a SpecError that
    says what to do (the timer retries, so fixing it needs no spec edit)."""
    ref = naming.kv_secret_ref(ms)
    where = f"spec.kvTransfer.secretRef is unset, so the operator manages Secret {ref.name}"
    if not owned_by(obj, ms.uid):
        owners = obj["metadata"].get("ownerReferences") or ()
        hint = ("it belongs to a deleted ModelServing of this name; the garbage collector removes it shortly"
                if any(o.get("kind") == naming.KIND for o in owners)
                else "set kvTransfer.secretRef to use it, or delete it")
        raise SpecError(f"{where}, but a Secret of that name exists that this ModelServing does not own: {hint}")
    raw = (obj.get("data") or {}).get(ref.key)
    if raw is None or len(base64.b64decode(raw)) < MIN_LENGTH:
        raise SpecError(f"{where}; its key {ref.key} is missing or shorter than {MIN_LENGTH} characters: "
                        f"delete the Secret and the operator makes a new one (the workers then roll)")
    return obj["metadata"]["uid"]


def ensure_kv_secret(kube: Kube, ms: ModelServing) -> str:
    """Create the generated Secret if missing; return its uid ("" when the user names a Secret:
    its value is theirs to manage, and the operator does not read it)."""
    if ms.spec.kv_secret is not None:
        return ""
    name = naming.kv_secret_ref(ms).name
    obj = kube.get("v1", "Secret", ms.namespace, name)
    if obj is None:
        try:
            obj = kube.create(build_kv_secret(ms, new_value()))
        except ApiException as e:
            if e.status != 409:
                raise
            # another reconcile created it between our read and create: use that one
            obj = kube.get("v1", "Secret", ms.namespace, name)
            if obj is None:
                raise
    return check_kv_secret(ms, obj)
