"""A worker publishes KV cache events (BlockStored with vLLM-style hash chains) over ZMQ."""

from __future__ import annotations

import json

import httpx
import zmq

from pdserve.protocol.kv_events import decode_seq, encode_seq
from pdserve.worker.engine.block_manager import hash_prefix_blocks
from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess


def test_worker_publishes_block_stored_and_replays(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    port = free_port(span=2)  # events on port, replay on port + 1
    with WorkerProcess(ckpt, "--max-model-len", "256", "--block-size", "4", "--kv-events-port", str(port)) as w:
        ctx = zmq.Context.instance()
        prompt = list(range(300, 318))  # 18 tokens: 4 full blocks
        r = httpx.post(
            f"{w.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=60
        )
        assert r.status_code == 200
        # Replay from seq 0 returns everything published so far (no race with a late SUB).
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.RCVTIMEO, 10_000)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{port + 1}")
        req.send(encode_seq(0))
        frames = req.recv_multipart()
        req.close()
        batches = [(decode_seq(frames[i]), json.loads(frames[i + 1])) for i in range(0, len(frames), 2)]
        assert [seq for seq, _ in batches] == list(range(len(batches))) and batches
        stored = [e for _, b in batches for e in b["events"] if e["type"] == "BlockStored"]
        hashes = [h for e in stored for h in e["block_hashes"]]
        assert hashes[:4] == hash_prefix_blocks(prompt, 4)
        assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"][:4] == prompt[:4]
