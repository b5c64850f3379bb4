"""The model's shape, read from a Hugging Face config.json, for the Llama family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# architecture -> (has q/k/v bias by default, has per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]  # sorted items of the rope parameters (hashable)
    eos_token_ids: tuple[int, ...]
    # FP8 weights (worker/quantization/config.py): from the checkpoint's quantization_config or
    # --quantization; None = the checkpoint's dtype, cast to the compute dtype.
    quantization: Any = None

    @classmethod
    def from_hf(cls, hf: Any, generation_eos: Any = None, quantization: str | None = None) -> "ModelConfig":
        from pdserve.worker.quantization.config import parse_quantization

        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or getattr(hf, 'model_type', '?')}; "
                f"pdserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        # transformers >= 5 keeps rope settings in `rope_parameters`; older ones in
        # `rope_theta` + `rope_scaling`. Accept both.
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        if not rope:
            rope = dict(getattr(hf, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise UnsupportedModelError(f"unsupported rope type {rope_type!r} (supported: default, llama3)")
        eos = generation_eos if generation_eos is not None else getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope["rope_type"] = rope_type
        rope.pop("type", None)
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf, "attention_bias", default_bias)) or default_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=qk_norm,
            rope_theta=theta,
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, (list, dict)))),
            eos_token_ids=eos_ids,
            quantization=parse_quantization(getattr(hf, "quantization_config", None), quantization),
        )
