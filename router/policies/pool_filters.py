"""Pool filters: which workers may serve a phase at all (role, health, model, revision)."""

from __future__ import annotations

import time
from typing import Sequence

from pdserve.router.policies.interfaces import PolicyContext, PoolQuery
from pdserve.router.workers import Worker


class RoleFilter:
    def __init__(self, ctx: PolicyContext):
        pass

    def filter(self, workers: Sequence[Worker], query: PoolQuery) -> list[Worker]:
        return [w for w in workers if w.role == query.role]


class HealthFilter:
    """Probed healthy and not ejected for recent failures."""

    def __init__(self, ctx: PolicyContext):
        pass

    def filter(self, workers: Sequence[Worker], query: PoolQuery) -> list[Worker]:
        now = time.monotonic()
        return [w for w in workers if w.routable(now)]


class ModelFilter:
    """Serves the requested model (a worker not probed yet for its models is not excluded); for a
    hand-off's decode leg, also loads the adapter on demand (PoolQuery.loads_for)."""

    def __init__(self, ctx: PolicyContext):
        pass

    def filter(self, workers: Sequence[Worker], query: PoolQuery) -> list[Worker]:
        base = query.loads_for
        return [w for w in workers if not w.models or query.model in w.models
                or (base is not None and w.lora_loading and base in w.models)]


class RevisionFilter:
    """Shares a spec revision with at least one partner, so a rolling update never pairs a
    prefill and a decode worker whose KV layouts may differ. Unlabelled workers pair with all."""

    def __init__(self, ctx: PolicyContext):
        pass

    def filter(self, workers: Sequence[Worker], query: PoolQuery) -> list[Worker]:
        if query.partners is None:
            return list(workers)
        revisions = {p.revision for p in query.partners}
        if not revisions:  # no partner at all: nothing to pair with
            return []
        if None in revisions:  # an unlabelled partner pairs with every worker
            return list(workers)
        return [w for w in workers if w.revision is None or w.revision in revisions]
