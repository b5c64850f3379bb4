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


class LoRAAffinity:
    """For a request naming a LoRA adapter: the workers that have it in a GPU slot already
    (running or queued requests use it: no swap, its matrices shared in the batch), else those
    with a free slot (loading it evicts nobody's adapter), else all of them; each tier among
    the workers that serve it, when a hand-off's pool also holds workers that would load it on
    demand (those are picked only when no worker serving it is left). Requests for the base
    model are not narrowed. After load-headroom in the presets, so a hot adapter does not pile
    onto one worker past the imbalance bound."""

    def __init__(self, ctx: PolicyContext):
        pass

    def filter(self, workers: Sequence[Worker], request: RoutingRequest) -> list[Worker]:
        adapter = request.request.model
        if not any(adapter in w.parents for w in workers):
            return list(workers)
        workers = [w for w in workers if adapter in w.parents or not w.models] or workers
        return ([w for w in workers if w.lora_active(adapter)]
                or [w for w in workers if w.lora_slot_free()] or list(workers))
