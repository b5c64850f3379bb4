"""MXFP4 (OCP microscaling FP4) weights as gpt-oss publishes them, and their torch reference.

A weight [N, K] (N output rows, K inputs) is stored as
- `packed` uint8 [N, K // 2]: two e2m1 values per byte, the element of even index in the low
  nibble (the checkpoint's `*_blocks` [.., N, K // 32, 16] is this, viewed per 32-block);
- `scales` uint8 [N, K // 32]: one E8M0 exponent per 32 consecutive inputs, value 2^(s - 127).
The checkpoint's blocks are already [out, in] (transformers transposes after dequantizing), so
the fused MoE op reads them in its own [E, out, in] orientation without a copy.

The GPU path (kernels/fused_moe.py) decodes the nibbles inside the GEMM (W4A16); this module is
its oracle, the CPU path (dequantized at load), and what tests and `--load-format dummy` use to
make MXFP4 tensors.
"""

from __future__ import annotations

import torch

BLOCK = 32  # inputs sharing one scale
SCALE_BIAS = 127  # E8M0: value 2^(s - 127); 255 is NaN in the spec and never written here
# The 16 e2m1 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MAX = 6.0


def check_shapes(packed: torch.Tensor, scales: torch.Tensor, what: str = "MXFP4 weight") -> None:
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}: packed values and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * BLOCK:
        raise ValueError(f"{what}: packed {tuple(packed.shape)} does not match scales {tuple(scales.shape)} "
                         f"(expected [.., N, K/2] and [.., N, K/{BLOCK}])")


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[.., N, K // 2] codes and [.., N, K // 32] exponents -> [.., N, K] in `dtype` (exact: every
    e2m1 value times a power of two is representable in fp32; bf16 may flush extreme exponents)."""
    check_shapes(packed, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    lo, hi = lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [.., N, K]: even index from the low nibble
    exp = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values.unflatten(-1, (-1, BLOCK)), exp.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., N, K] float -> (packed, scales), rounding to the nearest e2m1 value under the smallest
    power-of-two scale that keeps each 32-block's largest magnitude within FP4_MAX. For tests and
    dummy weights: dequantize_mxfp4(*quantize_mxfp4(w)) is the MXFP4 twin of w."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4: the input dimension ({w.shape[-1]}) must be a multiple of {BLOCK}")
    blocks = w.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / FP4_MAX)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = blocks / torch.exp2(exp)
    lut = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=w.device)
    code = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1)  # nearest magnitude (ties: the smaller)
    code = code | ((scaled < 0) & (code > 0)).long() << 3
    code = code.flatten(-2).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), (exp.squeeze(-1) + SCALE_BIAS).to(torch.uint8)


def checkpoint_view(packed: torch.Tensor) -> torch.Tensor:
    """Our [.., N, K // 2] as the checkpoint's `*_blocks` [.., N, K // 32, 16] (a view)."""
    return packed.unflatten(-1, (-1, BLOCK // 2))
