"""Worker selection as a pipeline of small plugins, in the shape of llm-d's scheduler:

    known workers ─▶ pool filters (role, health, model, revision) ─▶ P/D decider
                 ─▶ per phase: filters ─▶ scorers, in priority order ─▶ picker ─▶ one worker

Every plugin is registered by kind and name (`PLUGINS`). A policy (`--policy`,
`--prefill-policy`, `--decode-policy`) names a preset profile of filters, scorers and a picker
(`PRESETS`). Scores are compared as tuples in scorer order: the first scorer decides, the next
breaks its ties, and the picker resolves what is left. Third-party plugins come through the
entry-point group `pdserve.router.plugins` (entry name "kind:name", value a factory taking a
`PolicyContext`); a third-party policy through `pdserve.router.policies` (a factory returning
an object with `choose(workers, request)`).
"""

from __future__ import annotations

import asyncio
import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from pdserve.router.kv_index import KVIndex
    from pdserve.router.workers import Worker

_M = "pdserve.router.policies"
# (kind, name) -> "module:factory". Read-only: plugins come from entry points, not from mutation.
PLUGINS = {
    ("pool-filter", "role"): f"{_M}.pool_filters:RoleFilter",
    ("pool-filter", "health"): f"{_M}.pool_filters:HealthFilter",
    ("pool-filter", "model"): f"{_M}.pool_filters:ModelFilter",
    ("pool-filter", "revision"): f"{_M}.pool_filters:RevisionFilter",
    ("decider", "prompt-length"): f"{_M}.decider:PromptLength",
    ("filter", "load-headroom"): f"{_M}.filters:LoadHeadroom",
    ("scorer", "load"): f"{_M}.scorers:Load",
    ("scorer", "kv-usage"): f"{_M}.scorers:KVUsage",
    ("scorer", "prefix-cache"): f"{_M}.scorers:PrefixCache",
    ("scorer", "session"): f"{_M}.scorers:Session",
    ("picker", "max-score"): f"{_M}.pickers:MaxScore",
    ("picker", "round-robin"): f"{_M}.pickers:RoundRobin",
}
PLUGIN_GROUP = "pdserve.router.plugins"
POLICY_GROUP = "pdserve.router.policies"


@dataclass(frozen=True)
class Preset:
    filters: tuple[str, ...] = ()
    scorers: tuple[str, ...] = ()
    picker: str = "max-score"


PRESETS = {
    "round-robin": Preset(picker="round-robin"),
    # Fewest in flight + waiting, then the emptier KV cache, then list order.
    "least-loaded": Preset(scorers=("load", "kv-usage")),
    # Longest cached prefix among the workers not far busier than the idlest, then least-loaded.
    "prefix-aware": Preset(filters=("load-headroom",), scorers=("prefix-cache", "load", "kv-usage")),
    # Rendezvous hashing of x-session-id; least-loaded for requests without one.
    "session-affinity": Preset(scorers=("session", "load", "kv-usage")),
}


@dataclass
class RoutingRequest:
    """What a plugin may look at. Token ids are computed only if a plugin asks for them."""

    body: dict
    session_id: str | None = None
    tokenize: Callable[[dict], list[int] | None] | None = None
    _tokens: list[int] | None = field(default=None, repr=False)
    _tokenized: bool = field(default=False, repr=False)

    async def tokenize_off_loop(self) -> None:
        """Compute the token ids on a thread now: the policies ask for them synchronously, and an
        8 MB prompt tokenized on the event loop would stall every other request and /health."""
        if self.tokenize and not self._tokenized:
            self._tokens = await asyncio.to_thread(self.tokenize, self.body)
            self._tokenized = True

    def token_ids(self) -> list[int] | None:
        if not self._tokenized:
            self._tokens = self.tokenize(self.body) if self.tokenize else None
            self._tokenized = True
        return self._tokens


@dataclass(frozen=True)
class PolicyContext:
    """Shared services and settings a plugin may need; one per router."""

    kv_index: KVIndex | None = None
    pd_min_prompt_tokens: int = 0
    pd_min_uncached_tokens: int = 0


@dataclass(frozen=True)
class PoolQuery:
    """Which workers may serve one phase of a request."""

    role: str  # "prefill" or "decode"
    model: str
    partners: Sequence[Worker] | None = None  # the other phase's workers: revisions must match one


class PoolFilter(Protocol):
    def filter(self, workers: Sequence[Worker], query: PoolQuery) -> list[Worker]: ...


class Decider(Protocol):
    def disaggregate(self, body: dict) -> bool:
        """Whether this request is worth a prefill worker (else the decode worker prefills)."""
        ...


class Filter(Protocol):
    def filter(self, workers: Sequence[Worker], request: RoutingRequest) -> list[Worker]:
        """A subset of `workers` (never empty when `workers` is not)."""
        ...


class Scorer(Protocol):
    def score(self, workers: Sequence[Worker], request: RoutingRequest) -> list[float]:
        """One score per worker, higher is better."""
        ...


class Picker(Protocol):
    def pick(self, workers: Sequence[Worker], scores: Sequence[tuple[float, ...]]) -> Worker: ...


class Policy(Protocol):
    def choose(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        """Pick one of `workers` (never empty, all routable)."""
        ...


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
    from pdserve.router.policies.profile import Profile

    if name in PRESETS:
        p = PRESETS[name]
        return Profile([plugin("filter", n, ctx) for n in p.filters], [plugin("scorer", n, ctx) for n in p.scorers],
                       plugin("picker", p.picker, ctx))
    eps = [ep for ep in entry_points(group=POLICY_GROUP) if ep.name == name]
    if not eps:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(available())})")
    return eps[0].load()(ctx)
