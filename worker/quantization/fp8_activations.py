"""Activations handed to an FP8 linear already quantized, and the layout its W8A8 GEMM reads.

Why: an FP8 linear on its W8A8 path (fp8_linear.py: more than FP8_GEMV_MAX_M rows on a GPU
with FP8 tensor cores) quantizes its input in a pass of its own (kernels/fp8_quant.py) before
the GEMM: one more read and write of the activations and a launch per linear, 5-65 us each at
Llama-3.1-8B sizes (docs/fp8-gpu-results.md). The RMSNorm before qkv_proj / gate_up_proj and
the SiLU·mul before down_proj can write that quantized form themselves (kernels/rms_norm_fp8.py,
kernels/silu_and_mul_fp8.py, bit for bit what the separate pass writes). The model asks the
linear after the op (`fp8_linear.fp8_input_format`) which `Fp8ActFormat` it reads for this many
rows; None means: give it the activations as they are (the decode GEMV multiplies unquantized
activations; the CPU path dequantized the weight; a static activation scale; the switch off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8ActFormat:
    """How a GEMM reads its quantized activations (kernels/fp8_quant.quantize_fp8's arguments)."""

    group_size: int | None  # None: one scale per token (row-wise _scaled_mm); 128: per token and 128 columns
    mn_major: bool  # scales token-major, strides (1, M') (cuBLASLt's block scaling); else row-major
    pad_rows_to: int  # rows padded (zeros, minimum scale) to a multiple of this (cuBLASLt: PAD_M)

    def kwargs(self) -> dict:
        """The keyword arguments of quantize_fp8 and the fused quantizing ops."""
        return {"group_size": self.group_size, "mn_major_scales": self.mn_major, "pad_rows_to": self.pad_rows_to}


@dataclass(frozen=True)
class Fp8Activations:
    """An FP8 linear's input, quantized by the op before it: e4m3 values q [M', K] and fp32
    scales [M', G] in `fmt`'s layout (M' = rows padded), for `rows` tokens whose unquantized
    values had `dtype` (the linear's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    rows: int
    fmt: Fp8ActFormat
    dtype: torch.dtype
