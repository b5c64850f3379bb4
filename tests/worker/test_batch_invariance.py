"""A bf16 CPU engine is batch-invariant (kernels/cpu_native.py): a request's tokens are the ones it
gets alone on a fresh engine, whatever else shares its steps, however its prompt is chunked,
whether its prefix was cached, and whether it was preempted and recomputed. The prefix cache and
mixed batches are what made a bf16 answer depend on the path (the same prompt through P/D and on
one worker, or twice on one worker); this holds them to the one answer as a property over prompts
that share prefixes, greedy and seeded."""

from __future__ import annotations

import pytest

from pdserve.kernels import cpu_native
from pdserve.worker.request.sampling_params import SamplingParams
from tests.helpers.engines import make_engine, native_gemm_here


pytestmark = pytest.mark.skipif(not native_gemm_here(),
                                reason="no C compiler, or no AVX512-BF16 kernel for this CPU's packed layout")

SHARED = list(range(300, 353))  # 53 tokens: more than a block, not a whole number of them


def _prompts() -> list[list[int]]:
    return [
        SHARED + [7, 8, 9],
        SHARED + list(range(1000, 1031)),
        SHARED,                             # a prefix of the others
        SHARED[:20] + [42] * 5,
        list(range(1400, 1403)),
        SHARED + [7, 8, 9],                 # the first one again
    ]


PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, biased qkv, q/k norms
def test_tokens_do_not_depend_on_the_batch_the_chunks_or_the_cache(wide_checkpoint, monkeypatch, arch):
    monkeypatch.setattr(cpu_native, "_batch_invariant", True)
    ckpt = wide_checkpoint(arch)
    prompts = _prompts()
    alone = make_engine(ckpt, dtype="bfloat16", enable_prefix_caching=False)
    assert alone.runner.cpu_threads.batch_invariant  # the mode is on: every product native
    expected = {i: [alone.generate([p], params)[0] for p in prompts] for i, params in enumerate(PARAMS)}
    del alone
    # Every prompt in one batch, chunks of at most 16 tokens (a prompt split over steps, beside
    # other prompts' chunks and decodes), the prefix cache on; twice, the second time in reverse
    # order and with every prefix already cached.
    shared = make_engine(ckpt, dtype="bfloat16", enable_prefix_caching=True, max_num_batched_tokens=16,
                         max_num_seqs=4)
    for i, params in enumerate(PARAMS):
        tokens, _ = _generate(shared, prompts, params)
        assert tokens == expected[i], f"batched and chunked (temperature {params.temperature})"
        tokens, cached = _generate(shared, prompts[::-1], params)
        assert tokens[::-1] == expected[i], f"from the prefix cache (temperature {params.temperature})"
        # every prompt longer than a block (4 tokens) had its prefix from the cache this time
        assert all(c > 0 for c, p in zip(cached, prompts[::-1]) if len(p) > 4), cached
    # A cache too small for the batch: requests are preempted and recomputed (their generated
    # tokens' KV then comes from a prompt step, not the decode steps that made it first).
    per_block = shared.kv_cache.block_bytes
    small = make_engine(ckpt, dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory=40 * per_block,
                        max_num_seqs=6)
    for i, params in enumerate(PARAMS):
        assert small.generate(prompts, params) == expected[i], f"preempted (temperature {params.temperature})"
    assert small.stats().num_preemptions > 0


def _generate(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], list[int]]:
    """engine.generate, with each request's prompt tokens served from the prefix cache."""
    ids = [f"inv-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens, cached, pending = {rid: [] for rid in ids}, dict.fromkeys(ids, 0), set(ids)
    while pending:
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            cached[o.request_id] = max(cached[o.request_id], o.num_cached_tokens)
            if o.finished:
                pending.discard(o.request_id)
    return [tokens[rid] for rid in ids], [cached[rid] for rid in ids]
