"""--kv-cache-dtype fp8: the engine with an fp8 KV cache against an independent reference.

The reference is Hugging Face transformers (fp32, CPU) whose attention sees K and V exactly as
an fp8 cache gives them back: quantized to float8 e4m3 (x / scale, saturated, nearest even) and
dequantized (times scale), per layer, after rotary. Greedy tokens must be equal; that is what
"the engine quantizes K/V the way it says" means end to end. Also: the flag, the sizing (the
same --kv-cache-memory holds twice the bf16 blocks), the layout peers compare, and calibrated
scales read from a checkpoint.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pdserve.kernels.reference import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from pdserve.worker.attention.kv_cache import KVCache, kv_layout
from pdserve.worker.attention.kv_scales import load_kv_scales
from pdserve.worker.config.engine import ConfigError, EngineConfig
from pdserve.worker.request.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

PROMPTS = [
    [5, 17, 300, 42, 9, 1000, 77],
    list(range(100, 137)),  # several blocks
    [3, 4],
]
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


fp8_engine = functools.partial(make_engine, kv_cache_dtype="fp8")


def _fp8_attention(scales: torch.Tensor | None):
    """An HF attention function over K/V round-tripped through the fp8 cache's quantization."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # HF's default implementation (sdpa), which the unquantized engine matches token for token;
    # a registered name gets sdpa's attention mask too.
    def attend(module, query, key, value, attention_mask, **kw):
        ks, vs = (None, None) if scales is None else (scales[module.layer_idx, 0:1], scales[module.layer_idx, 1:2])
        key = dequantize_kv(quantize_kv(key, FP8_KV_DTYPE, ks), ks)
        value = dequantize_kv(quantize_kv(value, FP8_KV_DTYPE, vs), vs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    return attend


def hf_fp8_reference(ckpt: str, scales: torch.Tensor | None = None) -> list[list[int]]:
    from transformers import AttentionInterface, AutoModelForCausalLM

    name = "pdserve_fp8_kv" if scales is None else f"pdserve_fp8_kv_{id(scales)}"
    AttentionInterface.register(name, _fp8_attention(scales))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=name)
    outs = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
        outs.append(ids[0, len(p):].tolist())
    return outs


@functools.lru_cache(maxsize=None)
def hf_plain(ckpt: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                           do_sample=False)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_kv_greedy_equals_hf_with_quantized_kv(tiny_checkpoint, arch):
    ckpt = str(tiny_checkpoint(arch))
    # A chunked prefill budget mixes cached prefixes, chunks and decodes in one step.
    engine = fp8_engine(ckpt, max_num_batched_tokens=8)
    assert engine.kv_cache.tensor.dtype == FP8_KV_DTYPE
    got = engine.generate(PROMPTS, GREEDY)
    assert got == hf_fp8_reference(ckpt)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_calibrated_scales_reach_every_layer(tiny_checkpoint):
    # Per-layer scales, set on the cache as a checkpoint's k_scale/v_scale would set them: the
    # engine divides and multiplies by each layer's own pair (the reference does per layer too).
    ckpt = str(tiny_checkpoint("llama"))
    engine = fp8_engine(ckpt)
    layers = engine.kv_cache.num_layers
    scales = torch.linspace(0.02, 0.6, 2 * layers).reshape(layers, 2)
    engine.kv_cache.scales.copy_(scales)  # the kernels read these [1] views on every step
    got = engine.generate(PROMPTS, GREEDY)
    assert got == hf_fp8_reference(ckpt, scales)


def test_same_memory_holds_twice_the_bf16_blocks(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    bf16 = fp8_engine(ckpt, dtype="bfloat16", kv_cache_dtype="auto")
    fp8 = fp8_engine(ckpt, dtype="bfloat16")
    alias = fp8_engine(ckpt, dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    assert bf16.kv_cache.tensor.dtype == torch.bfloat16
    assert fp8.kv_cache.block_bytes * 2 == bf16.kv_cache.block_bytes
    assert fp8.runner.num_blocks == alias.runner.num_blocks == 2 * bf16.runner.num_blocks
    fp32 = fp8_engine(ckpt, kv_cache_dtype="auto")  # CPU's default dtype: four times
    assert fp8_engine(ckpt).runner.num_blocks == 4 * fp32.runner.num_blocks
    # Tokens, not just bytes: the quantized cache still answers like the model (peaked logits).
    assert fp8.generate(PROMPTS[:1], GREEDY)[0][:3] == hf_plain(str(ckpt))[0][:3]


def test_flag_is_validated_and_named():
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype: must be one of auto, fp8, fp8_e4m3, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_fp8 and not EngineConfig().kv_cache_fp8


def test_layout_names_dtype_and_scales(tiny_checkpoint):
    from pdserve.worker.models.loader import read_model_config

    cfg = read_model_config(str(tiny_checkpoint("llama")))
    shape = f"{cfg.num_layers}x{cfg.num_kv_heads}x{cfg.head_dim}"
    assert str(kv_layout(cfg, torch.bfloat16, 16)) == f"{shape}:bfloat16:16"  # the wire form
    assert str(kv_layout(cfg, FP8_KV_DTYPE, 16)) == f"{shape}:float8_e4m3fn@1:16"
    ones = torch.ones(cfg.num_layers, 2)
    assert str(kv_layout(cfg, FP8_KV_DTYPE, 16, ones)) == f"{shape}:float8_e4m3fn@1:16"
    other = ones.clone()
    other[-1, 1] = 0.5
    calibrated = kv_layout(cfg, FP8_KV_DTYPE, 16, other)
    assert str(calibrated).startswith(f"{shape}:float8_e4m3fn@") and calibrated != kv_layout(cfg, FP8_KV_DTYPE, 16)
    assert calibrated == kv_layout(cfg, FP8_KV_DTYPE, 16, other.clone())  # a digest of the values
    assert KVCache(cfg, 2, 16, FP8_KV_DTYPE, torch.device("cpu"), other).layout == calibrated
    with pytest.raises(ValueError, match=r"KV cache scales must be \[\d+, 2\] positive finite numbers"):
        KVCache(cfg, 2, 16, FP8_KV_DTYPE, torch.device("cpu"), -ones)


def test_checkpoint_kv_scales(tmp_path):
    from safetensors.torch import save_file

    layers = 3
    weights = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}
    for i in range(layers):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.1 * (i + 1))
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.2 * (i + 1)])
    save_file(weights, tmp_path / "model.safetensors")
    scales = load_kv_scales(str(tmp_path), layers)
    assert torch.allclose(scales, torch.tensor([[0.1, 0.2], [0.2, 0.4], [0.3, 0.6]]))
    # Older exports: one kv_scale for both.
    save_file({f"model.layers.{i}.self_attn.kv_scale": torch.tensor(2.0) for i in range(layers)},
              tmp_path / "model.safetensors")
    assert torch.equal(load_kv_scales(str(tmp_path), layers), torch.full((layers, 2), 2.0))
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(2.0)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no v_scale for layer 0"):
        load_kv_scales(str(tmp_path), layers)
    save_file({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    assert load_kv_scales(str(tmp_path), layers) is None  # none: unit scales
