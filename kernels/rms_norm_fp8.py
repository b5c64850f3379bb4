"""RMSNorm (optionally fused with the residual add) that writes its output quantized for an FP8 GEMM.

An FP8 linear taking the W8A8 path (worker/quantization/fp8_linear.py: more than 16 rows on a
GPU with FP8 tensor cores) reads e4m3 activations and fp32 scales. Written by the norm before
it, they cost no separate quantization pass (kernels/fp8_quant.py: one more read and write of
the activations and a launch per linear). Bit for bit the same numbers as rms_norm.py then
quantize_fp8: the norm's steps are rms_norm.py's (one program per row, its sum of squares over
the same tile with the same warps, so in the same order), its output is rounded to the output
dtype first (what quantize_fp8 would read), and the scales and codes follow fp8_quant.py's
formula (amax / 448, at least FP8_MIN_SCALE; x / scale clamped to +-448). The outputs are laid
out by fp8_quant.fp8_outputs, as quantize_fp8 lays them out for the same GEMM. No host sync:
CUDA-graph capturable.
Reference: reference.rms_norm_fp8_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_quant import fp8_outputs, fp8_result
from pdserve.kernels.launch import check_devices, check_tensor
from pdserve.kernels.pdl import pdl_args, pdl_enter
from pdserve.kernels.reference import FP8_MAX, FP8_MIN_SCALE
from pdserve.kernels.rms_norm import check_rms_norm_args


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, q_ptr, s_ptr,
    M, G, eps,
    stride_xt, stride_rt, stride_ot, stride_nt, stride_qm, stride_sm, stride_sg,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    WRITE_OUT: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program per row (rows past M: padding for the GEMM's scale layout, read as zeros and
    # written only as zero codes with the minimum scale, as quantize_fp8 pads).
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    limit = (t < M).to(tl.int32) * HIDDEN  # a padding row reads no column
    # The sum of squares over rms_norm.py's 1-D tile, and nothing else from that tile: its layout,
    # and so the order of the sum, stay rms_norm's (bit-equal rstd), whatever the 2-D part does.
    cols = tl.arange(0, BLOCK)
    mask = cols < limit
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream keeps x's dtype
        tl.store(new_res_ptr + t * stride_nt + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    # The row again (from cache) as [groups, GROUP] (GROUP = BLOCK for one scale per row):
    # normalised element by element as rms_norm does, then fp8_quant.py's steps per group.
    g = tl.arange(0, BLOCK // GROUP)
    cols2 = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask2 = cols2 < limit
    x2 = tl.load(x_ptr + t * stride_xt + cols2, mask=mask2, other=0.0)
    if HAS_RESIDUAL:
        r2 = tl.load(res_ptr + t * stride_rt + cols2, mask=mask2, other=0.0)
        x2 = (x2.to(tl.float32) + r2.to(tl.float32)).to(x2.dtype)
    w = tl.load(w_ptr + cols2, mask=cols2 < HIDDEN, other=0.0)
    normed = (x2.to(tl.float32) * rstd).to(x2.dtype).to(tl.float32)
    # Rounded to the output dtype before quantizing: the values quantize_fp8 would have read.
    y = (normed * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if WRITE_OUT:
        tl.store(out_ptr + t * stride_ot + cols2, y, mask=mask2)
    v = y.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), axis=1) / FP8_MAX_C, MIN_SCALE)
    tl.store(s_ptr + t * stride_sm + g * stride_sg, scale, mask=g < G)
    q = tl.minimum(tl.maximum(v / scale[:, None], -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + t * stride_qm + cols2, q.to(q_ptr.dtype.element_ty), mask=cols2 < HIDDEN)


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    group_size: int | None = None,
    mn_major_scales: bool = False,
    pad_rows_to: int = 1,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """rms_norm(x, weight, eps, residual) quantized as quantize_fp8(normed, group_size,
    mn_major_scales=..., pad_rows_to=...) would: (e4m3 [M', H], fp32 scales [M', G], new residual
    (x + residual; None without a residual)). `group_size`: None (one scale per row) or a power
    of 2 (128: the block-scaled GEMMs). `out` [M, H] (optional, rms_norm's output dtype): also
    receives the unquantized output (the tests compare it with rms_norm's)."""
    fn = "rms_norm_fp8"
    t, hidden = check_rms_norm_args(fn, x, weight, eps, residual)
    if group_size is not None and (group_size <= 0 or group_size & (group_size - 1)):
        raise ValueError(f"{fn}: group_size must be a power of 2 or None, got {group_size}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    q, scales, emulate = fp8_outputs(t, hidden, group_size, mn_major_scales, pad_rows_to, x.device)
    m, groups = scales.shape
    if out is not None:
        check_tensor(fn, "out", out, (t, hidden), (out_dtype,))
        check_devices(fn, x=x, out=out)
        if out.stride(-1) != 1:
            raise ValueError(f"{fn}: out must be contiguous in its last dimension, got strides {out.stride()}")
    new_res = torch.empty_like(x) if residual is not None else None
    if m and hidden:
        block = triton.next_power_of_2(hidden)
        # The tile and warps of rms_norm.py (its sum order); wide enough for one whole group.
        block = max(block, group_size or 1)
        # Where the output is not kept (never written then), a tensor of its dtype gives the kernel
        # the dtype to round to: x itself in the usual case, no allocation.
        out_arg = out if out is not None else x if x.dtype == out_dtype else torch.empty(1, dtype=out_dtype,
                                                                                        device=x.device)
        _rms_norm_fp8_kernel[(m,)](
            x, residual if residual is not None else x, weight, out_arg, new_res if new_res is not None else x,
            q, scales, t, groups, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0) if out is not None else 0,
            new_res.stride(0) if new_res is not None else 0, q.stride(0), scales.stride(0), scales.stride(1),
            HIDDEN=hidden, BLOCK=block, GROUP=block if group_size is None else group_size,
            HAS_RESIDUAL=residual is not None, WRITE_OUT=out is not None, FP8_MAX_C=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
            num_warps=min(max(triton.next_power_of_2(hidden) // 1024, 1), 16),
            **pdl_args(x.device),
        )
    return fp8_result(q, emulate), scales, new_res
