"""round-robin: each pick takes the next worker in turn."""

from __future__ import annotations

import itertools
from typing import Sequence

from pdserve.router.policies import PolicyContext, RoutingRequest
from pdserve.router.workers import Worker


class RoundRobin:
    def __init__(self, ctx: PolicyContext):
        self._counter = itertools.count()

    def choose(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        # Sorting by URL keeps the rotation stable when discovery reorders the list.
        ordered = sorted(workers, key=lambda w: w.url)
        return ordered[next(self._counter) % len(ordered)]
