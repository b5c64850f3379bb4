"""The router's selection pipeline, assembled from plugins: pool filters, the P/D decider, and
one profile per phase (see policies/__init__.py for the shape)."""

from __future__ import annotations

import time
from typing import Sequence

from pdserve.protocol.contract import ROLE_DECODE, ROLE_PREFILL
from pdserve.protocol.requests import GenerationRequest
from pdserve.router.config import RouterConfig
from pdserve.router.policies import PolicyContext, PoolQuery, RoutingRequest, create, plugin
from pdserve.router.policies.decider import DecodePrefix
from pdserve.router.policies.pool_filters import HealthFilter, ModelFilter, RevisionFilter, RoleFilter
from pdserve.router.workers import Worker, WorkerSet

POOL_FILTERS = ("role", "health", "model", "revision")
_BUILT_IN = (RoleFilter, HealthFilter, ModelFilter, RevisionFilter)
DECIDER = "prompt-length"


class Selector:
    def __init__(self, config: RouterConfig, ctx: PolicyContext, workers: WorkerSet):
        self.workers = workers
        self.kv_index = ctx.kv_index  # who caches which prefix (KV events), when anything reads it
        self.pool_filters = [plugin("pool-filter", name, ctx) for name in POOL_FILTERS]
        # The built-in filters (none replaced by a third-party plugin): a request's pools, asked
        # for a few times per request, are one pass over the workers (`pool`).
        self._built_in = tuple(type(f) for f in self.pool_filters) == _BUILT_IN
        self.decider = plugin("decider", DECIDER, ctx)
        self.decode_prefix = DecodePrefix(ctx)
        self.profiles = {ROLE_PREFILL: create(config.prefill_policy, ctx),
                         ROLE_DECODE: create(config.decode_policy, ctx)}

    def pool(self, role: str, model: str, partners: Sequence[Worker] | None = None,
             handoff: bool = False) -> list[Worker]:
        """The workers that may serve `role` for `model`, paired by revision with `partners`.
        `handoff`: the decode leg of a P/D hand-off, whose params carry a LoRA adapter's source:
        workers that load it on demand qualify too."""
        if self._built_in and not handoff:
            # What the role, health and model filters keep, in one pass; then the revision filter.
            now = time.monotonic()
            pool = [w for w in self.workers.all()
                    if w.role == role and w.routable(now) and (not w.models or model in w.models)]
            if partners is None:  # (the revision filter keeps every worker)
                return pool
            return self.pool_filters[-1].filter(pool, PoolQuery(role, model, partners, None))
        candidates = self.workers.all()
        base = None
        if handoff:  # `model` an adapter: the base its servers list it under
            base = next((w.parents[model] for w in candidates if model in w.parents), None)
        query = PoolQuery(role, model, partners, base)
        for f in self.pool_filters:
            candidates = f.filter(candidates, query)
        return candidates

    def pools(self, model: str) -> tuple[list[Worker], list[Worker]]:
        """`(pool(ROLE_PREFILL, model), pool(ROLE_DECODE, model))`, with the built-in filters in one
        pass over the workers (a request asks for both, fallback.py)."""
        if not self._built_in:
            return self.pool(ROLE_PREFILL, model), self.pool(ROLE_DECODE, model)
        now = time.monotonic()
        prefill, decode = [], []
        for w in self.workers.all():
            if w.routable(now) and (not w.models or model in w.models):
                if w.role == ROLE_DECODE:
                    decode.append(w)
                elif w.role == ROLE_PREFILL:
                    prefill.append(w)
        return prefill, decode

    def disaggregate(self, request: GenerationRequest) -> bool:
        return self.decider.disaggregate(request)

    def decode_covers(self, request: RoutingRequest, decode_pool: Sequence[Worker]) -> bool:
        """Whether the decode worker the decode policy picks caches nearly all of the prompt
        (`--pd-min-uncached-tokens`): then it serves the request whole, no prefill worker."""
        if not self.decode_prefix.min_uncached or not decode_pool:
            return False
        return self.decode_prefix.covers(request, self.choose(ROLE_DECODE, decode_pool, request))

    def choose(self, role: str, candidates: Sequence[Worker], request: RoutingRequest) -> Worker:
        return self.profiles[role].choose(candidates, request)
