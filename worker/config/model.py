"""The model's shape, read from a Hugging Face config.json: the Llama family, dense and
mixture-of-experts (Qwen3-MoE, Mixtral, Qwen2-MoE: Llama-style attention, a sparse MLP block),
and gpt-oss (the same decoder with attention sinks, alternating sliding-window layers, biases
everywhere and its own expert MLP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.worker.config.deepseek import deepseek_fields
from pdserve.worker.config.quantization import Mxfp4Config, parse_quantization
from pdserve.worker.config.unsupported_model import UnsupportedModelError

# architecture -> (has q/k/v bias by default, has per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
    "GptOssForCausalLM": (False, False),  # its config's attention_bias (true by default) names q/k/v/o biases
    "DeepseekV2ForCausalLM": (False, False),  # MLA + DeepSeekMoE (config/deepseek.py)
    "DeepseekV3ForCausalLM": (False, False),
}

# Architectures people will try that pdserve cannot run, with why and what to use instead: the
# start-up error names both, rather than a generic "unsupported".
UNSUPPORTED_HINTS: dict[str, str] = {
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse attention (config key index_topk: the lightning indexer's "
                              "top-k) is not implemented; DeepseekV3ForCausalLM (dense MLA) is",
    "DeepseekV4ForCausalLM": "DeepSeek-V4's compressed attention (config keys compress_rates, index_topk) is not "
                             "implemented; DeepseekV3ForCausalLM (dense MLA) is",
}


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
    # Mixture of experts (0 experts: a dense model). `moe_layers` are the layers whose MLP is the
    # sparse block (Qwen's mlp_only_layers / decoder_sparse_step resolved); the others keep the
    # dense MLP of `intermediate_size`. The expert MLP is `moe_intermediate_size` wide.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert behind a sigmoid gate
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()
    # gpt-oss (GptOssForCausalLM). Attention: o_proj has a bias; one learned sink logit per query
    # head joins each softmax's denominator; the layers in `sliding_layers` attend to the last
    # `sliding_window` positions only (the query's included), the others to the whole context.
    # Experts: router with bias, softmax over the top-k logits; biased experts whose gate|up is
    # interleaved in the checkpoint, activation (up + 1) * g * sigmoid(alpha g) with g clamped
    # above at `swiglu_limit` and up to +-limit (`swiglu_limit` 0: the plain SiLU-and-mul).
    o_bias: bool = False
    attention_sinks: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # FP8 weights (worker/config/quantization.py): from the checkpoint's quantization_config or
    # --quantization; None = the checkpoint's dtype, cast to the compute dtype.
    quantization: Any = None
    # gpt-oss's experts in MXFP4 as published (Mxfp4Config; models/gpt_oss.py); None: not.
    mxfp4: Any = None
    # DeepSeek-V2/V3 (config/deepseek.py): multi-head latent attention and the DeepSeekMoE router.
    # With `mla`, num_kv_heads is 1 (every head reads the one latent) and head_dim is a query's
    # (nope + rope) dimension; the cache's width is mla.latent_dim (attention/kv_spec.py).
    mla: Any = None
    deepseek_routing: Any = None

    @property
    def rotary_dim(self) -> int:
        """The dimensions rope rotates: MLA's rope part, else the whole head."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_window(self, layer: int) -> int:
        """Layer `layer`'s attention window in positions (0: the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @classmethod
    def from_hf(cls, hf: Any, generation_eos: Any = None, quantization: str | None = None) -> "ModelConfig":
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            for a in archs:
                if a in UNSUPPORTED_HINTS:
                    raise UnsupportedModelError(f"unsupported architecture {a}: {UNSUPPORTED_HINTS[a]}")
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
        if rope_type not in ("default", "llama3", "yarn"):
            raise UnsupportedModelError(f"unsupported rope type {rope_type!r} (config key rope_scaling/rope_parameters"
                                        f".rope_type; supported: default, llama3, yarn)")
        eos = generation_eos if generation_eos is not None else getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope["rope_type"] = rope_type
        rope.pop("type", None)
        fields = {**moe_fields(arch, hf), **gpt_oss_fields(arch, hf), **deepseek_fields(arch, hf, rope)}
        quant = parse_quantization(getattr(hf, "quantization_config", None), quantization, arch)
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            **{"num_kv_heads": getattr(hf, "num_key_value_heads", None) or heads, "head_dim": head_dim, **fields},
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            # Qwen2-MoE names it qkv_bias (and may turn it off); the others attention_bias.
            qkv_bias=(bool(hf.qkv_bias) if hasattr(hf, "qkv_bias") else
                      bool(getattr(hf, "attention_bias", default_bias)) or default_bias),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=qk_norm,
            rope_theta=theta,
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, (list, dict)))),
            eos_token_ids=eos_ids,
            quantization=None if isinstance(quant, Mxfp4Config) else quant,
            mxfp4=quant if isinstance(quant, Mxfp4Config) else None,
        )


def gpt_oss_fields(arch: str, hf: Any) -> dict[str, Any]:
    """gpt-oss's attention and expert fields of ModelConfig ({} for the other architectures).
    Its experts are `intermediate_size` wide and every layer is sparse, as Mixtral's; routing is a
    softmax over the k largest logits (= the renormalised top-k of a softmax over all E)."""
    if arch != "GptOssForCausalLM":
        return {}
    if getattr(hf, "quantization_config", None) is not None:
        qc = hf.quantization_config
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        if method != "mxfp4":  # read by config/quantization.py
            raise UnsupportedModelError(f"{arch}: quantization_config.quant_method = {method!r}: gpt-oss runs "
                                        f"unquantized (bf16/fp32) and MXFP4 (quant_method mxfp4) checkpoints only")
    n = hf.num_hidden_layers
    types = list(getattr(hf, "layer_types", None) or [])
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"{arch}: layer_types must name sliding_attention or full_attention for each of "
                                    f"the {n} layers, got {types}")
    window = getattr(hf, "sliding_window", None) or 0
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and window <= 0:
        raise UnsupportedModelError(f"{arch}: sliding_window = {window!r} with sliding_attention layers "
                                    f"{list(sliding)}")
    limit = float(getattr(hf, "swiglu_limit", 7.0))
    if not limit > 0:
        raise UnsupportedModelError(f"{arch}: swiglu_limit must be > 0, got {limit}")
    bias = bool(getattr(hf, "attention_bias", True))
    return dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True, moe_layers=tuple(range(n)),
                o_bias=bias, attention_sinks=True, sliding_window=int(window) if sliding else 0,
                sliding_layers=sliding, swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)), swiglu_limit=limit)


def moe_fields(arch: str, hf: Any) -> dict[str, Any]:
    """The MoE fields of ModelConfig from a Hugging Face config ({} for dense architectures)."""
    if arch == "MixtralForCausalLM":
        # Mixtral: every layer sparse, experts as wide as `intermediate_size`, top-k always
        # renormalised (transformers: softmax over all experts, top-k, divide by their sum).
        return dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True,
                    moe_layers=tuple(range(hf.num_hidden_layers)))
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    if getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true: sliding-window attention is not "
                                    f"implemented (every layer attends to the whole context)")
    only_dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    layers = tuple(i for i in range(hf.num_hidden_layers)
                   if i not in only_dense and hf.num_experts > 0 and (i + 1) % step == 0)
    return dict(num_experts=hf.num_experts if layers else 0, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size,
                shared_expert_intermediate_size=(getattr(hf, "shared_expert_intermediate_size", 0) or 0
                                                 if arch == "Qwen2MoeForCausalLM" else 0),
                norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)), moe_layers=layers)
