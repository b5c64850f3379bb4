"""One step's work, as the scheduler hands it to the model runner: which requests, how many new
tokens each, and the KV connector's instructions for the step. A module of its own because both
sides read it: the model runner depends on this value, never on the scheduler that builds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.worker.kv.connector_meta import KVConnectorMetadata
from pdserve.worker.request.request import Request


@dataclass
class ScheduledBatch:
    # (request, number of new tokens to compute this step), decode-like (1 token) ones first.
    items: list[tuple[Request, int]] = field(default_factory=list)
    kv_connector_metadata: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)
    # The host KV tier's block copies (engine/host_tier_index.py TierCopy), in the order the
    # runner carries them out, before this step's forward.
    kv_tier_ops: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)
