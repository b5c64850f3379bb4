"""TCP transport (pyzmq): the prefill side streams block bytes over its side channel.

One round trip per request: the decode side asks to read (and thereby release) the pinned
blocks; the reply carries one frame per contiguous run of blocks. The prefill side copies
the blocks out of its cache before queueing them, so the pin is released at once and a
reader that never drains its socket holds only its own copy (bounded by the side channel's
per-peer limits), never KV blocks that other requests need.
"""

from __future__ import annotations

import time

import torch

from pdserve.worker.kv import side_channel
from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.block_runs import merge_runs
from pdserve.worker.kv.pins import LEASE_S, PinTable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.protocol.kv_transfer import KVTransferParams

BUSY_RETRY_S = 0.01


class TcpServer:
    """Prefill side: the `read` op."""

    def __init__(self, blocks: torch.Tensor, pins: PinTable, on_sent):
        self.blocks = blocks  # [num_blocks, block_bytes] uint8 view of the KV cache
        self.pins = pins
        self.on_sent = on_sent  # (num_bytes) -> None, for metrics

    def handle_read(self, body: dict):
        rid, token = body.get("request_id"), body.get("token")
        indices = body.get("indices")  # a streamed pin defers the read until these are computed
        pinned = self.pins.lease(rid, token, LEASE_S, body.get("prompt_digest"),
                                 indices if isinstance(indices, list) else None)
        try:
            ids = [pinned[i] for i in check_indices(body.get("indices"), len(pinned))]
            frames, runs, nbytes = [], [], 0
            for src, _, count in merge_runs(ids, ids):
                chunk = self.blocks[src:src + count]
                chunk = chunk.cpu() if chunk.device.type != "cpu" else chunk.clone()  # our own copy
                frames.append(memoryview(chunk.numpy()).cast("B"))
                runs.append(count)
                nbytes += chunk.numel()
        finally:
            if not body.get("keep"):  # a read is also the release: one reader, once
                self.pins.release(rid, token)
            # "keep": tensor-parallel readers (several decode ranks may read this rank's shard);
            # the lease holds the pin until the decode worker's rank 0 releases it (kv/tp_transfer.py).
        self.on_sent(nbytes)
        return {"runs": runs, "prompt_digest": body["prompt_digest"]}, frames


def check_indices(indices, num_pinned: int) -> list[int]:
    if not isinstance(indices, list) or not all(type(i) is int and 0 <= i < num_pinned for i in indices):
        raise ValueError(f"indices must be a list of block positions in [0, {num_pinned})")
    return indices


def tcp_pull(host: str, port: int, params: KVTransferParams, indices: list[int], dst_blocks: list[int],
             blocks: torch.Tensor, timeout_s: float, auth: SideChannelAuth, digest: str, keep: bool = False) -> int:
    """Decode side: read the remote blocks at `indices` into local `dst_blocks`. Returns bytes.
    `keep`: leave the pin for an explicit release (tensor-parallel readers)."""
    body = {"request_id": params.remote_request_id, "token": params.transfer_token, "indices": indices,
            "prompt_digest": digest}
    if keep:
        body["keep"] = True
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply, frames = side_channel.call(host, port, "read", body, max(0.1, deadline - time.monotonic()), auth,
                                              params.remote_engine_id)
            break
        except side_channel.PeerBusy:
            if time.monotonic() + BUSY_RETRY_S >= deadline:
                raise
            time.sleep(BUSY_RETRY_S)
    if reply.get("prompt_digest") != digest:  # a peer that skipped the check must not fill our cache
        raise side_channel.SideChannelError("KV peer did not confirm the prompt digest")
    runs = reply.get("runs")
    if (not isinstance(runs, list) or len(frames) != len(runs) or sum(runs) != len(dst_blocks)
            or any(len(f.buffer) != c * blocks.shape[1] for f, c in zip(frames, runs))):
        raise side_channel.SideChannelError(f"KV peer sent a malformed read reply ({len(frames)} frames for runs "
                                            f"{runs}, {len(dst_blocks)} blocks of {blocks.shape[1]} bytes expected)")
    pos, nbytes = 0, 0
    for frame, count in zip(frames, runs):
        data = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(count, blocks.shape[1])
        idx = torch.tensor(dst_blocks[pos:pos + count], device=blocks.device)
        blocks.index_copy_(0, idx, data.to(blocks.device, non_blocking=False))
        pos += count
        nbytes += data.numel()
    return nbytes
