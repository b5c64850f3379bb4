"""KV connector pieces that need no second process: runs, peer policy, pin table."""

from __future__ import annotations

import time

import pytest

from pdserve.worker.kv.block_runs import merge_runs
from pdserve.worker.kv.peer_policy import PeerNotAllowed, PeerPolicy
from pdserve.worker.kv.pins import PinError, PinTable
from pdserve.worker.kv.prompt_binding import prompt_digest, token_digest

DIGEST = prompt_digest([1, 2, 3])


@pytest.mark.parametrize("src,dst,runs", [
    ([0, 1, 2], [5, 6, 7], [(0, 5, 3)]),
    ([0, 1, 2], [5, 7, 8], [(0, 5, 1), (1, 7, 2)]),
    ([4, 2], [0, 1], [(4, 0, 1), (2, 1, 1)]),
    ([], [], []),
])
def test_merge_runs(src, dst, runs):
    assert merge_runs(src, dst) == runs


def test_merge_runs_rejects_unequal_lists():
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        merge_runs([1, 2], [3])


@pytest.mark.parametrize("host", ["127.0.0.1", "10.244.1.7", "localhost", "8.8.8.8", "169.254.169.254"])
def test_default_peer_policy_denies_everyone(host):
    with pytest.raises(PeerNotAllowed, match="kv-peer-allow"):
        PeerPolicy().check(host)


def test_allowlist_of_cidrs_and_exact_names():
    policy = PeerPolicy(("10.1.0.0/16", "prefill-0.svc", "::1"))
    assert policy.check("10.1.2.3") == "10.1.2.3"
    assert policy.check("prefill-0.svc") == "prefill-0.svc"
    assert policy.check("::1") == "::1"
    for host in ("127.0.0.1", "10.2.0.1", "prefill-1.svc", "localhost"):  # names not listed: no DNS lookup
        with pytest.raises(PeerNotAllowed):
            policy.check(host)


class Clock:
    """time.monotonic for the pin table, moved by the test: expiry without sleeping, so a busy
    machine cannot stretch the time between two checks."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    @staticmethod
    def time() -> float:
        return time.time()


def test_pin_lease_release_and_expiry(monkeypatch):
    from pdserve.worker.kv import pins as pins_module

    clock = Clock()
    monkeypatch.setattr(pins_module, "time", clock)
    pins = PinTable(ttl=0.2)
    token, _ = pins.add("r1", [3, 4], DIGEST)
    with pytest.raises(PinError):
        pins.lease("r1", "forged", 5, DIGEST)
    with pytest.raises(PinError, match="prompt mismatch"):
        pins.lease("r1", token, 5, prompt_digest([9, 9]))
    assert pins.lease("r1", token, 1.5, DIGEST) == [3, 4]
    clock.now += 0.3
    assert pins.collect() == []  # expired but leased: its bytes may be on the wire
    clock.now += 1.5  # the lease ran out
    assert pins.collect() == [("r1", [3, 4], True)]
    with pytest.raises(PinError):
        pins.lease("r1", token, 5, DIGEST)  # gone


def test_released_pin_is_collected_once():
    pins = PinTable(ttl=30)
    token, _ = pins.add("r1", [1], DIGEST)
    assert not pins.release("r1", "wrong")
    assert pins.release("r1", token)
    assert pins.collect() == [("r1", [1], False)]
    assert pins.collect() == [] and len(pins) == 0


def test_token_carries_the_prompt_digest():
    pins = PinTable(ttl=30)
    token, _ = pins.add("r1", [1], DIGEST)
    assert token_digest(token) == DIGEST and token_digest("no-digest") is None
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4]) and prompt_digest([1, 2, 3]) == DIGEST


def test_side_channel_auth_macs_both_ways_and_refuses_replays():
    import json as _json

    from pdserve.worker.kv.auth import AuthError, SideChannelAuth

    server, client, other = SideChannelAuth("s" * 20), SideChannelAuth("s" * 20), SideChannelAuth("t" * 20)
    raw, mac, nonce = client.sign_request("read", {"x": 1})
    assert server.verify_request(b"read", raw, mac)["x"] == 1
    with pytest.raises(AuthError, match="replayed"):
        server.verify_request(b"read", raw, mac)
    raw, mac, nonce = client.sign_request("read", {"x": 1})
    with pytest.raises(AuthError, match="unauthenticated"):
        server.verify_request(b"lease", raw, mac)  # the op is covered by the MAC
    tampered = raw.replace(b'"x": 1', b'"x": 2')
    with pytest.raises(AuthError, match="unauthenticated"):
        server.verify_request(b"read", tampered, mac)
    raw2, mac2, _ = other.sign_request("read", {})
    with pytest.raises(AuthError):
        server.verify_request(b"read", raw2, mac2)
    stale = _json.dumps({"ts": 0, "nonce": "n"}).encode()
    with pytest.raises(AuthError, match="stale"):
        server.verify_request(b"read", stale, server._mac(b"req", b"read", stale))
    reply_mac = server.sign_reply(nonce, b"ok", b"{}")
    client.verify_reply(nonce, b"ok", b"{}", reply_mac)
    with pytest.raises(AuthError):
        client.verify_reply("another-nonce", b"ok", b"{}", reply_mac)  # not the answer to this request
    with pytest.raises(AuthError):
        client.verify_reply(nonce, b"ok", b"{}", b"")  # an unauthenticated server


def test_pull_pool_bounds_each_peer_and_cools_down_a_silent_one():
    import threading

    from pdserve.worker.kv.pull_pool import PeerCoolingDown, PullPool
    from pdserve.worker.kv.side_channel import PeerTimeout

    pool = PullPool(max_workers=8, per_peer=2, cooldown_s=30)
    gate, started = threading.Event(), []

    def hang(i):
        started.append(i)
        gate.wait(10)
        raise PeerTimeout("silent")

    silent = [pool.submit(("10.0.0.1", 1), hang, i) for i in range(6)]
    other = [pool.submit(("10.0.0.2", 1), lambda i=i: i) for i in range(5)]
    assert [f.result(5) for f in other] == list(range(5))  # another peer is not held up
    assert len(started) == 2 and pool.running(("10.0.0.1", 1)) == 2  # the rest wait without a thread
    gate.set()
    for f in silent:
        with pytest.raises((PeerTimeout, PeerCoolingDown)):
            f.result(5)
    assert len(started) == 2  # the queued four failed fast once the peer timed out
    with pytest.raises(PeerCoolingDown):
        pool.submit(("10.0.0.1", 1), lambda: 1).result(1)
    pool.shutdown()
