"""bench/kv_capacity.py without a model: the hybrid KV cache holds close to twice the long-prompt
tokens of the every-layer cache in the same memory (gpt-oss shapes: half the layers slide)."""

from __future__ import annotations

from pdserve.bench.kv_capacity import simulate, table


def test_hybrid_cache_holds_more_long_prompts_in_the_same_memory(tiny_checkpoint):
    from transformers import AutoConfig

    from pdserve.worker.config.model import ModelConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_checkpoint("gpt-oss")))
    full_block = 2 * 2 * 4 * cfg.num_kv_heads * cfg.head_dim * 2  # 2 layers, k|v, 4 tokens, bf16
    kw = dict(kv_bytes=120 * full_block, n=8, prompt_len=96, output_len=32, block_size=4, max_num_batched_tokens=64)
    hybrid, plain = simulate(cfg, True, **kw), simulate(cfg, False, **kw)
    assert (hybrid.num_blocks, plain.num_blocks) == (240, 120)
    # 120 every-layer blocks hold 480 tokens; the hybrid cache's 240 blocks hold 240 full-layer
    # blocks less a window's sliding blocks per sequence.
    assert plain.peak_tokens <= 480 and hybrid.peak_tokens > 1.6 * plain.peak_tokens
    assert hybrid.peak_running > plain.peak_running
    assert "| hybrid |" in table([hybrid, plain], 8, 96, 32)
