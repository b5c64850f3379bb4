"""What the two halves of the KV connector tell each other once per engine step.

Scheduler side -> worker side (`KVConnectorMetadata`, built at the end of `schedule()`): the
pulls to start into blocks the scheduler just allocated, and remote pins to release without
reading (the request never needed them). Worker side -> scheduler side (`KVConnectorOutput`,
read at the start of the next step): which pulls landed or failed, and which pinned requests
the decode side is done with (released, or expired), so the scheduler frees their blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.protocol.kv_transfer import KVTransferParams


@dataclass(frozen=True)
class KVLoad:
    request_id: str
    params: KVTransferParams  # the prefill worker's kv_transfer_params, parsed
    indices: list[int]  # positions in params.remote_block_ids to read
    dst_blocks: list[int]  # our block ids, one per index
    prompt_digest: str  # of this request's prompt: the prefill side serves only blocks computed from it


@dataclass
class KVConnectorMetadata:
    loads: list[KVLoad] = field(default_factory=list)
    releases: list[KVTransferParams] = field(default_factory=list)  # kv_transfer_params whose pins to free unread
    cancels: list[str] = field(default_factory=list)  # requests aborted mid-pull: stop their streamed pulls

    def __bool__(self) -> bool:
        return bool(self.loads or self.releases or self.cancels)


@dataclass
class KVConnectorOutput:
    finished_sending: list[str] = field(default_factory=list)  # pinned requests whose blocks may be freed
    finished_recving: list[str] = field(default_factory=list)  # pulls that landed
    failed_recving: list[str] = field(default_factory=list)  # pulls that failed: prefill the rest locally
    # Streamed hand-offs (landed or failed): the first token the prefill side sampled, once known.
    first_tokens: dict[str, int] = field(default_factory=dict)
