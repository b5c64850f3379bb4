"""The host KV tier (--kv-offloading-size): a prefix the device cache evicted comes back from host
memory, exactly, and is counted as cached; without the tier it is recomputed. In-process engines
over a tiny checkpoint with a 16-block device cache, so three prompts evict each other; a tiny
gpt-oss (sliding-window layers: the hybrid KV cache) the same way."""

from __future__ import annotations

import pytest

from pdserve.protocol.flags import ConfigError
from pdserve.worker.engine.block_manager import hash_prefix_blocks
from pdserve.worker.engine.host_tier_index import UNREPORTED, HostBlock, HostTierIndex
from pdserve.worker.request.sampling_params import SamplingParams
from pdserve.worker.server.metrics import _EngineCollector
from tests.helpers.engines import engine_config, make_engine

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# 30 tokens each: 8 blocks of 4 (7 full ones a later request can hit) + room for 4 new tokens.
A, B, C, D, E = ([base + 3 * i for i in range(30)] for base in (100, 400, 700, 1000, 1300))
DEVICE_BLOCKS = 16  # two of these requests' blocks: running B then C evicts every block of A
HYBRID_DEVICE_BLOCKS = 17  # and the null block among them: a prompt prefills in 8 full + 8 sliding ones


class Events:
    """Stands in for the ZMQ publisher: the engine's KV events, as published."""

    def __init__(self):
        self.events: list[dict] = []

    def publish(self, events):
        self.events += events

    def close(self):
        pass

    def of(self, kind: str, medium: str) -> set[int]:
        return {h for e in self.events if e["type"] == kind and e.get("medium") == medium for h in e["block_hashes"]}


def run(engine, prompt) -> tuple[list[int], int]:
    """Greedy tokens of `prompt` and its cached prompt tokens (what usage.cached_tokens reports)."""
    rid = f"r{engine.stats().prefix_cache_queries}-{prompt[0]}"
    engine.add_request(rid, prompt, GREEDY)
    tokens, cached = [], None
    while engine.has_work():
        for o in engine.step():
            assert o.request_id == rid
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    return tokens, cached


@pytest.fixture(scope="module")
def per_block(tiny_checkpoint) -> int:
    return make_engine(tiny_checkpoint("llama")).kv_cache.block_bytes


@pytest.fixture(scope="module")
def fresh(tiny_checkpoint, per_block) -> list[tuple[list[int], int]]:
    """A, B, C, A without the tier: A's blocks are evicted by then and it is recomputed."""
    plain = make_engine(tiny_checkpoint("llama"), kv_cache_memory=DEVICE_BLOCKS * per_block, max_model_len=64)
    outs = [run(plain, p) for p in (A, B, C, A)]
    assert [cached for _, cached in outs] == [0, 0, 0, 0]
    return outs


def engine_with(ckpt, per_block: int, host_blocks: int, **kw):
    engine = make_engine(ckpt, kv_cache_memory=DEVICE_BLOCKS * per_block, max_model_len=64,
                         kv_offloading_size=host_blocks * per_block / 2**30, **kw)
    engine._kv_event_publisher = Events()
    return engine


# Async scheduling: the step that restores is planned while the one before is still in flight.
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_evicted_prefix_comes_back_from_the_host_tier(tiny_checkpoint, per_block, fresh, async_scheduling):
    ckpt = tiny_checkpoint("llama")
    engine = engine_with(ckpt, per_block, host_blocks=64, async_scheduling=async_scheduling)
    assert engine.async_scheduling == async_scheduling
    events = engine._kv_event_publisher
    tiered = [run(engine, p) for p in (A, B, C, A)]
    assert [t for t, _ in tiered] == [t for t, _ in fresh]  # exact, whichever tier A's KV came from
    assert [cached for _, cached in tiered] == [0, 0, 0, 28]  # 7 full blocks back from the host
    tier = engine.stats().host_tier
    assert tier.restored_blocks == 7 and tier.hits == 28 and tier.queries >= 28
    assert tier.restored_bytes == 7 * per_block and tier.stored_bytes >= 7 * per_block
    assert engine.stats().prefix_cache_hits == 0  # none from the device cache: vllm:prefix_cache_hits

    a = hash_prefix_blocks(A, 4)[:7]
    # Offloaded: removed from the device (GPU), stored on the host (CPU); restored: stored on GPU again.
    assert set(a) <= events.of("BlockRemoved", "GPU") & events.of("BlockStored", "CPU")
    on_gpu = [e for e in events.events if e["type"] == "BlockStored" and e["medium"] == "GPU"
              and e["block_hashes"][:7] == a]
    assert len(on_gpu) == 2 and on_gpu[1]["token_ids"][:28] == A[:28]  # computed, then restored
    assert not events.of("BlockRemoved", "CPU")  # the tier had room for everything

    series = {(s.name, s.labels.get("direction")): s.value
              for m in _EngineCollector("m", engine.stats).collect() for s in m.samples}
    assert series["vllm:external_prefix_cache_hits_total", None] == 28
    assert series["pdserve_kv_offload_restored_blocks_total", None] == 7
    assert series["pdserve_kv_offload_bytes_total", "restore"] == 7 * per_block
    from tests.charts.test_dashboards import HOST_TIER_ONLY  # what the host tier's dashboard panels read

    assert HOST_TIER_ONLY <= {name for name, _ in series}


def test_the_host_tier_drops_its_least_recently_used_blocks(tiny_checkpoint, per_block):
    # A host tier of 8 blocks holds about one request's blocks: the blocks of the prompts after A,
    # evicted later, push A's out of it (least recently used first).
    engine = engine_with(tiny_checkpoint("llama"), per_block, host_blocks=8)
    events = engine._kv_event_publisher
    outs = [run(engine, p) for p in (A, B, C, D, E, A)]
    assert outs[-1][1] == 0  # A recomputed: the tier dropped it
    tier = engine.stats().host_tier
    assert tier.evicted_blocks > 0 and tier.num_blocks == tier.num_slots == 8
    assert set(hash_prefix_blocks(A, 4)[:7]) & events.of("BlockRemoved", "CPU")


def test_host_tier_index_lru_and_locks():
    tier = HostTierIndex(2)
    info = HostBlock(None, (1, 2), None)
    assert tier.store(1, info) == (0, None) and tier.store(2, info) == (1, None)
    assert tier.store(1, info) == (None, None)  # held already: made most recent, nothing copied
    assert tier.store(3, info) == (1, 2)  # 2 is the least recently used
    assert tier.lookup([1, 3, 9]) == [0, 1]  # the run from the first hash, locked for the restore
    assert tier.store(4, info) == (None, None)  # every slot a restore reads: nothing overwritten
    tier.unlock_all()
    assert tier.store(4, info) == (0, 1)
    assert 4 in tier and 1 not in tier and len(tier) == 2
    assert tier.store(5, UNREPORTED) == (1, 3)
    assert tier.store(6, info) == (0, 4)
    assert tier.store(7, info) == (1, None) and tier.evicted_blocks == 5  # 5 dropped unnamed: no event names it


def test_bad_kv_offloading_size(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    with pytest.raises(ConfigError, match="--kv-offloading-size"):
        engine_config(ckpt, kv_offloading_size=-1.0)
    with pytest.raises(ConfigError, match="--kv-offloading-size.*--enable-prefix-caching"):
        engine_config(ckpt, kv_offloading_size=1.0, enable_prefix_caching=False)
    engine_config(ckpt, kv_offloading_size=1.0, role="prefill", kv_transfer="tcp")  # beside P/D: accepted
    with pytest.raises(ConfigError, match="--kv-offloading-size.*more than this host can hold"):
        make_engine(ckpt, kv_offloading_size=1e6)


def test_a_sliding_window_model_gets_both_groups_back(tiny_checkpoint):
    # gpt-oss (window 8: the hybrid KV cache): A's full blocks come back from the tier, and of its
    # sliding blocks only the window that the first query computed reads; under async scheduling.
    ckpt = tiny_checkpoint("gpt-oss")
    ref = make_engine(ckpt)  # a cache that holds them all
    per = ref.kv_cache.block_bytes  # one group's block: half the layers
    engine = make_engine(ckpt, kv_cache_memory=HYBRID_DEVICE_BLOCKS * per, max_model_len=40,
                         kv_offloading_size=64 * per / 2**30, async_scheduling=True)
    engine._kv_event_publisher = events = Events()
    tiered = [run(engine, p) for p in (A, B, C, A)]
    assert [t for t, _ in tiered] == ref.generate([A, B, C, A], GREEDY)  # exact
    assert [cached for _, cached in tiered] == [0, 0, 0, 28]
    assert engine.stats().prefix_cache_hits == 0  # A's blocks all came back from the tier
    tier = engine.stats().host_tier
    # 7 full blocks (28 tokens) and the sliding blocks of positions 21..27 (blocks 5, 6): all a query at 28 reads.
    assert tier.restored_blocks == 7 + 2 and tier.restored_bytes == 9 * per
    assert tier.stored_blocks > 3 * 7  # sliding blocks too: each prompt's evicted ones of both groups
    # Only the full group's blocks are named by events (the sliding group's keys mean nothing to a router).
    full = {h for p, (out, _) in zip((A, B, C), tiered) for h in hash_prefix_blocks(p + out, 4)}
    assert set(hash_prefix_blocks(A, 4)[:7]) <= events.of("BlockStored", "CPU") <= full
