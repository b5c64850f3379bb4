"""KVTransport: how a decode worker's pull moves the blocks a prefill worker pinned.

Every prefill worker serves its pins on the side channel (side_channel.py: describe, lease,
progress, read, release); a transport is what moves the bytes once the side channel has
authorised a pull. Each transport is one module with one implementation of this interface,
registered by name in registry.py. The configured name (--kv-transfer) picks this worker's
transport; `kv_transfer_params` carry the prefill side's name, and the decode side reads with
the same transport when it has it, else with the base transport (registry.BASE), which every
prefill worker serves besides its own.

`conn` below is the worker's KVConnector: its cache (`blocks`, `cache`, `block_bytes`), side-
channel `auth`, pull `timeout` and tensor-parallel rank.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from pdserve.protocol.kv_transfer import KVTransferParams


class KVTransport(ABC):
    name: ClassVar[str]  # the --kv-transfer value and kv_transfer_params.transport
    # What --kv-stream-split auto means over it (connector_scheduler.resolve_split).
    stream_split: ClassVar[str] = "tail"
    # A reader leases blocks and READs them itself: lease and progress replies carry this
    # transport's metadata (`metadata`), and a streamed pull READs each chunk it is leased.
    leases: ClassVar[bool] = False
    # A streamed pull reads the blocks as one stream that follows the prefill (`open_stream`).
    streams: ClassVar[bool] = False

    @classmethod
    def start(cls, agent_name: str, cache: "torch.Tensor", block_bytes: int) -> "KVTransport":
        """This worker's instance over its cache shard (`agent_name`: unique per worker and rank)."""
        return cls()

    # -- prefill side ---------------------------------------------------------------------------

    def serve(self, conn) -> dict:
        """Side-channel ops this transport answers besides describe, lease, progress and release
        (op name -> handler(body) -> (reply, frames)); called once, when the side channel starts."""
        return {}

    def metadata(self) -> dict:
        """What a leaseholder needs to READ this cache (given only in reply to a lease)."""
        raise ValueError("this worker serves KV over TCP: use read")

    def tick(self, released: Callable[[str, str, int], bool]) -> None:
        """Side-channel thread, every poll: releases the transport itself carries (request id,
        token, bytes read)."""

    def close(self) -> None:
        pass

    # -- decode side, one rank each side ------------------------------------------------------------

    @abstractmethod
    def pull(self, conn, host: str, port: int, params: "KVTransferParams", indices: list[int], dst_blocks: list[int],
             digest: str, release: bool) -> int:
        """Read the computed remote blocks at `indices` into `dst_blocks`; bytes moved.
        `release`: the read also ends the pin (else the pin waits for an explicit release)."""

    def knows_peer(self, engine_id: str) -> bool:
        """Whether this reader holds the peer's metadata (else a lease asks for it)."""
        return True

    def read_layered(self, conn, params: "KVTransferParams", reply: dict, have: int, ready: int,
                     held: list[int], want: dict[int, int]) -> int:
        """`leases`: READ what a leased progress reply announces (connector._stream_pull)."""
        raise NotImplementedError

    def open_stream(self, conn, host: str, port: int, params: "KVTransferParams", indices: list[int],
                    dst_blocks: list[int], digest: str):
        """`streams`: a read of every block we lack that lands each as the prefill computes it;
        it has raise_if_failed(), result() (its bytes) and stop()."""
        raise NotImplementedError

    # -- decode side, either side tensor-parallel (tp_transfer.py) ----------------------------------

    @abstractmethod
    def pull_shard(self, conn, host: str, port: int, remote_rank: int, params: "KVTransferParams",
                   indices: list[int], dst_blocks: list[int], digest: str) -> int:
        """A remote rank's blocks that are byte for byte ours, into our blocks; the pin stays."""

    def staged_blocks(self, conn, per_block: int, num_blocks: int) -> int:
        """Blocks one staged read may cover (`per_block`: staged bytes per block)."""
        return max(1, num_blocks)

    @contextlib.contextmanager
    def staging_area(self, conn, nbytes: int):
        """(a uint8 area of `nbytes`, its slot or None: a slot has a stream the scatter runs on)."""
        import torch

        yield torch.empty(nbytes, dtype=torch.uint8, device=conn.cache.device), None

    @abstractmethod
    def pull_staged(self, conn, slot, host: str, params: "KVTransferParams", indices: list[int], digest: str,
                    staged: list, regions: "list[torch.Tensor]") -> int:
        """Whole remote blocks of each staged source (tp_transfer.Source) into its region of the
        staging area."""
