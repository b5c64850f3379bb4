"""KV transfer between tensor-parallel workers: which prefill rank holds each of our KV heads.

A worker of TP size N keeps, on rank r, the paged cache of the KV heads `kv_head_range(KV, N, r)`
(models/parallel.py), laid out [block, layer, k|v, token, head, dim]. Every rank uses the same
block ids (rank 0 schedules), and every rank of a prefill worker serves its own shard on
`--kv-port + r` with the same secret and a mirror of rank 0's pins (tp_link.py).

A decode rank needs exactly its own heads. `kv_sources` says where each lives:
- same TP (or the same heads, e.g. a replicated head): one source, the whole block, read straight
  into our blocks (one descriptor per run of blocks, as at TP = 1);
- otherwise the heads are not contiguous in a block, so whole remote blocks (contiguous, fast)
  are read into a staging buffer per source and the heads we hold are scattered into our blocks
  with one indexed copy: decode TP=1 from prefill TP=2 reads both prefill ranks and interleaves
  their heads; decode TP=2 from prefill TP=1 reads the full-head block and keeps its slice.

When either side has TP > 1 a read does not release the prefill pin: several decode ranks may
read one prefill rank. Decode rank 0 releases every prefill rank's pin once all decode ranks
have landed (or failed) their pulls (connector.py).
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.worker.kv import side_channel
from pdserve.worker.kv.tcp_transport import tcp_pull
from pdserve.worker.models.parallel import check_kv_heads, kv_head_range

TP_PARAM = "kv_tp_size"  # kv_transfer_params key: the prefill worker's TP size (absent = 1)


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


def remote_tp_size(params: dict) -> int:
    n = params.get(TP_PARAM, 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"kv_transfer_params.{TP_PARAM} must be a positive integer, got {n!r}")
    return n


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


def pull_shards(conn, host: str, params: dict, indices: list[int], dst_blocks: list[int], digest: str,
                transport: str) -> int:
    """Decode rank: pull our heads of the remote blocks at `indices` into `dst_blocks`. Returns
    bytes moved. `conn` is this rank's KVConnector (its cache, auth, timeout, NIXL agent)."""
    sources = kv_sources(conn.tp.num_kv_heads, remote_tp_size(params), conn.tp)
    cache = conn.cache  # [num_blocks, layers, 2, block_size, heads, dim]
    head_bytes = conn.block_bytes // cache.shape[4]
    base_port = int(params["remote_port"])
    n, nbytes, staged = len(dst_blocks), 0, []
    for s in sources:
        port = base_port + s.remote_rank
        if s.direct:
            nbytes += _read(conn, transport, host, port, s.remote_rank, params, indices, dst_blocks, conn.blocks,
                            digest)
            continue
        buf = torch.empty(n, head_bytes * s.remote_num_heads, dtype=torch.uint8, device=cache.device)
        nbytes += _read(conn, transport, host, port, s.remote_rank, params, indices, list(range(n)), buf, digest)
        staged.append((s, buf))
    if staged:
        # Every source landed: build the blocks' new contents, then one indexed copy into the cache.
        shape = cache.shape[1:4]
        new = torch.empty((n, *shape, cache.shape[4], cache.shape[5]), dtype=cache.dtype, device=cache.device)
        for s, buf in staged:
            remote = buf.view(cache.dtype).view(n, *shape, s.remote_num_heads, cache.shape[5])
            new[:, :, :, :, s.local_heads] = remote[:, :, :, :, s.remote_heads]
        cache.index_copy_(0, torch.tensor(dst_blocks, device=cache.device), new)
    return nbytes


def _read(conn, transport: str, host: str, port: int, remote_rank: int, params: dict, indices: list[int],
          dst_rows: list[int], dst: torch.Tensor, digest: str) -> int:
    """Whole remote blocks at `indices` of one prefill rank into rows `dst_rows` of `dst` [rows, bytes]."""
    if transport == "tcp":
        return tcp_pull(host, port, params, indices, dst_rows, dst, conn.timeout, conn.auth, digest, keep=True)
    key = f"{params['remote_engine_id']}#{remote_rank}"
    peer = conn.nixl.known_peer(key)
    reply, _ = side_channel.lease(host, port, params, indices, digest, peer is None, conn.timeout, conn.auth)
    if reply.get("tp_rank", 0) != remote_rank:
        raise side_channel.SideChannelError(f"KV peer {host}:{port} is tensor-parallel rank {reply.get('tp_rank')}, "
                                            f"not rank {remote_rank}: its heads are not the ones expected")
    if peer is None:
        peer = conn.nixl.add_peer(key, reply["nixl"])
    if len(reply.get("block_ids", ())) != len(dst_rows):
        raise side_channel.SideChannelError(f"KV peer {host}:{port} leased the wrong number of blocks")
    notif = None  # no release on read: decode rank 0 releases every prefill rank's pin once all ranks read
    if dst is conn.blocks:
        return conn.nixl.read(peer, reply["block_ids"], dst_rows, notif, conn.timeout)
    return conn.nixl.read_into(peer, reply["block_ids"], dst, notif, conn.timeout)
