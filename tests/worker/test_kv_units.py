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


def test_pin_lease_release_and_expiry():
    pins = PinTable(ttl=0.2)
    token, _ = pins.add("r1", [3, 4], DIGEST)
    with pytest.raises(PinError):
        pins.lease("r1", "forged", 5, DIGEST)
    with pytest.raises(PinError, match="prompt mismatch"):
        pins.lease("r1", token, 5, prompt_digest([9, 9]))
    assert pins.lease("r1", token, 1.5, DIGEST) == [3, 4]
    time.sleep(0.3)
    assert pins.collect() == []  # expired but leased: its bytes may be on the wire
    time.sleep(1.5)  # the lease ran out
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
