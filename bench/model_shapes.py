"""The models the engine-level benchmarks build with random weights: each real model's
configuration (public config.json values), so a step moves the bytes the real model's would.
Its own module: the engine benchmark and the decode-graph harness (profile_decode.py) both
read it, and neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # llama | qwen2
    hf: dict  # config fields of the real model (public config.json values)


MODELS = {
    "llama-3.1-8b": ModelSpec("Llama-3.1-8B", "llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "qwen2.5-0.5b": ModelSpec("Qwen2.5-0.5B", "qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=True, rope_theta=1000000.0)),
    # --smoke: the same code path on CPU in seconds
    "tiny-llama": ModelSpec("tiny-llama", "llama", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)),
}
