"""KV events over real ZMQ sockets: live stream, replay of a gap and of what was published before
the subscriber joined, publisher restart; the index they build; and a router process routing a
repeated prompt to the worker that cached it."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import zmq.asyncio

from pdserve.protocol.kv_events import (KVEventPublisher, KVEventSubscriber, all_blocks_cleared, block_removed,
                                      block_stored, encode_seq)
from pdserve.router.kv_index import KVIndex
from tests.net import free_port
from tests.router.test_failures import eventually, metric

BS = 4


def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def lose(pub: KVEventPublisher, events: list[dict]) -> None:
    """A batch the PUB socket drops (as a slow subscriber's full queue would): buffered for
    replay, never sent live."""
    with pub._lock:
        seq, pub._seq = pub._seq, pub._seq + 1
        pub._buffer.append((seq, json.dumps({"seq": seq, "worker": pub._worker_id, "events": events}).encode()))


async def until(check, timeout_s=10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.01)


async def subscribed(pub: KVEventPublisher, sub: KVEventSubscriber, timeout_s: float = 10.0) -> None:
    """Until `sub` receives `pub`'s live batches. A SUB socket's subscription reaches the
    publisher some time after it connects (or reconnects), and a PUB drops what it sends before
    that: empty batches are published until one arrives. (Each that arrives live also replays
    any dropped before it: what the subscriber does on a gap.) Call it once the subscriber's
    start-up replay is done, so only a live batch moves `next_seq`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        seq = pub.publish([])
        wait_until = min(deadline, asyncio.get_running_loop().time() + 0.2)
        while asyncio.get_running_loop().time() < wait_until:
            if sub.source == pub._worker_id and sub.next_seq > seq:
                return
            await asyncio.sleep(0.01)
        assert asyncio.get_running_loop().time() < deadline, "no live batch reached the subscriber"


def test_block_stored_checks_its_token_count():
    with pytest.raises(ValueError, match="block_size"):
        block_stored([1, 2], None, [1, 2, 3], 4)


def test_index_applies_stored_removed_cleared():
    index = KVIndex()
    tokens = list(range(12))
    index.apply("w", [block_stored([11, 12, 13], None, tokens, BS)])
    assert index.match(tokens + [99], ["w", "other"]) == {"w": 3}
    assert index.match([0, 1, 2, 3, 9, 9, 9, 9], ["w"]) == {"w": 1}  # diverges after one block
    assert index.match(tokens[4:], ["w"]) == {}  # same tokens, wrong position: parent differs
    index.apply("w", [block_removed([12])])
    assert index.match(tokens, ["w"]) == {"w": 1}  # the chain breaks at the removed block
    index.apply("w", [block_stored([14], 11, tokens[4:8], BS)])  # re-stored under a new hash
    assert index.match(tokens, ["w"]) == {"w": 2}  # block 13 hangs off the old hash 12: not reachable
    index.apply("w", [all_blocks_cleared()])
    assert index.match(tokens, ["w"]) == {} and index.num_blocks("w") == 0


def test_index_scores_device_blocks_only():
    """A worker's host tier (medium CPU) neither adds to nor takes from its device blocks' index."""
    index = KVIndex()
    tokens = list(range(8))
    index.apply("w", [block_stored([11, 12], None, tokens, BS, medium="GPU")])
    index.apply("w", [block_removed([12], medium="CPU"), block_stored([21], None, [7] * 4, BS, medium="CPU")])
    assert index.match(tokens, ["w"]) == {"w": 2} and index.match([7] * 8, ["w"]) == {}
    index.apply("w", [block_removed([12], medium="GPU")])
    assert index.match(tokens, ["w"]) == {"w": 1}


def test_subscriber_replays_history_and_gaps_and_resets_on_restart():
    async def scenario():
        pub_ep, replay_ep = endpoints()
        index = KVIndex()
        pub = KVEventPublisher("w-1", pub_ep, replay_ep)
        ctx = zmq.asyncio.Context()
        sub = KVEventSubscriber(ctx, pub_ep, replay_ep, apply=lambda ev: index.apply("w", ev),
                                reset=lambda: index.clear("w"))
        try:
            pub.publish([block_stored([1], None, [1, 2, 3, 4], BS)])  # before anyone listens
            task = asyncio.create_task(sub.run())
            await until(lambda: sub.next_seq == 1)
            assert index.match([1, 2, 3, 4], ["w"]) == {"w": 1}
            # Live events; one is lost on the wire and must come back through the replay socket.
            await subscribed(pub, sub)
            base = sub.next_seq
            lose(pub, [block_stored([2], 1, [5, 6, 7, 8], BS)])
            pub.publish([block_stored([3], 2, [9, 10, 11, 12], BS)])
            await until(lambda: sub.next_seq == base + 2)
            assert index.match(list(range(1, 13)), ["w"]) == {"w": 3}
            assert sub.applied == base + 2  # each batch once
            # The worker restarts: a new publisher id on the same endpoints, seq from 0 again.
            pub.close()
            pub = KVEventPublisher("w-2", pub_ep, replay_ep)
            await subscribed(pub, sub)  # ZMQ reconnects by itself, in its own time
            assert index.match(list(range(1, 13)), ["w"]) == {}  # the old worker's blocks are gone
            pub.publish([block_stored([7], None, [5, 5, 5, 5], BS)])
            await until(lambda: index.match([5, 5, 5, 5], ["w"]) == {"w": 1})
            task.cancel()
        finally:
            pub.close()
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_replay_socket_answers_a_plain_req_client():
    pub_ep, replay_ep = endpoints()
    pub = KVEventPublisher("w", pub_ep, replay_ep)
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    try:
        for i in range(3):
            pub.publish([block_removed([i])])
        req.connect(replay_ep)
        req.send(encode_seq(1))
        assert req.poll(5000)
        frames = req.recv_multipart()
        assert [int.from_bytes(f, "big") for f in frames[0::2]] == [1, 2]
        assert [json.loads(f)["events"][0]["block_hashes"] for f in frames[1::2]] == [[1], [2]]
    finally:
        req.close(linger=0)
        ctx.term()
        pub.close()


def test_router_routes_repeated_prompt_to_the_worker_that_cached_it(launch, default_model_dir):
    # Each worker on its own loopback address with the same event ports, as pods in a cluster.
    ports = f"{free_port()},{free_port()}"
    workers = [launch.fake_worker("--kv-events", host, "--kv-ports", ports, "--tokenizer", str(default_model_dir),
                                  host=host) for host in ("127.0.0.61", "127.0.0.62")]
    pub_port, replay_port = ports.split(",")
    router = launch.router("--decode", workers[0].url, "--decode", workers[1].url, "--policy", "prefix-aware",
                           "--tokenizer", str(default_model_dir), "--kv-events-port", pub_port,
                           "--kv-events-replay-port", replay_port)
    prompt = "Once upon a time there was a fox who lived in a very old forest. " * 3
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    # Warm the second worker directly: it publishes BlockStored for the prompt's blocks.
    assert httpx.post(workers[1].url + "/v1/completions", json=body).status_code == 200
    eventually(lambda: metric(router, "pdserve_router_kv_index_blocks", worker=workers[1].url) > 0)
    before = [len(w.requests()) for w in workers]
    for _ in range(4):
        assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200
    after = [len(w.requests()) for w in workers]
    assert after[0] - before[0] == 0 and after[1] - before[1] == 4
    # A prompt nobody cached goes by load: the idle first worker.
    other = {"model": "tiny", "prompt": "Completely different text about ships and the sea, " * 3, "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=other, timeout=10).status_code == 200
    assert len(workers[0].requests()) == after[0] + 1
