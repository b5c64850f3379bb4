"""gpt-oss's hybrid KV cache (docs/kv-cache.md) end to end on CPU: prompts several windows long
equal transformers' greedy tokens while the sliding layers' blocks behind the window go back to
the pool, through chunked prefill, prefix hits whose window blocks were evicted, and preemption."""

from __future__ import annotations

import functools

import torch

from pdserve.worker.attention.kv_cache import KVCache
from pdserve.worker.engine.block_manager import hash_prefix_blocks
from pdserve.worker.engine.hybrid_block_manager import SLIDING_SALT
from pdserve.worker.request.sampling_params import SamplingParams
from tests.checkpoints import GPT_OSS_WINDOW
from tests.helpers.engines import make_engine

# Window 8, 4-token blocks: 41 and 58 tokens are 5 and 7 windows.
PROMPTS = [[(7 * i + 3) % 500 + 10 for i in range(41)], [(11 * i + 5) % 500 + 10 for i in range(58)]]
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def hf_reference(ckpt: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                           do_sample=False)[0, len(p):].tolist() for p in PROMPTS]


def test_long_prompts_release_blocks_and_match_hf(tiny_checkpoint):
    ckpt = tiny_checkpoint("gpt-oss")
    ref = hf_reference(str(ckpt))
    engine = make_engine(ckpt, max_num_batched_tokens=16)  # chunks of 16: each chunk reads the last one's window
    bm = engine.block_manager
    assert engine.runner.kv_groups is not None and engine.runner.kv_groups.window == GPT_OSS_WINDOW
    engine.add_request("a", PROMPTS[1], GREEDY)
    req = None
    while req is None or req.num_output_tokens == 0:
        engine.step()
        req = engine.requests.get("a")
    # 58 prompt tokens + 1 sampled: 15 full blocks; the sliding table keeps the blocks of positions
    # 51..58 (what the next query reads) and the block the token just computed in: 3, after a schedule.
    bm.release_outside_window(req)
    held = [b for b in req.sliding_block_ids if b != bm.null_block]
    assert len(req.block_ids) == 15 and len(held) == 3
    assert bm.num_free_blocks == bm.num_blocks - 15 - 3
    engine.abort("a")
    engine.step()
    assert engine.generate(PROMPTS, GREEDY) == ref
    assert bm.num_free_blocks == bm.num_blocks
    # The same tokens with every layer's blocks kept (the comparison the capacity bench makes).
    plain = make_engine(ckpt, max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=True)
    assert plain.runner.kv_groups is None and plain.generate(PROMPTS, GREEDY) == ref


def test_the_same_memory_holds_what_keeping_every_layer_preempts(tiny_checkpoint):
    ckpt = tiny_checkpoint("gpt-oss")
    ref = hf_reference(str(ckpt))
    per_block = KVCache.bytes_per_block(make_engine(ckpt).model_config, 4, torch.float32)
    # 24 blocks of every layer's KV: the second prompt (15 blocks) waits for the first (11) to end.
    plain = make_engine(ckpt, kv_cache_memory=24 * per_block, max_model_len=80, disable_hybrid_kv_cache_manager=True)
    assert generate_counting(plain) == (ref, 1)
    # The same bytes as 48 hybrid blocks: 30 full-layer blocks and a window's sliding ones each.
    hybrid = make_engine(ckpt, kv_cache_memory=24 * per_block, max_model_len=80)
    assert generate_counting(hybrid) == (ref, 2) and hybrid.stats().num_preemptions == 0


def generate_counting(engine) -> tuple[list[list[int]], int]:
    """engine.generate(PROMPTS) and the most sequences it ran at once."""
    peak, step = [0], engine.step

    def counting():
        out = step()
        peak[0] = max(peak[0], len(engine.scheduler.running))
        return out

    engine.step = counting
    return engine.generate(PROMPTS, GREEDY), peak[0]


def test_prefix_hits_after_eviction_and_preemption_match_hf(tiny_checkpoint):
    ckpt = tiny_checkpoint("gpt-oss")
    ref = hf_reference(str(ckpt))
    engine = make_engine(ckpt)
    bm = engine.block_manager
    assert engine.generate(PROMPTS[1:], GREEDY) == ref[1:]
    # The sliding block of tokens 52..55 leaves the cache: a hit of 14 blocks (56 tokens) needs it
    # (a query at 56 reads 49..56), one of 13 blocks reads 45..52 (blocks 11 and 12, still cached).
    key = hash_prefix_blocks(PROMPTS[1], 4)[13] ^ SLIDING_SALT
    b = bm.hash_to_block[key]
    bm._ref(b)
    bm._evict(b)
    bm._release([b])
    hits = bm.prefix_hits
    assert engine.generate(PROMPTS[1:], GREEDY) == ref[1:]
    assert bm.prefix_hits - hits == 13 * 4
    assert bm.num_free_blocks == bm.num_blocks
    # 28 hybrid blocks: the two sequences' 30 full-layer blocks do not fit at once.
    per_block = KVCache.bytes_per_block(engine.model_config, 4, torch.float32)
    small = make_engine(ckpt, kv_cache_memory=14 * per_block, max_model_len=80)
    assert small.generate(PROMPTS, GREEDY) == ref
    assert small.stats().num_preemptions > 0
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


def test_triton_decode_graph_buffers_carry_the_sliding_tables(tiny_checkpoint):
    # The decode graphs' static buffers (capture=False on CPU: the same buffers and padding, no
    # capture) with the sliding group's slot row and table, on the Triton kernels (interpreted).
    ckpt = tiny_checkpoint("gpt-oss")
    engine = make_engine(ckpt, attention_backend="triton", static_decode=True, max_num_seqs=4,
                         max_num_batched_tokens=16)
    assert engine.runner.graphs.config.sliding
    assert engine.generate(PROMPTS, GREEDY) == hf_reference(str(ckpt))
    assert engine.runner.graphs.num_replays > 0


def test_async_scheduling_releases_behind_the_step_in_flight(tiny_checkpoint):
    # Async scheduling: a step is scheduled (and releases) while the one before is in flight,
    # whose blocks are published in the prefix cache only when its tokens arrive.
    ckpt = tiny_checkpoint("gpt-oss")
    engine = make_engine(ckpt, async_scheduling=True, max_num_batched_tokens=16)
    assert engine.async_scheduling
    assert engine.generate(PROMPTS, GREEDY) == hf_reference(str(ckpt))
    assert engine.generate(PROMPTS, GREEDY) == hf_reference(str(ckpt))  # with the first run's hits
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
