"""Strategic merge of a user's `podTemplate` over the pod the operator built (pure).

The same rules as `kubectl patch --type strategic` for the pod fields people override:
mappings merge key by key (a null value deletes the key); lists of named things merge by their
merge key (containers by name, env by name, volumes by name, volumeMounts by mountPath, ports
by containerPort, …), an item with `$patch: delete` removes its match; every other list
(args, command, tolerations, …) is replaced whole. This lets a user add a sidecar, a volume,
an annotation for a secondary network, a priorityClassName or topologySpreadConstraints, or
change one container's env, without restating the operator's pod.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

# field name -> the key its list items are matched on (Kubernetes' patchMergeKey)
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
}
DELETE = {"$patch": "delete"}


def strategic_merge(base: Any, patch: Any, field: str | None = None) -> Any:
    """`base` with `patch` merged in; neither argument is modified."""
    if isinstance(base, Mapping) and isinstance(patch, Mapping):
        out = {k: copy.deepcopy(v) for k, v in base.items()}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = _strip(copy.deepcopy(value))
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        return _merge_list(base, patch, MERGE_KEYS[field], field)
    return _strip(copy.deepcopy(patch))


def _merge_list(base: list, patch: list, key: str, field: str) -> list:
    out = [copy.deepcopy(item) for item in base]
    for item in patch:
        if not isinstance(item, Mapping) or key not in item:
            raise ValueError(f"podTemplate: every item of {field} needs its merge key {key!r}")
        at = next((i for i, old in enumerate(out) if old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append(_strip(copy.deepcopy(dict(item))))
        else:
            out[at] = strategic_merge(out[at], item, field)
    return out


def _strip(value: Any) -> Any:
    """Directives never reach the API server."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "$patch"}
    if isinstance(value, list):
        return [_strip(v) for v in value if v != DELETE]
    return value
