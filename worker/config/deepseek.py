"""DeepSeek-V2/V3's shape (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; R1, V3.1 and Kimi-K2
ship the V3 architecture): multi-head latent attention (MLA) and DeepSeekMoE routing, read from a
Hugging Face config into frozen values the model (models/deepseek.py) is built from.

MLA: every layer projects a token to one latent of `kv_lora_rank` values (RMS-normed) plus one
shared rope key of `qk_rope_head_dim` values; that pair is all the KV cache holds per token and
layer (attention/kv_spec.py). Each head's key is its up-projection of the latent (qk_nope_head_dim)
joined to the shared rope key; its value is a second up-projection (v_head_dim).

DeepSeekMoE: the first `first_k_dense_replace` layers are dense; the others route each token to
`num_experts_per_tok` of `n_routed_experts` experts and add `n_shared_experts` always-on experts.
V3 scores experts by sigmoid, picks with `e_score_correction_bias` added, limits the choice to the
`topk_group` best of `n_group` expert groups (a group's score: the sum of its two best), and
weights by the unbiased scores (renormalised with `norm_topk_prob`) times `routed_scaling_factor`.
V2 scores by softmax, `topk_method` greedy or group_limited_greedy (a group's score: its best).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.worker.config.unsupported_model import UnsupportedModelError

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

# Keys of later DeepSeek attention variants this engine does not compute: a config carrying any of
# them (V3.2's lightning indexer for sparse attention, V4's compressed attention) is refused by name
# rather than run as dense MLA, which would give other outputs than the model was trained for.
UNSUPPORTED_KEYS = ("index_topk", "index_n_heads", "index_head_dim", "compress_rates", "compress_ratio",
                    "compress_rope_theta")


@dataclass(frozen=True)
class MlaConfig:
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope over pairs (x0, x1), (x2, x3), ... (V2 always; V3 as configured)
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the cache holds per token and layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeepseekRouting:
    scoring: str  # "sigmoid" (V3) | "softmax" (V2)
    n_group: int  # expert groups (1: no group limit)
    topk_group: int  # groups a token may pick from
    group_score: str  # "top2_sum" (V3) | "max" (V2's group_limited_greedy)
    correction_bias: bool  # V3's e_score_correction_bias (added for the choice only)
    routed_scaling_factor: float
    n_shared_experts: int


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def deepseek_fields(arch: str, hf: Any, rope: dict) -> dict[str, Any]:
    """ModelConfig's fields for a DeepSeek config ({} for other architectures). `rope`: the rope
    parameters as ModelConfig.from_hf read them (for YaRN's mscale on the softmax scale)."""
    if arch not in DEEPSEEK_ARCHITECTURES:
        return {}
    for key in UNSUPPORTED_KEYS:
        if getattr(hf, key, None) is not None:
            raise UnsupportedModelError(f"{arch}: config key {key!r} ({getattr(hf, key)!r}) names an attention "
                                        f"variant pdserve does not implement (DeepSeek-V3.2 sparse / V4 compressed "
                                        f"attention); only dense MLA runs")
    v3 = arch == "DeepseekV3ForCausalLM"
    nope, rope_dim, v_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim
    scale = (nope + rope_dim) ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    mla = MlaConfig(q_lora_rank=getattr(hf, "q_lora_rank", None) or None, kv_lora_rank=hf.kv_lora_rank,
                    qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=v_dim,
                    rope_interleave=bool(getattr(hf, "rope_interleave", True)) if v3 else True, softmax_scale=scale)
    n = hf.num_hidden_layers
    experts = getattr(hf, "n_routed_experts", None) or 0
    dense = getattr(hf, "first_k_dense_replace", 0) or 0
    freq = getattr(hf, "moe_layer_freq", 1) or 1
    moe_layers = tuple(i for i in range(n) if experts and i >= dense and i % freq == 0)
    if v3:
        scoring, method = getattr(hf, "scoring_func", "sigmoid") or "sigmoid", "noaux_tc"
    else:
        scoring, method = getattr(hf, "scoring_func", "softmax") or "softmax", getattr(hf, "topk_method", "greedy")
    if (v3 and scoring != "sigmoid") or (not v3 and scoring != "softmax"):
        raise UnsupportedModelError(f"{arch}: scoring_func {scoring!r} is not implemented "
                                    f"({'sigmoid' if v3 else 'softmax'} only, as transformers computes it)")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise UnsupportedModelError(f"{arch}: topk_method {method!r} is not implemented "
                                    f"(greedy, group_limited_greedy; V3: noaux_tc)")
    grouped = v3 or method == "group_limited_greedy"
    n_group = (getattr(hf, "n_group", None) or 1) if grouped else 1
    topk_group = (getattr(hf, "topk_group", None) or n_group) if grouped else 1
    if experts and (experts % n_group or not 0 < topk_group <= n_group):
        raise UnsupportedModelError(f"{arch}: n_group {n_group} / topk_group {topk_group} do not divide "
                                    f"n_routed_experts {experts} into groups a token can pick from")
    shared = getattr(hf, "n_shared_experts", 0) or 0
    routing = DeepseekRouting(scoring=scoring, n_group=n_group, topk_group=topk_group,
                              group_score="top2_sum" if v3 else "max", correction_bias=v3,
                              routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
                              n_shared_experts=shared)
    return dict(num_kv_heads=1, head_dim=nope + rope_dim, mla=mla, deepseek_routing=routing,
                num_experts=experts if moe_layers else 0, num_experts_per_tok=hf.num_experts_per_tok or 0,
                moe_intermediate_size=hf.moe_intermediate_size,
                shared_expert_intermediate_size=hf.moe_intermediate_size * shared,
                # transformers' V2 router never renormalises (its norm_topk_prob is unread); V3's does.
                norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)) if v3 else False,
                moe_layers=moe_layers)
