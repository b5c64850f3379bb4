"""ModelConfig's MoE fields from transformers' configs: which layers are sparse, the router's
normalisation, the shared expert; what is refused."""

from __future__ import annotations

import pytest
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pdserve.worker.config.model import ModelConfig

from pdserve.worker.config.unsupported_model import UnsupportedModelError

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


# gpt-oss-20b's published config.json (transformers 4.55 names: rope_scaling + rope_theta), less
# its quantization_config, which a bf16 conversion of the model drops.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}


def _gpt_oss(tmp_path, **changes):
    import json

    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({**GPT_OSS_20B, **changes}))
    return ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))


def test_gpt_oss_config_is_read(tmp_path):
    from pdserve.worker.models.llama import rope_attention_factor

    c = _gpt_oss(tmp_path)
    assert c.architecture == "GptOssForCausalLM" and c.qkv_bias and c.o_bias and c.attention_sinks
    assert c.sliding_window == 128 and c.sliding_layers == tuple(range(0, 24, 2))
    assert (c.layer_window(0), c.layer_window(1)) == (128, 0)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (32, 4, 2880, True)
    assert c.moe_layers == tuple(range(24)) and (c.swiglu_alpha, c.swiglu_limit) == (1.702, 7.0)
    rope = dict(c.rope_scaling)
    assert c.rope_theta == 150000 and rope["rope_type"] == "yarn" and rope["factor"] == 32.0
    assert rope_attention_factor(c) == pytest.approx(0.1 * __import__("math").log(32.0) + 1.0)


def test_gpt_oss_mxfp4_is_read_and_bad_layer_types_are_refused(tmp_path):
    mxfp4 = {"quant_method": "mxfp4",
             "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                        "lm_head"]}
    c = _gpt_oss(tmp_path, quantization_config=mxfp4)
    assert c.quantization is None and c.mxfp4.ignore == tuple(mxfp4["modules_to_not_convert"])
    # transformers' rule: the experts are converted, what the list names is not.
    assert c.mxfp4.converts("model.layers.23.mlp.experts")
    assert not c.mxfp4.converts("model.layers.11.self_attn") and not c.mxfp4.converts("lm_head")
    with pytest.raises(UnsupportedModelError, match=r"quant_method = 'awq'.*unquantized.*MXFP4"):
        _gpt_oss(tmp_path, quantization_config={"quant_method": "awq"})
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        _gpt_oss(tmp_path, layer_types=["sliding_attention", "chunked_attention"] * 12)
