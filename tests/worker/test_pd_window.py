"""P/D with gpt-oss's hybrid KV cache (docs/kv-cache.md): the hand-off moves every full-attention
block and only the sliding layers' blocks that the decode side's first query reads, counted in
bytes; the decode side's sliding blocks before the window are the null block, never published;
the answer is the decode engine's own, after the prefill and streamed. Two real engines in this
process (the side channel and transports on loopback threads), tiny gpt-oss (window 8, 4-token
blocks), TCP and NIXL.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from pdserve.protocol.kv_transfer import KVTransferParams
from pdserve.worker.engine.block_manager import hash_prefix_blocks
from pdserve.worker.engine.hybrid_block_manager import SLIDING_SALT
from pdserve.worker.kv.nixl_transport import nixl_available
from pdserve.worker.request.sampling_params import SamplingParams
from tests.checkpoints import GPT_OSS_WINDOW
from tests.helpers.engines import make_engine
from tests.net import free_port

BS = 4
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(58)]  # 15 blocks, 7 windows
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PD = dict(kv_peer_allow=("127.0.0.1",), kv_secret="pd-window-test-secret", max_model_len=128)
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="needs nixl"))]


def engines(ckpt, transport: str, prefill_hybrid: bool = True, decode_hybrid: bool = True, pull_timeout: float = 30):
    p = make_engine(ckpt, role="prefill", kv_transfer=transport, kv_port=free_port(),
                    disable_hybrid_kv_cache_manager=not prefill_hybrid, **PD)
    d = make_engine(ckpt, role="decode", kv_transfer=transport, kv_port=free_port(), enable_prefix_caching=False,
                    disable_hybrid_kv_cache_manager=not decode_hybrid, kv_pull_timeout=pull_timeout, **PD)
    return p, d


def prefill_params(p) -> KVTransferParams:
    p.add_request("p", PROMPT, GREEDY, {"do_remote_decode": True})
    while True:
        for o in p.step():
            if o.finished:
                return o.kv_transfer_params


def decode(p, d, params: KVTransferParams) -> list[int]:
    d.add_request("d", PROMPT, GREEDY, params)
    out, deadline = [params.first_token_id], time.monotonic() + 60
    outputs = d.step()  # admitted: its two tables allocated, the pull started
    req = d.requests["d"]
    if params.kv_layout == d.kv_cache.layout and d.kv_cache.layout.hybrid and not req.status.finished:
        # The sliding entries before the window were never allocated (the pull does not write them).
        start = d.kv_cache.layout.sliding_start(len(PROMPT))
        assert req.sliding_block_ids[:start] == [d.block_manager.null_block] * start
    for o in outputs:
        out += o.new_token_ids
    while len(out) < GREEDY.max_tokens:
        assert time.monotonic() < deadline, "decode did not finish"
        for o in d.step():
            out += o.new_token_ids
        p.step()  # frees the pin once the decode side released it
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_hand_off_moves_the_window_only_and_counts_what_it_skipped(tiny_checkpoint, transport):
    p, d = engines(tiny_checkpoint("gpt-oss"), transport)
    try:
        assert p.kv_cache.layout.hybrid and p.kv_cache.layout == d.kv_connector.layout == p.kv_connector.layout
        expected = d.generate([PROMPT], GREEDY)[0]
        n = -(-len(PROMPT) // BS)
        start = (len(PROMPT) - GPT_OSS_WINDOW + 1) // BS  # the first block the query at position 58 reads
        params = prefill_params(p)
        assert params.kv_layout.sliding_start(len(PROMPT)) == start == 12
        # The list: the full group's prompt blocks, then the sliding group's tail.
        assert len(params.remote_block_ids) == n + (n - start)
        preq = p.scheduler.sending["p"]
        assert list(params.remote_block_ids) == preq.block_ids[:n] + preq.sliding_block_ids[start:n]
        # The prefill side holds what it pinned, not the sliding blocks before the tail.
        bm = p.block_manager
        assert preq.sliding_block_ids[:start] == [bm.null_block] * start
        assert bm.num_free_blocks == bm.num_blocks - len(preq.block_ids) - (n - start)
        assert p.stats().num_pinned_blocks == n + (n - start)
        assert KVTransferParams.from_dict(params.to_dict()) == params  # the wire's block count check

        assert decode(p, d, params) == expected
        metrics = d.kv_connector.metrics
        moved = metrics.bytes.labels("recv", transport)._value.get()
        skipped = metrics.window_skipped.labels("recv", transport)._value.get()
        bb = d.kv_cache.block_bytes  # one group's layers (gpt-oss tiny: one layer each)
        assert moved == (n + n - start) * bb and skipped == start * bb
        # A hand-off of every sliding block (the window not known) would move 2n blocks.
        assert moved + skipped == 2 * n * bb and moved < 2 * n * bb
        assert metrics.local_prefill_fallbacks._value.get() == 0
        # Pins and blocks come back on both sides.
        deadline = time.monotonic() + 30
        while p.stats().num_pinned_blocks and time.monotonic() < deadline:
            p.step()
            time.sleep(0.01)
        for e in (p, d):
            s = e.stats()
            assert s.num_pinned_blocks == 0 and s.num_free_blocks == s.num_total_blocks
    finally:
        p.shutdown()
        d.shutdown()


def test_the_decode_side_never_publishes_sliding_blocks_it_did_not_pull(tiny_checkpoint):
    """With prefix caching on the decode side, what the pull left null is never registered: a
    second request with the same prompt hits the full blocks and only the window's sliding ones."""
    ckpt = tiny_checkpoint("gpt-oss")
    p = make_engine(ckpt, role="prefill", kv_transfer="tcp", kv_port=free_port(), **PD)
    d = make_engine(ckpt, role="decode", kv_transfer="tcp", kv_port=free_port(), **PD)
    try:
        params = prefill_params(p)
        got = decode(p, d, params)
        bm = d.block_manager
        start = params.kv_layout.sliding_start(len(PROMPT))
        # Published sliding blocks: those the pull wrote (the window's) and the one decoding filled,
        # never the ones before the window (null since the pull landed: never written here).
        computed = len(PROMPT) + GREEDY.max_tokens - 1
        hashes = hash_prefix_blocks(PROMPT + got[:-1], BS)
        published = [i for i, h in enumerate(hashes) if h ^ SLIDING_SALT in bm.hash_to_block]
        assert published == list(range(start, computed // BS))
        assert d.generate([PROMPT], GREEDY)[0] == got  # a prefix hit over pulled KV gives the same tokens
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("hybrid_side", ["decode", "prefill"])
def test_a_plain_worker_and_a_hybrid_one_fall_back_to_local_prefill(tiny_checkpoint, hybrid_side):
    """--disable-hybrid-kv-cache-manager on one side only: the layouts differ (the group split is
    part of it), so the decode side refuses the hand-off and prefills here: same answer."""
    p, d = engines(tiny_checkpoint("gpt-oss"), "tcp", prefill_hybrid=hybrid_side == "prefill",
                   decode_hybrid=hybrid_side == "decode")
    try:
        assert p.kv_cache.layout.hybrid == (hybrid_side == "prefill") != d.kv_cache.layout.hybrid
        expected = d.generate([PROMPT], GREEDY)[0]
        params = prefill_params(p)
        assert len(params.remote_block_ids) == p.kv_cache.layout.handoff_blocks(len(PROMPT))
        assert decode(p, d, params) == expected
        metrics = d.kv_connector.metrics
        assert metrics.local_prefill_fallbacks._value.get() == 1
        assert metrics.bytes.labels("recv", "tcp")._value.get() == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_a_failed_pull_prefills_locally_with_both_tables_whole(tiny_checkpoint):
    """The pull allocated no sliding blocks before the window; when it fails, the request starts
    afresh here (its tables whole) and its answer is the decode engine's own."""
    p, d = engines(tiny_checkpoint("gpt-oss"), "tcp", pull_timeout=1)
    try:
        expected = d.generate([PROMPT], GREEDY)[0]
        params = dataclasses.replace(prefill_params(p), remote_port=free_port())  # nobody listens there
        assert decode(p, d, params) == expected
        assert d.kv_connector.metrics.local_prefill_fallbacks._value.get() == 1
        s = d.stats()
        assert s.num_free_blocks == s.num_total_blocks
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("transport,asyn", [pytest.param("tcp", False, id="tcp"),
                                             pytest.param("tcp", True, id="tcp-async"),
                                             pytest.param("nixl", False, id="nixl", marks=TRANSPORTS[1].marks)])
def test_a_streamed_hand_off_moves_the_window_only(tiny_checkpoint, transport, asyn):
    """Streamed (chunks of 8 tokens): the full blocks are read as chunks complete, the sliding
    tail once the prompt is done; the bytes and the answer as after the prefill. Under async
    scheduling too (a chunk's blocks readable once its step is collected, a step later)."""
    ckpt = tiny_checkpoint("gpt-oss")
    p = make_engine(ckpt, role="prefill", kv_transfer=transport, kv_port=free_port(), kv_stream_chunk_tokens=8,
                    kv_stream_split="even", async_scheduling=asyn, **PD)
    d = make_engine(ckpt, role="decode", kv_transfer=transport, kv_port=free_port(), enable_prefix_caching=False,
                    async_scheduling=asyn, **PD)
    assert p.async_scheduling == d.async_scheduling == asyn
    try:
        expected = d.generate([PROMPT], GREEDY)[0]
        p.add_request("p", PROMPT, GREEDY, {"do_remote_decode": True, "stream_kv": True})
        outs = []
        while not any(o.kv_transfer_params for o in outs):
            outs += p.step()
        params = next(o.kv_transfer_params for o in outs if o.kv_transfer_params)
        assert params.stream_kv and params.first_token_id is None
        n, start = -(-len(PROMPT) // BS), params.kv_layout.sliding_start(len(PROMPT))
        assert len(params.remote_block_ids) == n + (n - start)
        d.add_request("d", PROMPT, GREEDY, params)
        got, deadline = [], time.monotonic() + 60
        while len(got) < GREEDY.max_tokens:
            assert time.monotonic() < deadline, "the streamed hand-off did not finish"
            p.step()
            for o in d.step():
                got += list(o.handed_over_token_ids or ()) + o.new_token_ids
        assert got == expected
        metrics = d.kv_connector.metrics
        bb = d.kv_cache.block_bytes
        assert metrics.bytes.labels("recv", transport)._value.get() == (n + n - start) * bb
        assert metrics.window_skipped.labels("recv", transport)._value.get() == start * bb
        assert metrics.local_prefill_fallbacks._value.get() == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_both_sides_restore_from_their_host_tiers(tiny_checkpoint):
    """P/D beside the host tier (--kv-offloading-size): with 16 device blocks each prompt evicts
    the one before on both sides, so the repeated first prompt is restored (full blocks and the
    window's sliding ones) on the prefill side before its pin and on the decode side before its
    pull of the rest; every answer equals one engine's without P/D or the tier."""
    ckpt = tiny_checkpoint("gpt-oss")
    ref = make_engine(ckpt)
    prompts = [[base + 3 * i for i in range(30)] for base in (100, 400, 700, 100)]  # 7 full blocks a repeat takes
    expected = ref.generate(prompts, GREEDY)
    tier = dict(kv_cache_memory=17 * ref.kv_cache.block_bytes, kv_offloading_size=64 * ref.kv_cache.block_bytes / 2**30)
    pd = {**PD, "max_model_len": 40, **tier}
    p = make_engine(ckpt, role="prefill", kv_transfer="tcp", kv_port=free_port(), **pd)
    d = make_engine(ckpt, role="decode", kv_transfer="tcp", kv_port=free_port(), **pd)
    try:
        for i, prompt in enumerate(prompts):
            p.add_request(f"p{i}", prompt, GREEDY, {"do_remote_decode": True})
            params = None
            while params is None:
                params = next((o.kv_transfer_params for o in p.step() if o.finished), None)
            d.add_request(f"d{i}", prompt, GREEDY, params)
            got, deadline = [params.first_token_id], time.monotonic() + 60
            while len(got) < GREEDY.max_tokens:
                assert time.monotonic() < deadline, "decode did not finish"
                for o in d.step():
                    got += o.new_token_ids
                p.step()
            assert got == expected[i], i
            while p.stats().num_pinned_blocks and time.monotonic() < deadline:
                p.step()
                time.sleep(0.01)
        # 7 full blocks and 2 sliding ones (the window of position 28) restored on both sides.
        assert p.stats().host_tier.restored_blocks == d.stats().host_tier.restored_blocks == 9
        assert d.kv_connector.metrics.local_prefill_fallbacks._value.get() == 0
    finally:
        p.shutdown()
        d.shutdown()
