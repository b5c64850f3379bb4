"""TCP transport (pyzmq): the prefill side streams block bytes over its side channel.

One round trip per request: the decode side asks to read (and thereby release) the pinned
blocks; the reply carries one frame per contiguous run of blocks, zero-copy from CPU memory.
"""

from __future__ import annotations

import torch

from pdserve.worker.kv import side_channel
from pdserve.worker.kv.block_runs import merge_runs
from pdserve.worker.kv.pins import LEASE_S, PinTable



class TcpServer:
    """Prefill side: the `read` op."""

    def __init__(self, blocks: torch.Tensor, pins: PinTable, on_sent):
        self.blocks = blocks  # [num_blocks, block_bytes] uint8 view of the KV cache
        self.pins = pins
        self.on_sent = on_sent  # (num_bytes) -> None, for metrics

    def handle_read(self, body: dict):
        rid, token = body["request_id"], body["token"]
        pinned = self.pins.lease(rid, token, LEASE_S)
        ids = [pinned[i] for i in body["indices"]]
        frames, runs, nbytes = [], [], 0
        for src, _, count in merge_runs(ids, ids):
            chunk = self.blocks[src:src + count]
            if chunk.device.type != "cpu":
                chunk = chunk.cpu()
            frames.append(memoryview(chunk.numpy()).cast("B"))
            runs.append(count)
            nbytes += chunk.numel()

        def after():  # the bytes are on the wire: this read was also the release
            self.pins.release(rid, token)
            self.on_sent(nbytes)

        return {"runs": runs}, frames, after


def tcp_pull(host: str, port: int, params: dict, indices: list[int], dst_blocks: list[int],
             blocks: torch.Tensor, timeout_s: float) -> int:
    """Decode side: read the remote blocks at `indices` into local `dst_blocks`. Returns bytes."""
    body = {"request_id": params["remote_request_id"], "token": params["transfer_token"], "indices": indices}
    reply, frames = side_channel.call(host, port, "read", body, timeout_s)
    if len(frames) != len(reply["runs"]) or sum(reply["runs"]) != len(dst_blocks):
        raise side_channel.SideChannelError("KV peer sent a malformed read reply")
    pos, nbytes = 0, 0
    for frame, count in zip(frames, reply["runs"]):
        data = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(count, blocks.shape[1])
        idx = torch.tensor(dst_blocks[pos:pos + count], device=blocks.device)
        blocks.index_copy_(0, idx, data.to(blocks.device, non_blocking=False))
        pos += count
        nbytes += data.numel()
    return nbytes
