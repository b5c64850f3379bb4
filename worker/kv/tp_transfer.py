"""KV transfer between tensor-parallel workers: which prefill rank holds each of our KV heads.

A worker of TP size N keeps, on rank r, the paged cache of the KV heads `kv_head_range(KV, N, r)`
(parallel/shard.py), laid out [block, layer, k|v, token, head, dim]. Every rank uses the same
block ids (rank 0 schedules), and every rank of a prefill worker serves its own shard on
`--kv-port + r` with the same secret and a mirror of rank 0's pins (tp_link.py).

A decode rank needs exactly its own heads. `kv_sources` says where each lives:
- same TP (or the same heads, e.g. a replicated head): one source, the whole block, read straight
  into our blocks (one descriptor per run of blocks, as at TP = 1);
- otherwise the heads are not contiguous in a block, so whole remote blocks (contiguous, fast)
  are read into a staging area (a region per source) and the heads we hold are scattered into
  our blocks with one indexed copy: decode TP=1 from prefill TP=2 reads both prefill ranks and
  interleaves their heads; decode TP=2 from prefill TP=1 reads the full-head block and keeps its
  slice. The transport provides the area (KVTransport.staging_area): NIXL a slot of its
  StagingPool (staging.py: registered once, reused, one pull at a time, a pull longer than a
  slot's cap in chunks), every source's READ posted before the first is waited for; TCP a plain
  tensor per pull.

When either side has TP > 1 a read does not release the prefill pin: several decode ranks may
read one prefill rank. Decode rank 0 releases every prefill rank's pin once all decode ranks
have landed (or failed) their pulls (connector.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from pdserve.worker.parallel.shard import check_kv_heads, kv_head_range
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.protocol.kv_transfer import KVTransferParams
    from pdserve.worker.kv.transport import KVTransport


@dataclasses.dataclass(frozen=True)
class TPRank:
    """Where this worker process sits: rank `rank` of `size`, of a model with `num_kv_heads` KV heads."""

    rank: int = 0
    size: int = 1
    num_kv_heads: int = 0

    @property
    def heads(self) -> range:
        return kv_head_range(self.num_kv_heads, self.size, self.rank)


@dataclasses.dataclass(frozen=True)
class Source:
    """One prefill rank to read from: positions of heads in its blocks -> positions in ours."""

    remote_rank: int
    remote_heads: list[int]  # head positions within the remote rank's block
    local_heads: list[int]  # where they go within our block
    remote_num_heads: int  # heads per remote block (its block bytes = this x bytes per head)
    local_num_heads: int

    @property
    def direct(self) -> bool:
        """The remote block is byte for byte the block we need: read into our cache directly."""
        n = self.local_num_heads
        return self.remote_num_heads == n and self.remote_heads == self.local_heads == list(range(n))


def remote_tp_size(params: KVTransferParams) -> int:
    return params.kv_tp_size  # checked by the parse (protocol/kv_transfer.py)


def kv_sources(num_kv_heads: int, remote_size: int, local: TPRank) -> list[Source]:
    """The prefill ranks (of `remote_size`) holding our heads, and which head goes where."""
    if not check_kv_heads(num_kv_heads, remote_size):
        raise ValueError(f"the prefill worker's tensor-parallel size {remote_size} cannot shard this model's "
                         f"{num_kv_heads} KV heads; its KV layout is not one this worker can read")
    remote = [kv_head_range(num_kv_heads, remote_size, p) for p in range(remote_size)]
    mine = local.heads
    picked: dict[int, tuple[list[int], list[int]]] = {}
    for j, h in enumerate(mine):
        holders = [p for p in range(remote_size) if h in remote[p]]
        # A replicated head: read it from the matching rank if that holds it, else spread readers.
        p = local.rank if local.rank in holders else holders[local.rank % len(holders)]
        src, dst = picked.setdefault(p, ([], []))
        src.append(remote[p].index(h))
        dst.append(j)
    return [Source(p, src, dst, len(remote[p]), len(mine)) for p, (src, dst) in sorted(picked.items())]


def pull_shards(conn, host: str, params: KVTransferParams, indices: list[int], dst_blocks: list[int], digest: str,
                transport: KVTransport) -> int:
    """Decode rank: pull our heads of the remote blocks at `indices` into `dst_blocks`. Returns
    bytes moved. `conn` is this rank's KVConnector (its cache, auth, timeout)."""
    sources = kv_sources(conn.tp.num_kv_heads, remote_tp_size(params), conn.tp)
    head_bytes = conn.block_bytes // conn.cache.shape[4]
    nbytes = 0
    for s in (s for s in sources if s.direct):
        nbytes += transport.pull_shard(conn, host, params.remote_port + s.remote_rank, s.remote_rank, params, indices,
                                       dst_blocks, digest)
    staged = [s for s in sources if not s.direct]
    if not staged:
        return nbytes
    per_block = sum(head_bytes * s.remote_num_heads for s in staged)  # staged bytes per block, all sources
    chunk = transport.staged_blocks(conn, per_block, len(dst_blocks))
    for i in range(0, len(dst_blocks), chunk):
        nbytes += _pull_staged(conn, host, params, indices[i:i + chunk], dst_blocks[i:i + chunk], digest, transport,
                               staged, head_bytes)
    return nbytes


def _pull_staged(conn, host: str, params: KVTransferParams, indices: list[int], dst_blocks: list[int], digest: str,
                 transport: KVTransport, staged: list[Source], head_bytes: int) -> int:
    """Whole remote blocks of every staged source into one staging area (a region each), then
    one indexed copy of the heads we keep into our blocks."""
    cache = conn.cache  # [num_blocks, layers, 2, block_size, heads, dim]
    n = len(dst_blocks)
    sizes = [n * head_bytes * s.remote_num_heads for s in staged]
    with transport.staging_area(conn, sum(sizes)) as (area, slot):
        regions, off = [], 0
        for s, size in zip(staged, sizes):
            regions.append(area[off:off + size].view(n, size // n))
            off += size
        nbytes = transport.pull_staged(conn, slot, host, params, indices, digest, staged, regions)
        # Every source landed: build the blocks' new contents, then one indexed copy into the cache.
        # A slot's scatter runs on the slot's stream and ends before the slot goes back (staging.py).
        stream = slot.stream if slot is not None else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                # As bytes: [.., heads, head_dim * element size]. Heads move whole whatever the
                # element type, and torch has no index_copy_ for float8 (an fp8 KV cache).
                raw = cache.view(torch.uint8)
                shape = raw.shape[1:4]
                new = torch.empty((n, *shape, raw.shape[4], raw.shape[5]), dtype=torch.uint8, device=raw.device)
                for s, region in zip(staged, regions):
                    remote = region.view(n, *shape, s.remote_num_heads, raw.shape[5])
                    new[:, :, :, :, s.local_heads] = remote[:, :, :, :, s.remote_heads]
                raw.index_copy_(0, torch.tensor(dst_blocks, device=raw.device), new)
        finally:
            if stream is not None:
                stream.synchronize()
    return nbytes
