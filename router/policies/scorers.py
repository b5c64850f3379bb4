"""Scorers: one number per candidate, higher is better. A profile compares them in order."""

from __future__ import annotations

import hashlib
from typing import Sequence

from pdserve.router.policies.interfaces import PolicyContext, RoutingRequest
from pdserve.router.workers import Worker


class Load:
    """Fewer requests: this router's in-flight count (exact, instant) plus the worker's scraped
    `vllm:num_requests_waiting` (covers other routers' traffic)."""

    def __init__(self, ctx: PolicyContext):
        pass

    def score(self, workers: Sequence[Worker], request: RoutingRequest) -> list[float]:
        return [-w.load for w in workers]


class KVUsage:
    """Emptier KV cache (scraped `vllm:kv_cache_usage_perc`)."""

    def __init__(self, ctx: PolicyContext):
        pass

    def score(self, workers: Sequence[Worker], request: RoutingRequest) -> list[float]:
        return [-w.kv_usage for w in workers]


class PrefixCache:
    """Longer cached prefix of the prompt, in blocks, from the workers' KV events. Matching
    needs the prompt's token ids; without them (no tokenizer, a template error) every worker
    scores 0 and the next scorer decides."""

    def __init__(self, ctx: PolicyContext):
        if ctx.kv_index is None:
            raise ValueError("the prefix-cache scorer (prefix-aware) needs the KV event index")
        self._index = ctx.kv_index

    def score(self, workers: Sequence[Worker], request: RoutingRequest) -> list[float]:
        tokens = request.token_ids()
        if not tokens:
            return [0.0] * len(workers)
        matched = self._index.match(tokens, [w.url for w in workers])
        return [float(matched.get(w.url, 0)) for w in workers]


class Session:
    """Requests with the same `x-session-id` go to the same worker: rendezvous (highest random
    weight) hashing, so no table is kept and a leaving worker moves only its own sessions.
    Without the header every worker scores 0."""

    def __init__(self, ctx: PolicyContext):
        pass

    def score(self, workers: Sequence[Worker], request: RoutingRequest) -> list[float]:
        if not request.session_id:
            return [0.0] * len(workers)
        return [float(_weight(request.session_id, w.url)) for w in workers]


def _weight(session_id: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_id}\0{url}".encode(), digest_size=8).digest(), "big")
