"""The plugins and policies by name: the built-in ones (`PLUGINS`, `PRESETS`) and those of
third-party packages (entry points). The one place that maps a configured name to its code."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from pdserve.router.policies.interfaces import Policy, PolicyContext
from pdserve.router.policies.profile import Profile

_M = "pdserve.router.policies"
# kind -> (module, {name: class}) of the built-in plugins.
_BUILT_IN = {
    "pool-filter": ("pool_filters", {"role": "RoleFilter", "health": "HealthFilter", "model": "ModelFilter",
                                     "revision": "RevisionFilter"}),
    "decider": ("decider", {"prompt-length": "PromptLength"}),
    "filter": ("filters", {"load-headroom": "LoadHeadroom", "lora-affinity": "LoRAAffinity"}),
    "scorer": ("scorers", {"load": "Load", "kv-usage": "KVUsage", "prefix-cache": "PrefixCache", "session": "Session"}),
    "picker": ("pickers", {"max-score": "MaxScore", "round-robin": "RoundRobin"}),
}
# (kind, name) -> "module:factory". Read-only: plugins come from entry points, not from mutation.
PLUGINS = {(kind, name): f"{_M}.{module}:{cls}"
           for kind, (module, classes) in _BUILT_IN.items() for name, cls in classes.items()}
PLUGIN_GROUP = "pdserve.router.plugins"
POLICY_GROUP = "pdserve.router.policies"


@dataclass(frozen=True)
class Preset:
    filters: tuple[str, ...] = ()
    scorers: tuple[str, ...] = ()
    picker: str = "max-score"


PRESETS = {
    "round-robin": Preset(picker="round-robin"),
    # Fewest in flight + waiting, then the emptier KV cache, then list order. An adapter's
    # requests prefer workers holding it among those not far busier than the idlest.
    "least-loaded": Preset(filters=("load-headroom", "lora-affinity"), scorers=("load", "kv-usage")),
    # Longest cached prefix among the workers not far busier than the idlest (holding the
    # request's adapter, if any), then least-loaded.
    "prefix-aware": Preset(filters=("load-headroom", "lora-affinity"), scorers=("prefix-cache", "load", "kv-usage")),
    # Rendezvous hashing of x-session-id (among the workers holding the request's adapter, if
    # any); least-loaded for requests without one.
    "session-affinity": Preset(filters=("lora-affinity",), scorers=("session", "load", "kv-usage")),
}


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def plugin(kind: str, name: str, ctx: PolicyContext) -> Any:
    if (kind, name) in PLUGINS:
        return _load(PLUGINS[kind, name])(ctx)
    eps = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == f"{kind}:{name}"]
    if not eps:
        known = sorted(n for k, n in PLUGINS if k == kind)
        raise ValueError(f"unknown {kind} plugin {name!r} (choose from {', '.join(known)})")
    return eps[0].load()(ctx)


def needs_kv_index(policy: str) -> bool:
    """Whether the policy scores by cached prefix (so the router must follow KV events)."""
    return policy in PRESETS and "prefix-cache" in PRESETS[policy].scorers


def available() -> list[str]:
    return sorted(set(PRESETS) | {ep.name for ep in entry_points(group=POLICY_GROUP)})


def create(name: str, ctx: PolicyContext) -> Policy:
    if name in PRESETS:
        p = PRESETS[name]
        return Profile([plugin("filter", n, ctx) for n in p.filters], [plugin("scorer", n, ctx) for n in p.scorers],
                       plugin("picker", p.picker, ctx))
    eps = [ep for ep in entry_points(group=POLICY_GROUP) if ep.name == name]
    if not eps:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(available())})")
    return eps[0].load()(ctx)
