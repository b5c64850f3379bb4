"""The expert activation of a MoE layer: what turns the gate|up projection [.., 2I] into [.., I].

One typed value, taken alike by the fused Triton op (kernels/fused_moe.py, which picks its GEMM
epilogue from it) and by its torch reference (kernels/reference.py's fused_moe_ref):
- `SiluAndMul()`: silu(gate) * up (Qwen-MoE, Mixtral, DeepSeek), the default;
- `SwigluOAI(alpha, limit)`: gpt-oss's clamped SwiGLU, gate clamped above at `limit`, up to
  [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts;
  vLLM's "swigluoai").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SiluAndMul:
    """silu(gate) * up."""


@dataclass(frozen=True)
class SwigluOAI:
    """gpt-oss's clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""

    alpha: float = 1.702  # gpt-oss's config defaults (swiglu_alpha is not in its config.json)
    limit: float = 7.0

    def __post_init__(self) -> None:
        if not self.limit > 0:
            raise ValueError(f"SwigluOAI: limit must be > 0, got {self.limit}")


MoeActivation = SiluAndMul | SwigluOAI
SILU_AND_MUL = SiluAndMul()


def check_activation(fn: str, activation: object) -> MoeActivation:
    if not isinstance(activation, (SiluAndMul, SwigluOAI)):
        raise TypeError(f"{fn}: activation must be SiluAndMul() or SwigluOAI(alpha, limit), got {activation!r}")
    return activation
