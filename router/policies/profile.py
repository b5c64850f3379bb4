"""One phase's choice among its candidate workers: filters, then scorers, then the picker."""

from __future__ import annotations

from typing import Sequence

from pdserve.router.policies.interfaces import Filter, Picker, RoutingRequest, Scorer
from pdserve.router.workers import Worker


class Profile:
    def __init__(self, filters: list[Filter], scorers: list[Scorer], picker: Picker):
        self.filters, self.scorers, self.picker = filters, scorers, picker

    def choose(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        candidates = list(workers)
        for f in self.filters:
            # A profile filter states a preference: it may narrow the choice, never empty it.
            candidates = f.filter(candidates, request) or candidates
        columns = [s.score(candidates, request) for s in self.scorers]
        scores = list(zip(*columns)) if columns else [()] * len(candidates)
        return self.picker.pick(candidates, scores)
