"""least-loaded: the worker with the fewest requests in flight plus waiting in its queue.

In-flight counts are this router's own (exact, instant); `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc` come from the background scrape and cover other routers' traffic.
"""

from __future__ import annotations

from typing import Sequence

from pdserve.router.policies import PolicyContext, RoutingRequest, pick_least_loaded
from pdserve.router.workers import Worker


class LeastLoaded:
    def __init__(self, ctx: PolicyContext):
        pass

    def choose(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return pick_least_loaded(workers)
