"""KV connector pieces that need no second process: runs, peer policy, pin table."""

from __future__ import annotations

import time

import pytest

from pdserve.worker.kv.block_runs import merge_runs
from pdserve.worker.kv.peer_policy import PeerNotAllowed, PeerPolicy
from pdserve.worker.kv.pins import PinError, PinTable


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


@pytest.mark.parametrize("host,allowed", [
    ("127.0.0.1", True), ("10.244.1.7", True), ("192.168.3.4", True), ("localhost", True),
    ("8.8.8.8", False), ("203.0.113.7", False), ("169.254.169.254", False),
])
def test_default_peer_policy(host, allowed):
    policy = PeerPolicy()
    if allowed:
        policy.check(host)
    else:
        with pytest.raises(PeerNotAllowed):
            policy.check(host)


def test_explicit_allowlist_replaces_default():
    policy = PeerPolicy(("10.1.0.0/16", "prefill-0.svc"))
    policy.check("10.1.2.3")
    assert policy.check("prefill-0.svc") == "prefill-0.svc"
    with pytest.raises(PeerNotAllowed):
        policy.check("127.0.0.1")


def test_pin_lease_release_and_expiry():
    pins = PinTable(ttl=0.2)
    token, _ = pins.add("r1", [3, 4])
    with pytest.raises(PinError):
        pins.lease("r1", "forged", 5)
    assert pins.lease("r1", token, 1.5) == [3, 4]
    time.sleep(0.3)
    assert pins.collect() == []  # expired but leased: its bytes may be on the wire
    time.sleep(1.5)  # the lease ran out
    assert pins.collect() == [("r1", [3, 4], True)]
    with pytest.raises(PinError):
        pins.lease("r1", token, 5)  # gone


def test_released_pin_is_collected_once():
    pins = PinTable(ttl=30)
    token, _ = pins.add("r1", [1])
    assert not pins.release("r1", "wrong")
    assert pins.release("r1", token)
    assert pins.collect() == [("r1", [1], False)]
    assert pins.collect() == [] and len(pins) == 0
