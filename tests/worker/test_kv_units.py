"""KV connector pieces that need no second process: runs, peer policy, pin table."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings, strategies as st

from pdserve.worker.kv.block_runs import merge_runs
from pdserve.worker.kv.connector_scheduler import resolve_split, taper_chunk
from pdserve.worker.kv.data_listener import DataListenerConfig
from pdserve.worker.kv.peer_policy import PeerNotAllowed, PeerPolicy
from pdserve.worker.kv.pins import NotReady, PinError, PinTable
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


@pytest.mark.parametrize("bad", [
    {"hello_timeout_s": 0}, {"hello_timeout_s": float("nan")}, {"hello_timeout_s": float("inf")},
    {"max_handshakes": 0}, {"max_handshakes_per_peer": 0}, {"max_handshakes_per_peer": 65},
    {"max_connections_per_peer": 7},  # below the address's own handshake share
])
def test_data_listener_config_refuses_bounds_that_admit_nothing_or_never_end(bad):
    with pytest.raises(ValueError):
        DataListenerConfig(**bad)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.244.1.7", "localhost", "8.8.8.8", "169.254.169.254"])
def test_default_peer_policy_denies_everyone(host):
    with pytest.raises(PeerNotAllowed, match="kv-peer-allow"):
        PeerPolicy().check(host, 5600)


def test_allowlist_of_cidrs_and_exact_names():
    policy = PeerPolicy(("10.1.0.0/16", "prefill-0.svc", "::1"))
    assert policy.check("10.1.2.3", 5600) == "10.1.2.3"
    assert policy.check("prefill-0.svc", 1) == "prefill-0.svc"
    assert policy.check("::1", 65535) == "::1"
    assert policy.any_port() == ["10.1.0.0/16", "::1/128", "prefill-0.svc"]  # the worker warns about these
    for host in ("127.0.0.1", "10.2.0.1", "prefill-1.svc", "localhost"):  # names not listed: no DNS lookup
        with pytest.raises(PeerNotAllowed):
            policy.check(host, 5600)


def test_allowlist_ports_limit_where_a_worker_connects():
    """Issue 23 item 1: params naming an allowed host on a port the deployment did not declare
    (one an attacker listens on) are refused."""
    policy = PeerPolicy(("10.0.0.0/8:5600-5603", "prefill-0.svc:7000", "[fd00::/8]:5600", "192.168.0.0/16"))
    assert policy.check("10.9.8.7", 5600) == "10.9.8.7" and policy.check("10.9.8.7", 5603) == "10.9.8.7"
    assert policy.check("prefill-0.svc", 7000) == "prefill-0.svc"
    assert policy.check("fd00::1", 5600) == "fd00::1"
    assert policy.check("192.168.1.1", 12345) == "192.168.1.1"  # no ports named: any (warned about)
    assert policy.any_port() == ["192.168.0.0/16"]
    for host, port in (("10.9.8.7", 5604), ("10.9.8.7", 5599), ("prefill-0.svc", 7001), ("fd00::1", 5601)):
        with pytest.raises(PeerNotAllowed, match="port"):
            policy.check(host, port)


@pytest.mark.parametrize("entry,parsed", [
    ("10.0.0.0/8", ("10.0.0.0/8", None)),
    ("10.0.0.0/8:5600-5607", ("10.0.0.0/8", (5600, 5607))),
    ("10.0.0.1:5600", ("10.0.0.1", (5600, 5600))),
    ("prefill-0.svc:7000", ("prefill-0.svc", (7000, 7000))),
    ("fd00::/8", ("fd00::/8", None)),
    ("::1", ("::1", None)),
    ("[fd00::/8]:5600-5601", ("fd00::/8", (5600, 5601))),
    ("[::1]", ("::1", None)),
])
def test_peer_entries_parse(entry, parsed):
    from pdserve.protocol.kv_peers import parse_peer, with_ports

    assert parse_peer(entry) == parsed
    peer, ports = parsed
    assert parse_peer(with_ports(entry, 1, 2)) == (peer, ports or (1, 2))  # ports given are kept


@pytest.mark.parametrize("entry", ["", "a b", "10.0.0.0/8:", "10.0.0.0/8:0", "10.0.0.0/8:5601-5600",
                                   "10.0.0.0/8:70000", "host:x", "[fd00::/8]:", "[fd00::/8", "a/b", "h:1:2x"])
def test_bad_peer_entries_are_refused(entry):
    from pdserve.protocol.kv_peers import parse_peer

    with pytest.raises(ValueError):
        parse_peer(entry)


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


def test_a_progress_reply_can_lease_a_streamed_pin(monkeypatch):
    """The streamed NIXL hand-off READs the chunk a progress reply announces without a lease
    round trip: that reply must hold the pin as a lease would (cancelled: no lease)."""
    from pdserve.worker.kv import pins as pins_module

    clock = Clock()
    monkeypatch.setattr(pins_module, "time", clock)
    pins = PinTable(ttl=0.2)
    token = pins.add_streamed("r1", [3, 4, 5], DIGEST, ready=1)
    assert "block_ids" not in pins.progress("r1", token, DIGEST, 0)  # no lease asked: none given
    with pytest.raises(NotReady):
        pins.progress("r1", token, DIGEST, 1, lease_s=1.5)
    pins.finish("r1", 42)
    state = pins.progress("r1", token, DIGEST, 1, lease_s=1.5)
    assert state == {"ready": 3, "state": "done", "first_token_id": 42, "last": False, "block_ids": [3, 4, 5]}
    clock.now += 0.3
    assert pins.collect() == []  # past its TTL but leased: a READ may be moving its bytes
    clock.now += 1.5
    assert pins.collect() == [("r1", [3, 4, 5], True)]
    token = pins.add_streamed("r2", [6], DIGEST, ready=0)
    pins.cancel("r2")
    assert pins.progress("r2", token, DIGEST, 0, lease_s=60) == {"ready": 0, "state": "cancelled",
                                                                 "first_token_id": None, "last": False}
    assert pins.collect() == [("r2", [6], False)]  # a cancelled pin is never leased
    # Freed, it still answers its reader "cancelled" for a TTL (a read it broke off then ends the
    # request instead of prefilling locally), to the token's holder only.
    assert pins.progress("r2", token, DIGEST, -1)["state"] == "cancelled"
    with pytest.raises(PinError):
        pins.progress("r2", "forged", DIGEST, -1)
    with pytest.raises(PinError):
        pins.lease("r2", token, 5, DIGEST)
    clock.now += 0.3
    pins.collect()
    with pytest.raises(PinError):
        pins.progress("r2", token, DIGEST, -1)


def test_a_reader_hears_when_the_prefill_starts_its_last_step():
    """A reader that has not seen it is answered as soon as the last prefill step begins (its
    engine stops overlapping steps so the request joins the step after the landing); a reader
    that has seen it waits for blocks, as before."""
    pins = PinTable(ttl=5)
    token = pins.add_streamed("r1", [3, 4, 5], DIGEST, ready=1)
    with pytest.raises(NotReady):
        pins.progress("r1", token, DIGEST, 1, last_seen=False)
    changes = []
    pins.on_change = lambda: changes.append(1)
    pins.last_step("r1")
    assert changes == [1]  # deferred readers are retried
    assert pins.progress("r1", token, DIGEST, 1, last_seen=False) == {"ready": 1, "state": "running",
                                                                      "first_token_id": None, "last": True}
    with pytest.raises(NotReady):
        pins.progress("r1", token, DIGEST, 1, last_seen=True)
    pins.finish("r1", 7)
    pins.last_step("r1")  # too late: nothing changes
    assert changes == [1, 1]
    assert pins.progress("r1", token, DIGEST, 1)["state"] == "done"


def test_a_read_in_progress_holds_its_pin_through_ttl_and_release(monkeypatch):
    from pdserve.worker.kv import pins as pins_module

    clock = Clock()
    monkeypatch.setattr(pins_module, "time", clock)
    pins = PinTable(ttl=0.2)
    token, _ = pins.add("r1", [3, 4], DIGEST)
    assert pins.open_read("r1", token, DIGEST) == [3, 4]
    clock.now += 1.0
    assert pins.collect() == []  # expired, but its bytes are being sent
    assert pins.release("r1", token)
    assert pins.collect() == []  # released by its reader meanwhile: still being sent
    with pytest.raises(PinError):
        pins.check("r1", token, DIGEST)  # the sender stops at its next chunk
    pins.close_read("r1", "forged")
    assert pins.collect() == []
    pins.close_read("r1", token)
    assert pins.collect() == [("r1", [3, 4], False)]


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


class _Clock:
    """The auth module's `time`, moved by hand: the replay window is 60 s of wall clock."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


def _signed(auth, op: str, body: dict) -> tuple[bytes, bytes]:
    import json as _json

    raw = _json.dumps(body).encode()
    return raw, auth._mac(b"req", op.encode(), raw)


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf"), True])
def test_side_channel_auth_refuses_a_non_finite_timestamp(ts):
    """Issue 23 item 5: NaN compares false with everything, so it passed the freshness check."""
    from pdserve.worker.kv.auth import AuthError, SideChannelAuth

    server = SideChannelAuth("s" * 20)
    raw, mac = _signed(server, "read", {"ts": ts, "nonce": "n1"})
    with pytest.raises(AuthError, match="stale or undated"):
        server.verify_request(b"read", raw, mac)


def test_a_future_dated_message_cannot_be_replayed_once_its_arrival_window_ends(monkeypatch):
    """Issue 23 item 5: a message dated 50 s ahead stays fresh until 110 s after it arrives; its
    nonce must be remembered that long (it was forgotten 60 s after arrival, then replayable)."""
    from pdserve.worker.kv import auth as auth_module
    from pdserve.worker.kv.auth import WINDOW_S, AuthError, SideChannelAuth

    clock = _Clock(1_000_000.0)
    monkeypatch.setattr(auth_module, "time", clock)
    server = SideChannelAuth("s" * 20)
    ahead = _signed(server, "read", {"ts": clock.now + WINDOW_S - 10, "nonce": "ahead"})
    now = _signed(server, "read", {"ts": clock.now, "nonce": "now"})
    assert server.verify_request(b"read", *ahead)["nonce"] == "ahead"
    assert server.verify_request(b"read", *now)["nonce"] == "now"
    clock.now += WINDOW_S + 1  # the arrival window of both has passed; "ahead" is still fresh
    with pytest.raises(AuthError, match="replayed"):
        server.verify_request(b"read", *ahead)
    with pytest.raises(AuthError, match="stale"):
        server.verify_request(b"read", *now)  # stale now: refused without the cache
    assert b"now" not in server._seen  # and forgotten: the cache holds only what is still acceptable
    clock.now += WINDOW_S  # "ahead" is stale too, and forgotten
    with pytest.raises(AuthError, match="stale"):
        server.verify_request(b"read", *ahead)
    assert not server._seen


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_run_starts_agree_with_merge_runs(pairs):
    import numpy as np

    from pdserve.worker.kv.block_runs import as_indices, run_starts

    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    starts = run_starts(as_indices(src), as_indices(dst))
    ends = list(starts[1:]) + [len(src)]
    assert [(src[a], dst[a], b - a) for a, b in zip(starts, ends)] == merge_runs(src, dst)
    assert as_indices(src).dtype == np.int32 and list(as_indices(src)) == src


def test_a_wake_is_drained_so_the_side_channel_thread_sleeps_in_poll():
    """A wake left unread would make every poll return at once: a thread spinning on the GIL
    beside the engine's step thread (it cost a streamed prefill 200 ms per chunk on a GPU)."""
    import select
    import time

    from pdserve.worker.kv.auth import SideChannelAuth
    from pdserve.worker.kv.side_channel import SideChannelServer
    from tests.net import free_port

    server = SideChannelServer("127.0.0.1", free_port(), {}, SideChannelAuth(None))
    server.start()
    try:
        server.wake()
        deadline = time.monotonic() + 10
        while select.select([server._wake_r], [], [], 0)[0]:
            assert time.monotonic() < deadline, "the wake was never drained"
            time.sleep(0.01)
    finally:
        server.stop()


def test_rank_aggregator_reports_a_pull_or_pin_once_every_rank_is_done():
    """Rank 0 of a TP=3 worker: a pull is done only when both followers reported it, failed if
    either failed; a pin's blocks are free only when rank 0's and both followers' pins are gone."""
    from pdserve.worker.kv.rank_aggregator import RankAggregator

    agg = RankAggregator(followers=2)
    agg.pull_started("a")
    agg.pull_started("b")
    agg.report(("pulled", 1, "a", None))
    assert agg.followers_pulling("a")
    agg.report(("pulled", 2, "a", None))
    assert not agg.followers_pulling("a") and agg.finish_pull("a") is None
    agg.report(("pulled", 2, "b", "connection reset"))
    agg.report(("pulled", 1, "b", "timed out"))
    assert not agg.followers_pulling("b")
    assert agg.finish_pull("b") == "rank 2: connection reset"  # the first failure is the one said
    assert agg.finish_pull("b") is None  # forgotten once finished

    agg.report(("unpinned", 1, "p"))
    agg.pin_gone_here("p")
    assert agg.sent() == []  # rank 2 still holds its shard's pin
    agg.report(("unpinned", 2, "p"))
    assert agg.sent() == ["p"] and agg.sent() == []  # reported once


def test_the_taper_split_on_known_prompts():
    def cut(left, tail):
        chunks = []
        while left:
            chunks.append(taper_chunk(left, tail))
            left -= chunks[-1]
        return chunks
    assert cut(3000, 512) == [1464, 1024, 512]
    assert cut(16384, 512) == [8704, 4096, 2048, 1024, 512]
    assert cut(512, 512) == [512] and cut(300, 512) == [300] and cut(513, 512) == [1, 512]


def test_the_auto_split_tapers_over_tcp_and_keeps_the_tail_over_nixl():
    assert resolve_split("auto", "tcp") == "taper"
    assert resolve_split("auto", "nixl") == "tail" and resolve_split("auto", None) == "tail"
    assert [resolve_split(s, "tcp") for s in ("tail", "even", "taper")] == ["tail", "even", "taper"]


@given(st.integers(1, 1 << 17), st.integers(1, 4096))
@settings(max_examples=300, deadline=None)
def test_taper_chunks_halve_towards_the_tail(left, tail):
    """Whatever is left: the chunks cover it exactly, end with the tail (or all of a prompt no
    longer than it), each but the first twice the next, the first never smaller than the second
    (but under two tails, where the head is what the tail leaves, as --kv-stream-split tail
    cuts it), in about log2(left / tail) steps."""
    chunks = []
    while left - sum(chunks):
        chunks.append(taper_chunk(left - sum(chunks), tail))
        assert chunks[-1] > 0
    assert sum(chunks) == left
    assert chunks[-1] == min(left, tail)
    assert len(chunks) < 3 or chunks[0] >= chunks[1]
    assert left < 2 * tail or chunks[0] >= chunks[1]
    assert all(a == 2 * b for a, b in zip(chunks[1:], chunks[2:]))
    assert len(chunks) <= max(1, (left // tail).bit_length() + 1)


def test_a_cpu_layer_clock_counts_the_layers_its_forward_passed():
    """On the CPU the forward's mark is the fact: done() follows it, wait() returns once the layer
    is passed and gives up (False) at its timeout when the forward does not get there."""
    import threading

    import torch

    from pdserve.worker.kv.layer_clock import LayerClock

    clock = LayerClock(4, torch.device("cpu"))
    assert clock.done() == 0 and not clock.wait(1, 0.01)
    clock.after_layer(0)
    clock.after_layer(1)
    assert clock.done() == 2 and clock.wait(2, 0)
    waiter = threading.Thread(target=lambda: clock.after_layer(2))
    waiter.start()
    assert clock.wait(3, 10)  # woken by the mark, not by a timeout
    waiter.join()
    assert clock.done() == 3 and not clock.wait(4, 0.01)


def test_a_pin_holds_each_launched_steps_blocks_until_its_collection():
    """`computing` adds (blocks the step completes, its clock) in launch order; an advance drops
    the steps it covers, finish and cancel drop all; a step computing nothing new is not added."""
    pins = PinTable(ttl=30)
    digest = prompt_digest([1, 2, 3])
    token = pins.add_streamed("r", list(range(10)), digest, ready=2)
    first, second = object(), object()
    pins.computing("r", 2, object())  # nothing past what is ready
    pins.computing("r", 6, first)
    pins.computing("r", 99, second)  # capped at the pin's blocks
    assert pins.readiness("r", token, digest) == (2, [(6, first), (10, second)], 10)
    assert pins.wait_ready("r", token, digest, 8, 0, computing_ok=True)  # a launched step computes block 7
    assert not pins.wait_ready("r", token, digest, 8, 0)
    pins.advance("r", 6)
    assert pins.readiness("r", token, digest) == (6, [(10, second)], 10)
    pins.finish("r", first_token_id=5)
    assert pins.readiness("r", token, digest) == (10, [], 10)


def test_a_layered_reader_hears_of_each_layer_a_running_step_writes():
    """A layered progress (NIXL) counts a launched step's blocks as ready once its forward passed
    every layer, names the step writing the next blocks with its layers written (`partial`),
    and defers with that step's clock and the next layer to wait for; a reader without
    `layers` gets whole collected blocks only, as before."""
    import torch

    from pdserve.worker.kv.layer_clock import LayerClock

    pins = PinTable(ttl=30)
    token = pins.add_streamed("r", list(range(10)), DIGEST, ready=2)
    first, second = LayerClock(4, torch.device("cpu")), LayerClock(4, torch.device("cpu"))
    pins.computing("r", 6, first)
    pins.computing("r", 10, second)
    with pytest.raises(NotReady) as e:  # launched, no layer written yet
        pins.progress("r", token, DIGEST, 2, layers=0)
    assert e.value.clock is first and e.value.layer == 1
    first.after_layer(0)
    first.after_layer(1)
    assert pins.progress("r", token, DIGEST, 2, layers=0) == {
        "ready": 2, "state": "running", "first_token_id": None, "last": False, "partial": [6, 2, 4]}
    with pytest.raises(NotReady) as e:
        pins.progress("r", token, DIGEST, 2, layers=2)
    assert e.value.clock is first and e.value.layer == 3
    with pytest.raises(NotReady) as e:  # the old reader's question: nothing new, no clock to wait on
        pins.progress("r", token, DIGEST, 2)
    assert e.value.clock is None
    for i in (2, 3):
        first.after_layer(i)
    second.after_layer(0)
    state = pins.progress("r", token, DIGEST, 2, layers=2)  # the first step is through, not collected
    assert state["ready"] == 6 and state["partial"] == [10, 1, 4]
    with pytest.raises(NotReady):
        pins.progress("r", token, DIGEST, 2)  # collected blocks only
    pins.advance("r", 6)
    assert pins.progress("r", token, DIGEST, 2)["ready"] == 6 and "partial" not in pins.progress("r", token, DIGEST, 2)
    pins.finish("r", 9)
    assert pins.progress("r", token, DIGEST, 6, layers=1) == {"ready": 10, "state": "done", "first_token_id": 9,
                                                              "last": False}


def test_a_clock_watch_wakes_once_the_layer_is_written_and_gives_up_on_one_never_reached():
    """The side channel's deferred layered readers are retried when the layer they wait for is
    written (not on a timer); a wait the forward never reaches is dropped after give_up_s."""
    import threading

    import torch

    from pdserve.worker.kv.layer_clock import ClockWatch, LayerClock

    woken = threading.Event()
    watch = ClockWatch(woken.set, give_up_s=600)  # not given up while the test is slow
    try:
        clock = LayerClock(4, torch.device("cpu"))
        watch.watch(clock, 2)
        clock.after_layer(0)
        assert not woken.wait(0.1)  # layer 1 not written: no wake-up
        clock.after_layer(1)
        assert woken.wait(60)
        deadline = time.monotonic() + 60
        while watch._want and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch._want
        woken.clear()
        watch.give_up_s = 0.2
        stale = LayerClock(4, torch.device("cpu"))
        watch.watch(stale, 1)  # its step never runs
        while watch._want and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch._want and not woken.is_set()
    finally:
        watch.stop()


def test_a_layer_clock_wakes_each_waiter_at_its_own_layer_only():
    """A TCP sender waits for a group of layers (or a step's last one); a mark wakes only the
    waiters it brings to their layer: waking every sender at every layer took the GIL ~128 times
    a step from the launch it interleaves with. A waiter that times out leaves nothing behind."""
    import threading

    import torch

    from pdserve.worker.kv.layer_clock import LayerClock

    clock = LayerClock(8, torch.device("cpu"))
    got = {n: threading.Event() for n in (2, 8)}
    threads = [threading.Thread(target=lambda n=n: clock.wait(n, 60) and got[n].set()) for n in got]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(clock._waiters) < 2 and time.monotonic() < deadline:  # both registered
        time.sleep(0.005)
    clock.after_layer(0)
    assert sorted(n for n, _ in clock._waiters) == [2, 8]  # layer 0 reaches neither (either may have registered first)
    clock.after_layer(1)
    assert got[2].wait(30)
    assert [n for n, _ in clock._waiters] == [8] and not got[8].is_set()
    for i in range(2, 8):
        clock.after_layer(i)
    assert got[8].wait(30)
    for t in threads:
        t.join()
    assert not clock.wait(9, 0.01) and clock._waiters == []


class _FakeDevice:
    """The CUDA side of a LayerClock without a GPU (the real one runs in the GPU suite's P/D
    tests): `torch.cuda.Event` replaced by events that complete in record order, one per
    `complete()` of the test, as a stream runs its kernels after the launch has returned."""

    def __init__(self):
        import threading

        self.recorded: list = []
        self.completed = 0
        self._cond = threading.Condition()
        device = self

        class Event:
            def __init__(self, blocking: bool = False):
                self.index = None

            def record(self):
                with device._cond:
                    self.index = len(device.recorded)
                    device.recorded.append(self)

            def query(self) -> bool:
                with device._cond:
                    return self.index is not None and self.index < device.completed

            def synchronize(self):
                with device._cond:
                    device._cond.wait_for(lambda: self.index < device.completed)

        self.Event = Event

    def complete(self, n: int = 1) -> None:
        with self._cond:
            self.completed = min(len(self.recorded), self.completed + n)
            self._cond.notify_all()


@pytest.fixture
def fake_cuda(monkeypatch):
    import torch

    device = _FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", device.Event)
    return device


def test_a_gpu_layer_clock_counts_the_layers_the_device_finished_not_those_launched(fake_cuda):
    """On a GPU the forward's mark is a launch: done() and wait() follow the recorded events'
    completion, in order, and a wait for a launched layer blocks until the device gets there."""
    import threading

    import torch

    from pdserve.worker.kv.layer_clock import LayerClock

    clock = LayerClock(4, torch.device("cuda"))
    for i in range(4):
        clock.after_layer(i)  # the whole forward launched
    assert clock.done() == 0 and len(fake_cuda.recorded) == 4
    fake_cuda.complete(2)
    assert clock.done() == 2 and clock.wait(2, 0)
    got = threading.Event()
    waiter = threading.Thread(target=lambda: clock.wait(3, 0) and got.set())
    waiter.start()
    assert not got.wait(0.1)  # launched, not yet run: the wait holds (no timeout applies to the device)
    fake_cuda.complete()
    assert got.wait(30)
    waiter.join()
    assert clock.done() == 3
    assert not LayerClock(4, torch.device("cuda")).wait(1, 0.01)  # nothing launched: it gives up


def test_a_clock_watch_on_a_gpu_clock_wakes_when_the_device_passes_the_layer(fake_cuda, monkeypatch):
    """A deferred layered reader is woken by the layer's completion on the device: with the
    watch's own poll made an hour, a wake can only come from the event, and it comes once the
    device passed the layer, not when it was launched; the progress then names that layer."""
    import threading

    import torch

    from pdserve.worker.kv.layer_clock import ClockWatch, LayerClock

    monkeypatch.setattr(ClockWatch, "POLL_S", 3600.0)
    pins = PinTable(ttl=30)
    token = pins.add_streamed("r", list(range(4)), DIGEST, ready=0)
    clock = LayerClock(8, torch.device("cuda"))
    pins.computing("r", 4, clock)
    for i in range(8):
        clock.after_layer(i)
    with pytest.raises(NotReady) as e:
        pins.progress("r", token, DIGEST, 0, layers=0)
    assert e.value.clock is clock and e.value.layer == 1
    woken = threading.Event()
    watch = ClockWatch(woken.set, give_up_s=600)
    try:
        watch.watch(clock, e.value.layer)
        assert not woken.wait(0.1)  # every layer launched, none run
        fake_cuda.complete(3)
        assert woken.wait(30)
        assert pins.progress("r", token, DIGEST, 0, layers=0)["partial"] == [4, 3, 8]
        woken.clear()
        watch.watch(clock, 8)
        fake_cuda.complete(5)
        assert woken.wait(30)
        state = pins.progress("r", token, DIGEST, 0, layers=3)  # the step is through: its blocks are ready
        assert state["ready"] == 4 and "partial" not in state
    finally:
        watch.stop()
