"""ModelConfig's MoE fields from transformers' configs: which layers are sparse, the router's
normalisation, the shared expert; what is refused."""

from __future__ import annotations

import pytest
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pdserve.worker.model_config import ModelConfig, UnsupportedModelError

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def test_qwen3_moe_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    hf = Qwen3MoeConfig(**SMALL, num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True,
                        architectures=["Qwen3MoeForCausalLM"])
    c = ModelConfig.from_hf(hf)
    assert c.moe_layers == (1, 5)  # every 2nd layer (transformers: (i + 1) % step == 0), minus layer 3
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (8, 2, 32, True)
    assert c.intermediate_size == 128 and c.shared_expert_intermediate_size == 0 and c.qk_norm


def test_mixtral_always_renormalises_and_every_layer_is_sparse():
    hf = MixtralConfig(**SMALL, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
                       architectures=["MixtralForCausalLM"])
    c = ModelConfig.from_hf(hf)
    assert c.moe_layers == (0, 1, 2) and c.norm_topk_prob and c.moe_intermediate_size == 128


def test_qwen2_moe_shared_expert_and_its_qkv_bias_flag():
    hf = Qwen2MoeConfig(**SMALL, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, qkv_bias=False, architectures=["Qwen2MoeForCausalLM"])
    c = ModelConfig.from_hf(hf)
    assert c.shared_expert_intermediate_size == 48 and not c.norm_topk_prob and not c.qkv_bias
    assert ModelConfig.from_hf(Qwen2MoeConfig(**SMALL, architectures=["Qwen2MoeForCausalLM"])).qkv_bias  # its default


def test_dense_models_have_no_experts_and_sliding_window_moe_is_refused():
    from transformers import LlamaConfig

    assert not ModelConfig.from_hf(LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"])).is_moe
    hf = Qwen3MoeConfig(**SMALL, use_sliding_window=True, architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="sliding-window attention is not implemented"):
        ModelConfig.from_hf(hf)


def test_fp8_moe_configs_are_read():
    """FP8 MoE checkpoints and --quantization fp8 on an MoE model load (tests/worker/test_fp8_weights.py
    runs them); the config carries the format."""
    hf = Qwen3MoeConfig(**SMALL, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        architectures=["Qwen3MoeForCausalLM"])
    assert ModelConfig.from_hf(hf, quantization="fp8").quantization.source == "online"
    hf.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.is_moe and cfg.quantization.block == (128, 128)
