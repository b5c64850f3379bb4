"""llm-d's prefix-based P/D decider (`--pd-min-uncached-tokens`): a follow-up turn whose
conversation the decode worker already caches is served there whole, without the prefill
worker; a turn that adds more new tokens than the threshold is still disaggregated. Real
`pdserve worker` processes (tiny checkpoint, CPU, TCP KV transfer), the decode worker's real KV
events, the router's real index; the answers equal the decode worker's own."""

from __future__ import annotations

import httpx
import pytest

from pdserve.protocol.flags import ConfigError
from pdserve.router.config import RouterConfig
from pdserve.router.kv_index import KVIndex
from pdserve.protocol.requests import CompletionRequest
from pdserve.router.policies import PolicyContext, RoutingRequest
from pdserve.router.policies.decider import DecodePrefix
from pdserve.protocol.kv_events import block_stored
from tests.net import free_port
from tests.router.test_failures import eventually, metric

BLOCK = 16  # the worker's default --block-size
THRESHOLD = 24


class _W:
    def __init__(self, url: str):
        self.url = url


def _covers(index: KVIndex, tokens: list[int], min_uncached: int) -> bool:
    ctx = PolicyContext(kv_index=index, pd_min_uncached_tokens=min_uncached)
    return DecodePrefix(ctx).covers(
        RoutingRequest(CompletionRequest(prompt="x"), tokenize=lambda body: tokens), _W("d")
    )


def test_the_rule_counts_uncached_tokens_against_the_threshold():
    index = KVIndex()
    cached = list(range(100, 164))  # 4 blocks of 4
    index.apply("d", [block_stored([1, 2, 3, 4], None, cached[:16], 4)])
    assert _covers(index, cached[:16] + [7] * 5, 8)  # 5 uncached < 8
    assert not _covers(index, cached[:16] + [7] * 8, 8)  # 8 uncached: not fewer than 8
    assert not _covers(index, [9] * 20, 100)  # nothing cached: never skips, however high the threshold
    assert not _covers(index, cached[:16] + [7], 0)  # 0: off
    assert not _covers(KVIndex(), cached[:16], 8)  # an index that knows nothing of the worker


def test_the_flag_needs_prefix_aware_decode_routing_and_a_count():
    base = dict(decode_urls=("http://127.0.0.1:1",), tokenizer="/tmp/tok")
    with pytest.raises(ConfigError, match="prefix-aware") as e:
        RouterConfig(**base, pd_min_uncached_tokens=64)
    assert e.value.flag == "--pd-min-uncached-tokens"
    with pytest.raises(ConfigError, match=">= 0") as e:
        RouterConfig(**base, decode_policy="prefix-aware", pd_min_uncached_tokens=-1)
    assert e.value.flag == "--pd-min-uncached-tokens"
    assert RouterConfig(**base, decode_policy="prefix-aware", pd_min_uncached_tokens=64).pd_min_uncached_tokens == 64


def _count(router, name: str) -> float:
    """An unlabelled series' value (0 before it exists)."""
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
def test_a_follow_up_turn_cached_on_the_decode_worker_skips_the_prefill_worker(launch, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    events = free_port("127.0.0.82", span=2)
    prefill, decode = launch.real_pd_workers(ckpt, hosts=("127.0.0.81", "127.0.0.82"),
                                             decode_extra=("--kv-events-port", str(events)))
    router = launch.router("--prefill", prefill.url, "--decode", decode.url, "--decode-policy", "prefix-aware",
                           "--tokenizer", str(ckpt), "--kv-events-port", str(events),
                           "--kv-events-replay-port", str(events + 1),
                           "--pd-min-uncached-tokens", str(THRESHOLD))

    def complete(url: str, prompt: list[int]) -> str:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    turn1 = [(i * 7) % 900 + 20 for i in range(5 * BLOCK)]  # 80 tokens: five full blocks
    first = complete(router.url, turn1)
    assert _count(router, "pdserve_router_prefill_seconds_count") == 1  # a first turn: P/D
    # The blocks the decode worker pulled reach the router's index as its KV events.
    eventually(lambda: (metric(router, "pdserve_router_kv_index_blocks", worker=decode.url) or 0) >= 5)
    assert first == complete(decode.url, turn1)

    # The next question over the same context: 10 new tokens after the five cached blocks.
    follow = turn1 + [33, 44, 55, 66, 77, 88, 99, 111, 122, 133]
    got = complete(router.url, follow)
    assert _count(router, "pdserve_router_decode_prefix_hits_total") == 1
    assert _count(router, "pdserve_router_prefill_seconds_count") == 1  # no second prefill call
    assert got == complete(decode.url, follow)  # what the decode worker answers alone

    longer = turn1 + list(range(300, 300 + THRESHOLD + 8))  # more than the threshold is new
    got = complete(router.url, longer)
    assert _count(router, "pdserve_router_prefill_seconds_count") == 2  # disaggregated again
    assert _count(router, "pdserve_router_decode_prefix_hits_total") == 1
    assert got == complete(decode.url, longer)
