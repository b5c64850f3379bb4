"""KVEndpoint: what the KV connector's scheduler half knows of this worker's transfer side.

Plain facts, fixed at start (where peers reach this worker's pins, its KV layout, which peers
it may pull from, the pin TTL), so the scheduler half can check a request's params and write
the params of a pin it orders without holding the worker half (connector.KVConnector), which
moves bytes and owns the pin table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.protocol.kv_layout import KVLayout
from pdserve.protocol.kv_transfer import KVTransferParams
from pdserve.worker.kv.metrics import KVMetrics
from pdserve.worker.kv.peer_policy import PeerNotAllowed, PeerPolicy


@dataclass(frozen=True)
class KVEndpoint:
    engine_id: str
    host: str  # advertised: where decode workers reach rank 0's side channel (rank r: port + r)
    port: int
    layout: KVLayout  # of the whole model (all ranks' heads): see kv_cache.kv_layout
    transport: str  # this worker's transport (registry.py)
    tp_size: int
    num_blocks: int  # of this worker's KV cache
    pin_ttl: float  # seconds a finished prefill's pin waits for a reader
    serves: bool  # the side channel runs: this worker can hold pins for remote readers
    policy: PeerPolicy  # --kv-peer-allow
    metrics: KVMetrics
    block_bytes: int = 0  # one block of every layer and every rank's heads: what a pull of it moves

    def params(self, request_id: str, block_ids: list[int], num_prompt_tokens: int, token: str,
               first_token_id: int | None = None, stream_kv: bool = False,
               lora_name: str | None = None, lora_path: str | None = None) -> KVTransferParams:
        """The kv_transfer_params of a pin made under `token`. A streamed pin (no first token yet)
        never expires while its prefill runs; a finished one's expiry starts now."""
        return KVTransferParams(
            remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
            remote_request_id=request_id, remote_block_ids=tuple(block_ids), num_prompt_tokens=num_prompt_tokens,
            first_token_id=first_token_id, transfer_token=token, kv_layout=self.layout, transport=self.transport,
            expires_at=None if stream_kv else time.time() + self.pin_ttl, kv_tp_size=self.tp_size,
            stream_kv=stream_kv, lora_name=lora_name, lora_path=lora_path)

    def allowed_peer(self, params: KVTransferParams) -> str:
        """The address to connect to for these params, if --kv-peer-allow admits their host and
        every port they make us contact (a TP prefill worker's rank r listens on remote_port + r);
        else PeerNotAllowed."""
        return allowed_peer(self.policy, params)


def allowed_peer(policy: PeerPolicy, params: KVTransferParams) -> str:
    host, port = params.remote_host, params.remote_port
    if type(port) is not int:
        raise PeerNotAllowed(f"KV peer port {port!r} is not a port")
    address = policy.check(host, port)
    for rank in range(1, params.kv_tp_size):
        policy.check(host, port + rank)
    return address
