"""Profile filters: preferences that narrow a phase's candidates before scoring."""

from __future__ import annotations

from typing import Sequence

from pdserve.router.policies.interfaces import PolicyContext, RoutingRequest
from pdserve.router.workers import Worker

# Extra load (requests) a worker may carry over the idlest one and still be considered. It keeps
# a hot prefix from piling every request onto the one worker that caches it.
MAX_LOAD_IMBALANCE = 8


class LoadHeadroom:
    def __init__(self, ctx: PolicyContext, max_imbalance: float = MAX_LOAD_IMBALANCE):
        self.max_imbalance = max_imbalance

    def filter(self, workers: Sequence[Worker], request: RoutingRequest) -> list[Worker]:
        if not workers:
            return []
        floor = min(w.load for w in workers)
        return [w for w in workers if w.load - floor <= self.max_imbalance]
