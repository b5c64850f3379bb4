"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeekMoE) equal transformers token for token
(fp32, CPU), through the latent KV cache: batched prompts, chunked prefill mixed with decodes,
prefix-cache hits and preemption; configs it cannot run are refused by key."""

from __future__ import annotations

import json

import pytest

from pdserve.worker.attention.kv_cache import KVCache
from tests.helpers.engines import make_engine
from tests.worker.test_engine_equality import GREEDY, PROMPTS, hf_reference


# V3-like (q_lora_rank, interleaved rope, YaRN + mscale, sigmoid grouped routing with the
# correction bias) under a 5-token budget: prompts split into chunks that read their own earlier
# chunks from the cache, mixed with other sequences' decodes. V2-Lite-like (q_proj, softmax
# routing) whole, then again on prefix-cache hits (prefill of the rest over cached latents).
@pytest.mark.parametrize("arch,kw,again", [("deepseek-v3", dict(max_num_batched_tokens=5), False),
                                           ("deepseek-v2-lite", {}, True)])
def test_deepseek_greedy_matches_hf(tiny_checkpoint, arch, kw, again):
    ckpt = tiny_checkpoint(arch)
    ref = hf_reference(str(ckpt))
    engine = make_engine(ckpt, **kw)
    assert engine.generate(PROMPTS, GREEDY) == ref
    if again:
        hits = engine.stats().prefix_cache_hits
        assert engine.generate(PROMPTS, GREEDY) == ref
        assert engine.stats().prefix_cache_hits - hits == sum((len(p) - 1) // 4 * 4 for p in PROMPTS)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_latent_cache_holds_one_vector_per_token_and_layer(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("deepseek-v3"))
    cache = engine.kv_cache
    # kv_lora_rank 32 + qk_rope_head_dim 8 = 40 values per token and layer (4 heads of K and V
    # of the expanded form would be 4 * (24 + 16) = 160).
    assert cache.spec.latent and cache.tensor.shape[2:] == (1, 4, 1, 40)
    assert str(cache.layout).endswith(":mla") and "x1x40:" in str(cache.layout)
    assert KVCache.bytes_per_block(engine.model_config, 4, cache.dtype) == cache.block_bytes


# A V3 config carrying V3.2's indexer or V4's compression keys, and V3.2 / V4 themselves.
@pytest.mark.parametrize("arch,model_type,extra,key", [
    ("DeepseekV3ForCausalLM", "deepseek_v3", {"index_topk": 2048}, "index_topk"),
    ("DeepseekV3ForCausalLM", "deepseek_v3", {"compress_rope_theta": 160000.0}, "compress_rope_theta"),
    ("DeepseekV32ForCausalLM", "deepseek_v32", {}, "index_topk"),
    ("DeepseekV3ForCausalLM", "deepseek_v3", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
])
def test_configs_it_cannot_run_are_refused_by_key(tmp_path, arch, model_type, extra, key):
    from transformers import AutoConfig

    from pdserve.worker.config.model import ModelConfig
    from pdserve.worker.config.unsupported_model import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type, **extra}))
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))


def test_fp8_latent_cache_is_refused_naming_the_flag(tiny_checkpoint):
    from pdserve.worker.config.engine import ConfigError

    with pytest.raises(ConfigError, match="--kv-cache-dtype"):
        make_engine(tiny_checkpoint("deepseek-v2-lite"), kv_cache_dtype="fp8")
