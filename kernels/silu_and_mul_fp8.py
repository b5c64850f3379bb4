"""SwiGLU (silu(gate) * up) that writes its output quantized for an FP8 GEMM (the down projection).

Why: as rms_norm_fp8.py, the FP8 down_proj's W8A8 path then needs no separate quantization
pass. Bit for bit silu_and_mul.py then quantize_fp8: each value computed in fp32 the same way
and rounded to x's dtype (what silu_and_mul writes and quantize_fp8 would read), then
fp8_quant.py's scale and clamp per row or per 128-column group, outputs laid out by
fp8_quant.fp8_outputs. One scale per row needs the whole row in one program (one tile of
next_power_of_2(I) values, as quantize_fp8 reads a row); groups are independent, so a
program takes a run of them ([groups, 128] tiles, as fp8_quant's grouped kernel). No host
sync: CUDA-graph capturable.
Reference: reference.silu_and_mul_fp8_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_quant import GROUP_TILE, fp8_outputs, fp8_result
from pdserve.kernels.pdl import pdl_args, pdl_enter
from pdserve.kernels.reference import FP8_MAX, FP8_MIN_SCALE
from pdserve.kernels.silu_and_mul import check_silu_and_mul_input


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, M, inter, G, stride_xt, stride_qm, stride_sm, stride_sg,
                             FP8_MAX_C: tl.constexpr, MIN_SCALE: tl.constexpr, GROUP: tl.constexpr,
                             GROUPS: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (M', cdiv(G, GROUPS)); gate is x[t, :I], up is x[t, I:]. Rows past M are padding
    # (zero codes, the minimum scale, as quantize_fp8 pads).
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g[:, None] < G) & (cols < inter)
    ld = mask & (cols < (t < M).to(tl.int32) * inter)  # a padding row reads no column
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=ld, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + cols, mask=ld, other=0.0).to(tl.float32)
    # silu_and_mul.py's arithmetic, rounded to x's dtype: the values quantize_fp8 would have read.
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=1) / FP8_MAX_C, MIN_SCALE)
    tl.store(s_ptr + t * stride_sm + g * stride_sg, scale, mask=g < G)
    q = tl.minimum(tl.maximum(y / scale[:, None], -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + t * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_fp8(x: torch.Tensor, group_size: int | None = None, mn_major_scales: bool = False,
                     pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul(x) quantized as quantize_fp8(out, group_size, mn_major_scales=...,
    pad_rows_to=...) would: (e4m3 [M', I], fp32 scales [M', G]). `group_size`: None (one scale
    per row) or a power of 2 up to fp8_quant.GROUP_TILE (128: the block-scaled GEMMs)."""
    fn = "silu_and_mul_fp8"
    t, inter = check_silu_and_mul_input(fn, x)
    if group_size is not None and (group_size <= 0 or group_size & (group_size - 1) or group_size > GROUP_TILE):
        raise ValueError(f"{fn}: group_size must be a power of 2 up to {GROUP_TILE} or None, got {group_size}")
    q, scales, emulate = fp8_outputs(t, inter, group_size, mn_major_scales, pad_rows_to, x.device)
    m, groups = scales.shape
    if m and inter:
        if group_size is None:
            # One program holds the row (14336 values for Llama-3.1-8B's MLP: 16 warps, as
            # quantize_fp8 reads such a row).
            group, per = triton.next_power_of_2(inter), 1
            warps = max(1, min(16, group // 1024))
        else:
            group, per = group_size, min(triton.next_power_of_2(groups), GROUP_TILE // group_size)
            warps = max(1, min(8, per * group_size // 512))
        _silu_and_mul_fp8_kernel[(m, triton.cdiv(groups, per))](
            x, q, scales, t, inter, groups, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
            FP8_MAX_C=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, GROUP=group, GROUPS=per, num_warps=warps, **pdl_args(x.device))
    return fp8_result(q, emulate), scales
