"""Staging buffers for heterogeneous tensor-parallel pulls (worker/kv/staging.py).

First the pool on its own, with a counting register/deregister pair standing in for NIXL's (the
pool's whole contract with the transport is those two calls); then real NIXL agents in process
(UCX moving DRAM), decode connectors pulling from prefill connectors of another TP size: the
staging buffer is registered once across pulls, a pull longer than a slot's cap goes in chunks
into the same buffer, two pulls held inside their READs at the same time use two buffers and
both land every head where it belongs, and shutdown deregisters everything.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.protocol.kv_layout import KVLayout
from pdserve.protocol.kv_transfer import KVTransferParams
from pdserve.worker.kv.nixl_transport import nixl_available
from pdserve.worker.kv.staging import StagingBusy, StagingPool

KIB = 1 << 10


class Registry:
    """Counts what the pool registers; checks it never deregisters twice or frees unregistered memory."""

    def __init__(self):
        self.live: dict[int, torch.Tensor] = {}
        self.count = 0

    def register(self, t: torch.Tensor):
        self.count += 1
        self.live[self.count] = t
        return self.count

    def deregister(self, handle) -> None:
        assert handle in self.live, "deregistered twice"
        del self.live[handle]


def pool_of(cap=64 * KIB, floor=16 * KIB, slots=2):
    reg = Registry()
    pool = StagingPool(torch.device("cpu"), cap, reg.register, reg.deregister, max_slots=slots)
    pool.floor = floor
    return pool, reg


def test_a_slot_is_registered_once_and_grows_only_when_a_pull_needs_more():
    pool, reg = pool_of()
    for n in (100, 5 * KIB, 16 * KIB, 1):  # all within the first size (the floor)
        with pool.take(n, 1) as slot:
            assert slot.capacity == 16 * KIB
    assert reg.count == pool.registrations == 1
    with pool.take(20 * KIB, 1) as slot:  # more: twice the old size, the old one deregistered
        assert slot.capacity == 32 * KIB
    with pool.take(40 * KIB, 1) as slot:
        assert slot.capacity == 64 * KIB  # twice would pass the cap: the cap
    with pool.take(100 * KIB, 1) as slot:
        assert slot.capacity == 100 * KIB  # one block over the cap (the caller chunks by blocks_per_chunk)
    assert reg.count == 4 and len(reg.live) == pool.registered == 1
    assert pool.blocks_per_chunk(10 * KIB) == 6 and pool.blocks_per_chunk(100 * KIB) == 1
    pool.close()
    assert not reg.live and pool.registered == 0


def test_concurrent_takers_never_share_a_slot_and_wait_when_all_are_taken():
    pool, reg = pool_of(slots=2)
    with pool.take(KIB, 1) as a, pool.take(KIB, 1) as b:
        assert a is not b and a.data.data_ptr() != b.data.data_ptr()
        with pytest.raises(StagingBusy, match="all 2 KV staging buffers stayed in use"):
            with pool.take(KIB, 0.05):
                pass
        got = []
        waiter = threading.Thread(target=lambda: got.append(pool.take(KIB, 10).__enter__()))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # waits for a slot...
    waiter.join(10)
    assert got and got[0] in (a, b) and reg.count == 2  # ...and gets one given back, no new buffer
    pool._give_back(got[0])
    pool.close()
    assert not reg.live


def test_a_retired_slot_is_never_handed_out_again_and_freed_at_close():
    pool, reg = pool_of(slots=1)
    with pool.take(KIB, 1) as slot:
        slot.retire = True  # a READ into it timed out: it may still be written
        retired = slot.data
    with pool.take(KIB, 1) as fresh:
        assert fresh is not slot and fresh.data.data_ptr() != retired.data_ptr()
    assert len(reg.live) == 2  # the retired one stays registered (and alive) until close
    pool.close()
    assert not reg.live and pool.registered == 0
    with pytest.raises(StagingBusy, match="shutting down"):
        with pool.take(KIB, 1):
            pass


# -- real NIXL agents in process: prefill ranks on port, port + 1; decode connectors pull --------

SECRET = "kv-staging-tests-secret"
LAYERS, BS, KV, DIM, BLOCKS = 2, 4, 2, 8, 32
BLOCK = LAYERS * 2 * BS * KV * DIM * 4  # a full-head fp32 block: 1 KiB
LAYOUT = KVLayout(1, 1, 1, "float32", 16)  # what the params name (16 tokens a block); a pull compares none


@pytest.fixture
def nixl_world():
    if not nixl_available():
        pytest.skip("needs the nixl extra (pip install 'pdserve[nixl]')")
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.kv.connector import KVConnector
    from pdserve.worker.kv.prompt_binding import prompt_digest
    from pdserve.worker.kv.tp_transfer import TPRank
    from tests.worker.test_tp_pd import free_kv_ports

    made = []

    def connector(name, size, rank, seed):
        g = torch.Generator().manual_seed(seed)
        cache = torch.randn(BLOCKS, LAYERS, 2, BS, KV // size, DIM, generator=g)
        config = EngineConfig(device="cpu", kv_transfer="nixl", kv_port=free_kv_ports(), kv_peer_allow=("127.0.0.1",),
                              kv_secret=SECRET, kv_pull_timeout=60)  # generous: a loaded CI machine
        c = KVConnector(config, cache, name, LAYOUT, tp=TPRank(rank, size, KV))
        made.append(c)
        return c

    def prefill(name, size):
        port = free_kv_ports()
        ranks = []
        for r in range(size):
            c = connector(name, size, r, r)
            c.port = port + r  # rank r serves on port + r, as a TP worker's ranks do
            c.start_server()
            ranks.append(c)
        return ranks

    def pin(ranks, rid, src_ids):
        """Pin `src_ids` on every prefill rank under one token: the params a decode worker gets."""
        digest = prompt_digest([len(src_ids), *src_ids])
        token = None
        for c in ranks:
            token, _ = c.pins.add(rid, src_ids, digest, token=token)
        params = {"remote_engine_id": ranks[0].engine_id, "remote_host": "127.0.0.1", "remote_port": ranks[0].port,
                  "remote_request_id": rid, "transfer_token": token, "kv_tp_size": len(ranks), "transport": "nixl",
                  # the rest of a decode request's params: a pull reads only the fields above
                  "remote_block_ids": list(src_ids), "num_prompt_tokens": 16 * len(src_ids), "first_token_id": 0,
                  "kv_layout": str(LAYOUT)}
        return KVTransferParams.from_dict(params), digest

    def pull(dec, params, digest, dst_ids):
        dec._pull(params, list(range(len(dst_ids))), dst_ids, digest)

    yield connector, prefill, pin, pull
    for c in made:
        c.shutdown()


def expected(ranks, src_ids, dec):
    """What decode rank `dec` must hold: the prefill's heads of those blocks, its own slice of them."""
    full = torch.cat([r.cache[src_ids] for r in ranks], dim=4)
    heads = dec.tp.heads
    return full[:, :, :, :, heads.start:heads.stop]


def test_heterogeneous_pulls_register_the_staging_buffer_once(nixl_world):
    connector, prefill, pin, pull = nixl_world
    p2, p1 = prefill("p2", 2), prefill("p1", 1)
    d1 = connector("d1", 1, 0, 99)  # reads both TP=2 ranks and interleaves their heads
    d2 = connector("d2", 2, 1, 98)  # reads the TP=1 full-head blocks and keeps head 1
    for d in (d1, d2):
        d.kv.staging.cap = d.kv.staging.floor = 64 * KIB  # one slot holds every pull below
    for i, (src, dst) in enumerate([([3, 4, 9], [7, 1, 2]), ([0], [5]), ([10, 11, 12, 13, 20], [8, 9, 10, 11, 3])]):
        for prefill_ranks, d in ((p2, d1), (p1, d2)):
            params, digest = pin(prefill_ranks, f"req{i}", src)
            pull(d, params, digest, dst)
            assert torch.equal(d.cache[dst], expected(prefill_ranks, src, d)), f"pull {i} landed wrong bytes"
    assert d1.kv.staging.registrations == 1 and d2.kv.staging.registrations == 1

    # A pull longer than a slot's cap goes in chunks (a lease each) through the same buffer.
    d1.kv.staging.cap = 2 * BLOCK
    src, dst = list(range(14, 24)), list(range(12, 22))
    params, digest = pin(p2, "long", src)
    pull(d1, params, digest, dst)
    assert torch.equal(d1.cache[dst], expected(p2, src, d1))
    assert d1.kv.staging.registrations == 1

    for d in (d1, d2):
        d.shutdown()
        assert d.kv.staging.registered == 0


def test_concurrent_heterogeneous_pulls_use_their_own_staging_buffers(nixl_world):
    """Both pulls are held inside their READs at the same time (a barrier on the transport's
    post): each must have its own buffer, and both land exactly their own requests' heads."""
    connector, prefill, pin, pull = nixl_world
    p2 = prefill("p2", 2)
    d1 = connector("d1", 1, 0, 97)
    d1.kv.staging.cap = d1.kv.staging.floor = 64 * KIB
    warm, digest = pin(p2, "warm", [1, 2])
    pull(d1, warm, digest, [30, 31])  # one buffer exists and is free before the race
    assert d1.kv.staging.registrations == 1

    barrier = threading.Barrier(2, timeout=60)
    post = d1.kv.post_read_into

    def post_together(*args):
        barrier.wait()
        return post(*args)

    d1.kv.post_read_into = post_together
    jobs = [("a", [3, 4, 5, 6], [0, 1, 2, 3]), ("b", [7, 8, 9, 10, 11, 12], [4, 5, 6, 7, 8, 9])]
    futures = []
    for rid, src, dst in jobs:
        params, digest = pin(p2, rid, src)
        futures.append(d1.pool.submit((rid, 0), d1._pull, params, list(range(len(dst))), dst, digest))
    for f in futures:
        f.result(timeout=60)
    for rid, src, dst in jobs:
        assert torch.equal(d1.cache[dst], expected(p2, src, d1)), f"pull {rid} landed wrong bytes"
    assert d1.kv.staging.registrations == 2  # the second concurrent pull made (and registered) its own
