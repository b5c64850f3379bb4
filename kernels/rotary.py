"""Rotary position embedding (NeoX / Llama "rotate half" style)."""

from __future__ import annotations

import torch


def rotary_ref(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat([-x2, x1], -1)
        return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)

    return rot(q), rot(k)
