"""Pickers: the final choice among scored candidates."""

from __future__ import annotations

import itertools
from typing import Sequence

from pdserve.router.policies.interfaces import PolicyContext
from pdserve.router.workers import Worker


class MaxScore:
    """The best score tuple; a full tie goes to the first in list order."""

    def __init__(self, ctx: PolicyContext):
        pass

    def pick(self, workers: Sequence[Worker], scores: Sequence[tuple[float, ...]]) -> Worker:
        return workers[max(range(len(workers)), key=scores.__getitem__)]


class RoundRobin:
    """Each pick takes the next of the best-scored workers in turn (all of them, unscored)."""

    def __init__(self, ctx: PolicyContext):
        self._counter = itertools.count()

    def pick(self, workers: Sequence[Worker], scores: Sequence[tuple[float, ...]]) -> Worker:
        if len(workers) == 1:  # (a turn is still taken: the rotation goes on as it would)
            next(self._counter)
            return workers[0]
        best = max(scores)
        # Sorting by URL keeps the rotation stable when discovery reorders the list.
        ordered = sorted((w for w, s in zip(workers, scores) if s == best), key=lambda w: w.url)
        return ordered[next(self._counter) % len(ordered)]
