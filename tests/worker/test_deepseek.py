"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeekMoE) equal transformers token for token
(fp32, CPU), through the latent KV cache: batched prompts, chunked prefill mixed with decodes,
prefix-cache hits and preemption; configs it cannot run are refused by key."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.kernels.reference import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from pdserve.worker.attention.kv_cache import KVCache, kv_layout
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


def hf_fp8_latent_reference(ckpt: str, scales: torch.Tensor | None) -> list[list[int]]:
    """transformers (fp32) whose cache keeps each layer's latent and roped key as an fp8 latent
    cache gives them back: quantized to e4m3 with the layer's K scale and dequantized. Every
    token, the current chunk's included, is attended through its cached latent, as in pdserve."""
    from transformers import AutoModelForCausalLM, DynamicCache

    class Fp8LatentCache(DynamicCache):
        def update(self, latent, k_rot, layer_idx, *args, **kwargs):
            s = None if scales is None else scales[layer_idx, 0:1]

            def round_trip(x):
                return dequantize_kv(quantize_kv(x, FP8_KV_DTYPE, s), s).to(x.dtype)

            return super().update(round_trip(latent), round_trip(k_rot), layer_idx, *args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    outs = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, min_new_tokens=GREEDY.max_tokens,
                             do_sample=False, cache=Fp8LatentCache(config=model.config))
        outs.append(ids[0, len(p):].tolist())
    return outs


# --kv-cache-dtype fp8: the latent rows stored as e4m3 (x / the layer's K scale). V3-like with
# 5-token chunks reading earlier chunks' quantized latents, unit scales; V2-Lite-like with
# per-layer scales (as a checkpoint's k_scale would set them), again on prefix-cache hits. On
# these tiny models the quantization moves most greedy tokens away from the unquantized model's
# (checked once: every prompt diverges within a few tokens), so equality pins the quantization.
@pytest.mark.parametrize("arch,kw,scaled", [("deepseek-v3", dict(max_num_batched_tokens=5), False),
                                            ("deepseek-v2-lite", {}, True)])
def test_fp8_latent_cache_equals_hf_with_the_latent_quantized(tiny_checkpoint, arch, kw, scaled):
    ckpt = tiny_checkpoint(arch)
    engine = make_engine(ckpt, kv_cache_dtype="fp8", **kw)
    cache = engine.kv_cache
    assert cache.tensor.dtype == FP8_KV_DTYPE and cache.tensor.shape[2:] == (1, 4, 1, 40)
    scales = None
    if scaled:
        scales = torch.linspace(0.05, 0.5, 2 * cache.num_layers).reshape(cache.num_layers, 2)
        cache.scales.copy_(scales)  # the kernels read these [1] views on every step
    ref = hf_fp8_latent_reference(str(ckpt), scales)
    assert engine.generate(PROMPTS, GREEDY) == ref
    if scaled:
        assert engine.generate(PROMPTS, GREEDY) == ref
        assert engine.stats().prefix_cache_hits > 0
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_fp8_latent_layout_names_fp8_and_mla(tiny_checkpoint):
    """A P/D peer compares these: an fp8 latent cache never equals a bf16 latent one, a GQA fp8
    one, or one written with other latent scales; its V scales are never read, so they are not
    in it. Half the bytes of a bf16 latent block."""
    from pdserve.protocol.kv_layout import KVLayout
    from pdserve.worker.models.loader import read_model_config

    cfg = read_model_config(str(tiny_checkpoint("deepseek-v3")))
    fp8 = kv_layout(cfg, FP8_KV_DTYPE, 4)
    assert str(fp8) == f"{cfg.num_layers}x1x40:float8_e4m3fn@1:4:mla" and KVLayout.parse(str(fp8)) == fp8
    assert fp8 != kv_layout(cfg, torch.bfloat16, 4)
    ones = torch.ones(cfg.num_layers, 2)
    v_only = ones.clone()
    v_only[:, 1] = 0.5
    assert kv_layout(cfg, FP8_KV_DTYPE, 4, v_only) == fp8
    k_too = v_only.clone()
    k_too[0, 0] = 0.5
    assert kv_layout(cfg, FP8_KV_DTYPE, 4, k_too) != fp8
    assert KVCache.bytes_per_block(cfg, 4, FP8_KV_DTYPE) * 2 == KVCache.bytes_per_block(cfg, 4, torch.bfloat16)
