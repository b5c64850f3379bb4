"""What the two halves of the KV connector tell each other once per engine step.

Scheduler side -> worker side (`KVConnectorMetadata`): orders. Decode side: the pulls to start
into blocks the scheduler just allocated, remote pins to release without reading (the request
never needed them), pulls to stop. Prefill side: the pins to make, advance, finish, cancel or
release in this worker's pin table. The engine hands the orders over twice a step: after
`schedule()` (admissions: pulls, streamed pins) and after the step's results (finished
prefills' pins, streamed progress), in both cases before any output of the step leaves the
engine, so a pin exists before its kv_transfer_params can reach a reader.

Worker side -> scheduler side (`KVConnectorOutput`, read at the start of the next step): which
pulls landed or failed, and which pinned requests the decode side is done with (released, or
expired), so the scheduler frees their blocks.
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


@dataclass(frozen=True)
class KVPin:
    """Hold `block_ids` for a remote reader under `token` (minted by the scheduler half, which
    puts it in the kv_transfer_params it hands out). `ready`: None for a finished prefill (every
    block readable); a count of computed leading blocks for a streamed one, pinned at admission."""

    request_id: str
    block_ids: list[int]
    token: str
    prompt_digest: str
    ready: int | None = None


@dataclass
class KVConnectorMetadata:
    # Decode side
    loads: list[KVLoad] = field(default_factory=list)
    releases: list[KVTransferParams] = field(default_factory=list)  # kv_transfer_params whose pins to free unread
    cancels: list[str] = field(default_factory=list)  # requests aborted mid-pull: stop their streamed pulls
    # Prefill side: this worker's pin table (mirrored on every tensor-parallel rank)
    pins: list[KVPin] = field(default_factory=list)
    advances: list[tuple[str, int]] = field(default_factory=list)  # (request, leading blocks now computed)
    # Streamed prefills whose step now running (or next) computes the rest of the prompt: their
    # readers learn that the hand-off lands within about one prefill step (connector.pull_landing).
    last_steps: list[str] = field(default_factory=list)
    finishes: list[tuple[str, int]] = field(default_factory=list)  # (streamed request, its first token)
    cancelled_pins: list[str] = field(default_factory=list)  # streamed prefills that will not finish for a reader
    unpins: list[tuple[str, str]] = field(default_factory=list)  # (request, token): pins nobody will read

    def __bool__(self) -> bool:
        return bool(self.loads or self.releases or self.cancels or self.pins or self.advances or self.last_steps
                    or self.finishes or self.cancelled_pins or self.unpins)


@dataclass
class KVConnectorOutput:
    finished_sending: list[str] = field(default_factory=list)  # pinned requests whose blocks may be freed
    finished_recving: list[str] = field(default_factory=list)  # pulls that landed
    failed_recving: list[str] = field(default_factory=list)  # pulls that failed: prefill the rest locally
    # Of those, streamed pulls stopped because the prefill was cancelled (or the request aborted
    # here): no first token will ever come. Any other failure may still see the prefill finish.
    stopped_recving: list[str] = field(default_factory=list)
    # Streamed hand-offs (landed or failed): the first token the prefill side sampled, once known.
    first_tokens: dict[str, int] = field(default_factory=dict)
