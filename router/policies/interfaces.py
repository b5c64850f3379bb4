"""What a routing plugin sees and what it is (router/policies/registry.py registers them): the
request and the router's shared services, and one Protocol per kind of plugin."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from pdserve.protocol.requests import GenerationRequest

if TYPE_CHECKING:
    from pdserve.router.kv_index import KVIndex
    from pdserve.router.workers import Worker


@dataclass
class RoutingRequest:
    """What a plugin may look at. Token ids are computed only if a plugin asks for them."""

    request: GenerationRequest  # as validated
    session_id: str | None = None
    tokenize: Callable[[GenerationRequest], list[int] | None] | None = None
    _tokens: list[int] | None = field(default=None, repr=False)
    _tokenized: bool = field(default=False, repr=False)

    async def tokenize_off_loop(self) -> None:
        """Compute the token ids on a thread now: the policies ask for them synchronously, and an
        8 MB prompt tokenized on the event loop would stall every other request and /health."""
        if self.tokenize and not self._tokenized:
            self._tokens = await asyncio.to_thread(self.tokenize, self.request)
            self._tokenized = True

    def token_ids(self) -> list[int] | None:
        if not self._tokenized:
            self._tokens = self.tokenize(self.request) if self.tokenize else None
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
    # The decode leg of a hand-off for a LoRA adapter: the adapter's base model. A worker of that
    # base that loads adapters on demand (Worker.lora_loading) may take it: the hand-off's params
    # say where the adapter comes from. None: only workers serving `model`.
    loads_for: str | None = None


class PoolFilter(Protocol):
    def filter(self, workers: Sequence[Worker], query: PoolQuery) -> list[Worker]: ...


class Decider(Protocol):
    def disaggregate(self, request: GenerationRequest) -> bool:
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
