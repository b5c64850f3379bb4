"""Worker-selection policies: a small Protocol and a registry keyed by name.

Built-in policies live one per module here. Third-party policies plug in through the
`pdserve.router.policies` entry-point group (name -> a factory taking a `PolicyContext`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from pdserve.router.kv_index import KVIndex
    from pdserve.router.workers import Worker

# name -> "module:factory". Read-only: plugins come from entry points, not from mutation.
BUILTIN = {
    "round-robin": "pdserve.router.policies.round_robin:RoundRobin",
    "least-loaded": "pdserve.router.policies.least_loaded:LeastLoaded",
    "prefix-aware": "pdserve.router.policies.prefix_aware:PrefixAware",
    "session-affinity": "pdserve.router.policies.session_affinity:SessionAffinity",
}
ENTRY_POINT_GROUP = "pdserve.router.policies"


@dataclass
class RoutingRequest:
    """What a policy may look at. Token ids are computed only if a policy asks for them."""

    body: dict
    session_id: str | None = None
    tokenize: Callable[[dict], list[int] | None] | None = None
    _tokens: list[int] | None = field(default=None, repr=False)
    _tokenized: bool = field(default=False, repr=False)

    def token_ids(self) -> list[int] | None:
        if not self._tokenized:
            self._tokens = self.tokenize(self.body) if self.tokenize else None
            self._tokenized = True
        return self._tokens


@dataclass(frozen=True)
class PolicyContext:
    """Shared services a policy may need; one per router."""

    kv_index: KVIndex | None = None


class Policy(Protocol):
    def choose(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        """Pick one of `workers` (never empty, all routable)."""
        ...


def available() -> list[str]:
    return sorted(set(BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def create(name: str, ctx: PolicyContext) -> Policy:
    target: Any
    if name in BUILTIN:
        module, _, attr = BUILTIN[name].partition(":")
        target = getattr(importlib.import_module(module), attr)
    else:
        eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not eps:
            raise ValueError(f"unknown policy {name!r} (choose from {', '.join(available())})")
        target = eps[0].load()
    return target(ctx)


def pick_least_loaded(workers: Sequence[Worker]) -> Worker:
    """The shared tie-breaker: fewest in-flight + waiting, then lowest KV usage, then list order."""
    return min(workers, key=lambda w: (w.load, w.kv_usage))
