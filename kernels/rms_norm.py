"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]; if given, x + residual is normalised
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new_residual); new_residual = x + residual (None if no residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    # Same op order as Hugging Face's LlamaRMSNorm, so fp32 results match bit for bit.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual
