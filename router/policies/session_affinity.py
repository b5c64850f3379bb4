"""session-affinity: requests carrying the same `x-session-id` header go to the same worker.

Rendezvous (highest-random-weight) hashing: no table to keep, and when a worker leaves only
its own sessions move. Requests without the header fall back to least-loaded.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from pdserve.router.policies import PolicyContext, RoutingRequest, pick_least_loaded
from pdserve.router.workers import Worker

HEADER = "x-session-id"


def _weight(session_id: str, url: str) -> bytes:
    return hashlib.blake2b(f"{session_id}\0{url}".encode(), digest_size=8).digest()


class SessionAffinity:
    def __init__(self, ctx: PolicyContext):
        pass

    def choose(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        if not request.session_id:
            return pick_least_loaded(workers)
        return max(workers, key=lambda w: _weight(request.session_id, w.url))
