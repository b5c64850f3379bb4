"""prefix-aware: the worker holding the longest cached prefix of the prompt, load breaking ties.

The cached prefixes come from the workers' KV events (see kv_events.py and kv_index.py). A
worker whose queue is far longer than the least-loaded one's loses its cache advantage, so a
hot prefix cannot pile every request onto one worker.
"""

from __future__ import annotations

from typing import Sequence

from pdserve.router.policies import PolicyContext, RoutingRequest, pick_least_loaded
from pdserve.router.workers import Worker

# Extra load (requests) a cache hit may cost before least-loaded wins instead.
MAX_LOAD_IMBALANCE = 8


class PrefixAware:
    def __init__(self, ctx: PolicyContext):
        if ctx.kv_index is None:
            raise ValueError("prefix-aware needs the KV event index")
        self._index = ctx.kv_index

    def choose(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        tokens = request.token_ids()
        fallback = pick_least_loaded(workers)
        if not tokens:
            return fallback
        matched = self._index.match(tokens, [w.url for w in workers])
        best = max(workers, key=lambda w: (matched.get(w.url, 0), -w.load, -w.kv_usage))
        if matched.get(best.url, 0) == 0 or best.load - fallback.load > MAX_LOAD_IMBALANCE:
            return fallback
        return best
