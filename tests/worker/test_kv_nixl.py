"""NixlTransport on CPU memory (NIXL's UCX backend moves DRAM here as it moves VRAM on GPUs):
the prepared-descriptor READ and the per-pull descriptor READ land the same bytes, the release
notification reaches the owner, and a peer that does not say its block count is still served.

Both agents live in this process: the transfers are real UCX transfers between two NIXL
agents; the multi-process path (side channel, leases) is tests/worker/test_kv_transfer.py."""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import replace

import pytest
import torch

from pdserve.protocol.kv_layout import KVLayout
from pdserve.worker.kv.nixl_transport import NixlTransport, _delayed_config, import_nixl, nixl_available, progress_delay

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")

BLOCKS, BLOCK_BYTES = 32, 4096
_names = itertools.count()


def transport(fill: bool) -> NixlTransport:
    cache = (torch.randint(0, 255, (BLOCKS, 1, 2, 1, 1, BLOCK_BYTES // 2), dtype=torch.uint8) if fill
             else torch.zeros(BLOCKS, 1, 2, 1, 1, BLOCK_BYTES // 2, dtype=torch.uint8))
    return NixlTransport(f"test-nixl-{next(_names)}", cache, BLOCK_BYTES)


def wait_notifications(t: NixlTransport, n: int) -> list[dict]:
    got, deadline = [], time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        got += t.notifications()
        time.sleep(0.01)
    return got


@pytest.fixture(scope="module")
def pair():
    owner, reader = transport(fill=True), transport(fill=False)
    peer = reader.add_peer("owner", owner.describe())
    assert peer.agent in reader._remote_prep  # the owner's cache prepared once, one descriptor per block
    return owner, reader, peer


@pytest.mark.parametrize("prepped", [True, False])
@pytest.mark.parametrize("after", [True, False])
@pytest.mark.parametrize("src,dst", [
    (list(range(4, 12)), list(range(20, 28))),  # one run each side: NIXL merges it into one descriptor
    ([1, 9, 2, 30, 31], [0, 3, 6, 7, 8]),  # runs that do not line up, out of order
])
def test_read_lands_the_blocks_and_tells_the_owner(pair, prepped, after, src, dst):
    owner, reader, peer = pair
    reader.use_prepped, reader.notify_after_read = prepped, after
    reader.cache.zero_()
    timings = {}
    n = reader.read(peer, src, dst, {"op": "release", "request_id": "r", "token": "t"}, 10.0, timings)
    assert n == len(src) * BLOCK_BYTES
    mine, theirs = reader.cache.view(BLOCKS, -1), owner.cache.view(BLOCKS, -1)
    assert torch.equal(mine[dst], theirs[src])
    untouched = [b for b in range(BLOCKS) if b not in dst]
    assert not mine[untouched].any()
    assert wait_notifications(owner, 1) == [{"op": "release", "request_id": "r", "token": "t"}]
    assert set(timings) == {"prepare", "post", "wait", "release", "notify"}


def test_a_peer_without_its_block_count_is_read_with_per_pull_descriptors():
    owner, reader = transport(fill=True), transport(fill=False)
    desc = {k: v for k, v in owner.describe().items() if k != "num_blocks"}  # as an older worker sends it
    peer = reader.add_peer("old", desc)
    assert desc["agent"] not in reader._remote_prep
    reader.read(peer, [3, 4, 5], [0, 1, 2], None, 10.0)
    assert torch.equal(reader.cache[:3], owner.cache[3:6])


def test_read_refuses_lists_of_different_lengths(pair):
    _, reader, peer = pair
    with pytest.raises(ValueError, match="2 source blocks for 1 destination"):
        reader.read(peer, [0, 1], [0], None, 10.0)


def _owner(conn, nbytes: int) -> None:
    """Owner process: registers one span, hands over its partial metadata, deregisters on cue."""
    from pdserve.worker.kv.nixl_transport import import_nixl

    nixl_agent, nixl_agent_config = import_nixl()
    agent = nixl_agent("dereg-owner", nixl_agent_config(enable_listen_thread=False, backends=["UCX"]))
    buf = torch.arange(2 * nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    reg = agent.register_memory([(buf.data_ptr() + nbytes, nbytes, 0, "")], "DRAM")
    conn.send((buf.data_ptr() + nbytes, agent.get_partial_agent_metadata(reg, inc_conn_info=True)))
    conn.recv()
    agent.deregister_memory(reg)
    conn.send("deregistered")
    conn.recv()


@pytest.mark.parametrize("ucx_tls", [None, "tcp"])
def test_deregistration_does_not_revoke_a_peers_read(ucx_tls, monkeypatch):
    """Why pdserve has no per-lease NIXL registration (docs/security.md): on UCX's CPU
    transports a peer that was given a registration's metadata still READs the bytes after the
    owner deregistered it. If a NIXL/UCX release changes this, this test fails: revisit the doc."""
    import multiprocessing as mp

    from pdserve.worker.kv.nixl_transport import import_nixl

    if ucx_tls:
        monkeypatch.setenv("UCX_TLS", ucx_tls)
    nbytes = 64 * 1024
    expected = torch.arange(2 * nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)[nbytes:]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child, nbytes))
    proc.start()
    try:
        assert conn.poll(60), "owner process did not start"
        addr, metadata = conn.recv()
        nixl_agent, nixl_agent_config = import_nixl()
        peer = nixl_agent(f"dereg-peer-{ucx_tls}", nixl_agent_config(enable_listen_thread=False, backends=["UCX"]))
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        peer.register_memory(dst)
        peer.add_remote_agent(metadata)

        def read() -> str:
            handle = peer.initialize_xfer("READ", peer.get_xfer_descs([(dst.data_ptr(), nbytes, 0)], "DRAM"),
                                          peer.get_xfer_descs([(addr, nbytes, 0)], "DRAM"), "dereg-owner")
            state, deadline = peer.transfer(handle), time.monotonic() + 30
            while state == "PROC" and time.monotonic() < deadline:
                state = peer.check_xfer_state(handle)
            peer.release_xfer_handle(handle)
            return state

        assert read() == "DONE" and torch.equal(dst, expected)
        conn.send("deregister")
        assert conn.recv() == "deregistered"
        dst.zero_()
        assert read() == "DONE" and torch.equal(dst, expected)  # the residual risk, demonstrated
    finally:
        conn.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


# -- the connector's NIXL pull: lease round trip overlapped with the READ ------------------------

DIGEST = "d" * 32


@pytest.fixture(scope="module")
def connectors():
    """A prefill and a decode KVConnector in this process, talking over a real side channel
    (ZMQ on loopback) and NIXL."""
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.kv.connector import KVConnector
    from tests.net import free_port

    port = free_port()
    shape = (BLOCKS, 1, 2, 1, 1, BLOCK_BYTES // 2)
    layout = KVLayout(1, 1, BLOCK_BYTES // 2, "uint8", 1)
    p = KVConnector(EngineConfig(role="prefill", kv_transfer="nixl", kv_host="127.0.0.1", kv_port=port),
                    torch.randint(0, 255, shape, dtype=torch.uint8), "overlap-p", layout)
    p.start_server()
    d = KVConnector(
        EngineConfig(role="decode", kv_transfer="nixl", kv_port=free_port(), kv_peer_allow=("127.0.0.1",)),
        torch.zeros(shape, dtype=torch.uint8),
        "overlap-d",
        layout,
    )
    yield p, d
    d.shutdown()
    p.shutdown()


def _released(p, rid: str) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if rid not in p.pins._pins or p.pins._pins[rid].released:
            return True
        time.sleep(0.02)
    return False


def test_pulls_from_a_known_peer_overlap_the_lease_and_land_the_bytes(connectors, monkeypatch):
    from pdserve.worker.kv import connector, side_channel

    p, d = connectors
    events = []
    post_read, call = d.kv.post_read, side_channel.call
    monkeypatch.setattr(d.kv, "post_read", lambda *a, **k: events.append("read") or post_read(*a, **k))
    monkeypatch.setattr(connector.side_channel, "call", lambda *a, **k: events.append(a[2]) or call(*a, **k))
    for i, (src, dst) in enumerate([([3, 4, 5], [10, 11, 12]), ([7, 20], [0, 30])]):
        params = p.pin(f"ok{i}", src, len(src), 0, DIGEST)
        assert d._pull(params, list(range(len(src))), dst, DIGEST) == len(src) * BLOCK_BYTES
        assert torch.equal(d.blocks[dst], p.blocks[src])
        assert _released(p, f"ok{i}")  # the notification after the READ released the pin
    # First pull: the lease brings the peer's metadata, then the READ. Second: READ posted first.
    assert events == ["lease", "read", "read", "lease"]


def test_forged_block_ids_read_early_are_abandoned(connectors):
    """Params naming other blocks than their pin (same count): the early READ of the named
    blocks is abandoned when the lease answers with the pin's blocks, and the pull fails."""
    from pdserve.worker.kv.side_channel import SideChannelError

    p, d = connectors
    d._pull(p.pin("warm", [0], 1, 0, DIGEST), [0], [0], DIGEST)  # the peer is known: the early READ path
    forged = replace(p.pin("victim", [1, 2], 2, 0, DIGEST), remote_block_ids=(8, 9))
    with pytest.raises(SideChannelError, match="leased other blocks"):
        d._pull(forged, [0, 1], [14, 15], DIGEST)
    assert _released(p, "victim")  # the failed pull told the prefill side it will not read


def test_wrong_prompt_digest_is_refused_by_the_lease(connectors):
    from pdserve.worker.kv.side_channel import SideChannelError

    p, d = connectors
    d._pull(p.pin("warm2", [0], 1, 0, DIGEST), [0], [0], DIGEST)
    params = p.pin("other-prompt", [5], 1, 0, DIGEST)
    with pytest.raises(SideChannelError, match="prompt mismatch"):
        d._pull(params, [0], [16], "e" * 32)


# -- one descriptor per run (issue 24): NIXL's own count, the bytes it moved ---------------------

def _mixed_layout(blocks: int) -> tuple[list[int], list[int]]:
    """(source, destination) ids: a long run, a run whose destination breaks halfway, scattered
    singles, and a run going down (no two ids consecutive)."""
    src = list(range(2, 12)) + [20, 21, 22, 23] + [30, 34, 38] + [50, 49, 48]
    dst = list(range(40, 50)) + [0, 1, 60, 61] + [5, 9, 13] + [20, 21, 22]
    assert max(src + dst) < blocks and len(set(src)) == len(set(dst)) == len(src)
    return src, dst


@pytest.mark.parametrize("prepped", [True, False])
def test_a_pull_posts_one_descriptor_per_run_and_moves_exactly_those_bytes(prepped):
    from pdserve.worker.kv.block_runs import merge_runs

    blocks = 64
    owner = NixlTransport(f"test-nixl-{next(_names)}", torch.randint(0, 255, (blocks, BLOCK_BYTES), dtype=torch.uint8),
                          BLOCK_BYTES)
    reader = NixlTransport(f"test-nixl-{next(_names)}", torch.zeros(blocks, BLOCK_BYTES, dtype=torch.uint8),
                           BLOCK_BYTES, capture_telemetry=True)
    peer = reader.add_peer("owner", owner.describe())
    reader.use_prepped = prepped
    src, dst = _mixed_layout(blocks)
    runs = merge_runs(src, dst)
    assert len(runs) == 1 + 2 + 3 + 3  # 10 blocks in one run; 2 + 2; singles; the down run is 3 singles
    xfer = reader.post_read(peer, src, dst, None)
    reader._wait(xfer.handle, xfer.state, xfer.agent, 10.0)  # NIXL answers telemetry once DONE
    posted = reader.agent.get_xfer_telemetry(xfer.handle).descCount  # its count, after its merging
    assert reader.finish_read(xfer, 10.0) == len(src) * BLOCK_BYTES
    assert posted == xfer.descriptors == len(runs)
    assert torch.equal(reader.cache[dst], owner.cache[src])
    untouched = [b for b in range(blocks) if b not in dst]
    assert not reader.cache[untouched].any()  # nothing outside the destination blocks was written


def _thread_cpu_s(tids: set[int]) -> float:
    ticks = 0
    for tid in tids:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("delay_us", [1000, 2500])
def test_progress_delay_reaches_the_agent_config(delay_us):
    """Whatever nixl_agent's constructor writes into pthrDelay, the agent gets the delay asked for;
    the bindings' class is back once the agent is made."""
    bindings = sys.modules[import_nixl()[0].__module__].nixlBind
    base = bindings.nixlAgentConfig
    with progress_delay(delay_us):
        config = bindings.nixlAgentConfig()
        config.pthrDelay = 0  # what the constructor does
        config.useProgThread = True
        assert (config.pthrDelay, config.useProgThread) == (delay_us, True)
    assert bindings.nixlAgentConfig is base and base().pthrDelay != delay_us


def test_a_config_class_out_of_reach_leaves_nixls_default():
    """A wheel without the class, or with one that cannot be subclassed or ignores the value, gets
    None (the caller warns and makes NIXL's default busy thread) instead of a failed start."""
    class Plain:
        pthrDelay = 0

    class Frozen:
        def __setattr__(self, key, value):
            pass

    config = _delayed_config(Plain, 1000)()
    config.pthrDelay = 0
    assert isinstance(config, Plain) and config.pthrDelay == 1000
    assert _delayed_config(None, 1000) is None
    assert _delayed_config(bool, 1000) is None  # not subclassable
    assert _delayed_config(Frozen, 1000) is None  # the value does not stick


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="per-thread CPU times are read from /proc")
def test_an_idle_agents_progress_thread_sleeps():
    """NIXL's Python constructor makes a progress thread that busy-polls (a core per idle worker);
    ours waits on UCX's event fds. Its threads' CPU over 2 s idle stays far under the ~2 s a spinning
    thread takes on a free core (a loaded machine can only lower the figure, never raise it)."""
    before = {int(t) for t in os.listdir("/proc/self/task")}
    owner = transport(fill=True)
    nixl_threads = {int(t) for t in os.listdir("/proc/self/task")} - before
    assert nixl_threads, "NIXL started no thread: nothing to measure"
    try:
        start = _thread_cpu_s(nixl_threads)
        time.sleep(2.0)
        assert _thread_cpu_s(nixl_threads) - start < 1.0  # waiting: ~0.05 s; spinning on a free core: ~2 s
    finally:
        owner.close()
