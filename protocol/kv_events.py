"""KV cache events: the wire format, a publisher (for workers) and a subscriber (for routers).

Transport (as vLLM's KV events): ZMQ PUB for the live stream plus a ROUTER socket for replay.

Live, PUB on tcp://*:5557, one multipart message per batch:
    [b"kv", seq (8 bytes, big-endian unsigned), payload (UTF-8 JSON)]
    payload = {"seq": n, "worker": "<id>", "events": [event, ...]}
    event   = {"type": "BlockStored", "block_hashes": [int, ...], "parent_block_hash": int | null,
               "token_ids": [int, ...], "block_size": int[, "lora_name": str][, "medium": str]}
            | {"type": "BlockRemoved", "block_hashes": [int, ...][, "medium": str]}
            | {"type": "AllBlocksCleared"}
`seq` starts at 0 and grows by one per batch. In BlockStored, `token_ids` are the tokens of all
the listed blocks concatenated (len == block_size * len(block_hashes)) and `parent_block_hash` is
the hash of the block before the first one (null for a prompt's first block; for blocks computed
under a LoRA adapter, named by `lora_name`, the adapter's root hash instead of null). `medium`
(vLLM's field) says which tier the event is about: "GPU" the device cache, "CPU" the worker's
host tier (--kv-offloading-size); a block offloaded is a BlockStored with medium CPU beside its
BlockRemoved with medium GPU, and a hash may be held in both tiers at once. Absent: GPU.

Replay, ROUTER on tcp://*:5558: a REQ client sends one frame, the first wanted seq (8 bytes,
big-endian); the reply is one multipart message of (seq, payload) frame pairs for every buffered
batch from that seq on (possibly none).

A subscriber that sees a gap asks for a replay; if the buffer no longer reaches back, or seq
restarts (the worker restarted), it drops that worker's index and starts over. The index is a
routing hint, so a lost event costs cache hits, never correctness.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from typing import Callable

import zmq
import zmq.asyncio

from pdserve.protocol.contract import KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT

log = logging.getLogger("pdserve.protocol")

TOPIC = b"kv"


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


def block_stored(block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int],
                 block_size: int, lora_name: str | None = None, medium: str | None = None) -> dict:
    """`lora_name`: the adapter the blocks were computed under (vLLM's field; absent for the
    base model). Their hashes already differ from the base's (the chain starts at the adapter's
    root), so a consumer that ignores it still never matches them to a base prompt."""
    if len(token_ids) != block_size * len(block_hashes):
        raise ValueError("token_ids must hold block_size tokens per stored block")
    event = {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent_block_hash,
             "token_ids": token_ids, "block_size": block_size}
    if lora_name is not None:
        event["lora_name"] = lora_name
    if medium is not None:
        event["medium"] = medium
    return event


def block_removed(block_hashes: list[int], medium: str | None = None) -> dict:
    event = {"type": "BlockRemoved", "block_hashes": block_hashes}
    if medium is not None:
        event["medium"] = medium
    return event


def all_blocks_cleared() -> dict:
    return {"type": "AllBlocksCleared"}


class KVEventPublisher:
    """Worker side: `publish(events)` from any thread; a daemon thread serves replays."""

    def __init__(self, worker_id: str, pub_endpoint: str = f"tcp://*:{KV_EVENTS_PORT}",
                 replay_endpoint: str = f"tcp://*:{KV_EVENTS_REPLAY_PORT}", buffer_batches: int = 10_000):
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(pub_endpoint)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.bind(replay_endpoint)
        self._worker_id = worker_id
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True)
        self._thread.start()

    def publish(self, events: list[dict]) -> int:
        with self._lock:
            seq = self._seq
            self._seq += 1
            payload = json.dumps({"seq": seq, "worker": self._worker_id, "events": events}).encode()
            self._buffer.append((seq, payload))
            self._pub.send_multipart([TOPIC, encode_seq(seq), payload])
        return seq

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            client, empty, start = self._replay.recv_multipart()
            wanted = decode_seq(start)
            with self._lock:
                frames = [f for seq, payload in self._buffer if seq >= wanted for f in (encode_seq(seq), payload)]
            self._replay.send_multipart([client, empty, *frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pub.close()
        self._replay.close()
        self._ctx.term()


class KVEventSubscriber:
    """Router side: follows one worker's events and applies each batch once, in order."""

    def __init__(self, ctx: zmq.asyncio.Context, pub_endpoint: str, replay_endpoint: str,
                 apply: Callable[[list[dict]], None], reset: Callable[[], None], replay_timeout_s: float = 2.0):
        self._ctx = ctx
        self.endpoint = pub_endpoint
        self._replay_endpoint = replay_endpoint
        self._apply = apply
        self._reset = reset
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self.next_seq = 0  # the next batch this subscriber has not applied yet
        self.applied = 0  # batches applied, for tests and logs
        self.source: str | None = None  # the publisher's id; a new one means the worker restarted

    def _take(self, seq: int, batch: dict) -> None:
        if batch.get("worker") != self.source:
            if self.source is not None:
                log.info("kv events from %s: new publisher %r; dropping its index", self.endpoint, batch.get("worker"))
                self._reset()
                self.next_seq = 0
            self.source = batch.get("worker")
        if seq < self.next_seq:
            return  # already applied (a replay overlapping the live stream)
        self._apply(batch["events"])
        self.next_seq = seq + 1
        self.applied += 1

    async def _replay(self, start: int) -> bool:
        """Fetch batches from `start`; False if the worker's buffer no longer reaches back that far."""
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._replay_endpoint)
        try:
            await sock.send(encode_seq(start))
            if not await sock.poll(self._replay_timeout_ms):
                return False
            frames = await sock.recv_multipart()
        finally:
            sock.close()
        pairs = [(decode_seq(frames[i]), json.loads(frames[i + 1])) for i in range(0, len(frames) - 1, 2)]
        if pairs and pairs[0][0] > start:
            return False
        for seq, batch in pairs:
            self._take(seq, batch)
        return True

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(self.endpoint)
        try:
            # Whatever was published before our subscription took effect comes from the replay.
            await self._replay(0)
            while True:
                _, raw_seq, payload = await sub.recv_multipart()
                seq, batch = decode_seq(raw_seq), json.loads(payload)
                if batch.get("worker") == self.source and seq > self.next_seq:
                    if not await self._replay(self.next_seq):
                        log.warning("kv events from %s: gap %d..%d not replayable; dropping its index",
                                    self.endpoint, self.next_seq, seq - 1)
                        self._reset()
                        self.next_seq = seq
                self._take(seq, batch)
        finally:
            sub.close()
