"""Dynamic FP8 (e4m3) activation quantization: per token, or per token and 128-column group.

Per token: one program per row, a pass for the row's absolute maximum, a pass that writes
x / scale rounded to e4m3, and the scale (amax / 448) for the GEMM's epilogue. Per 128-column
group: one program per row and run of up to GROUP_TILE / group_size groups, read as one
[groups, group] tile (a program of one warp per 128 values, as before, is 458k programs for
one 4096 x 14336 down_proj input). One launch per linear layer, no host sync, outputs only
allocated: CUDA-graph capturable.
Reference: reference.quantize_fp8_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor, interpreting
from pdserve.kernels.pdl import pdl_args, pdl_enter
from pdserve.kernels.reference import FP8_MAX, FP8_MIN_SCALE


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, GROUP, stride_xm, stride_qm, stride_sm, stride_sg,
                         FP8_MAX_C: tl.constexpr, MIN_SCALE: tl.constexpr, STATIC: tl.constexpr,
                         BLOCK: tl.constexpr, SINGLE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * GROUP
    x_row = x_ptr + row * stride_xm
    if SINGLE:
        # The group fits one tile (every group up to 16k columns): one read, kept in registers.
        cols = start + tl.arange(0, BLOCK)
        mask = (cols < K) & (tl.arange(0, BLOCK) < GROUP)
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = tl.maximum(tl.max(tl.abs(v), axis=0) / FP8_MAX_C, MIN_SCALE)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)
        y = tl.minimum(tl.maximum(v / scale, -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_ptr + row * stride_qm + cols, y.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for off in range(0, GROUP, BLOCK):
                cols = start + off + tl.arange(0, BLOCK)
                mask = (cols < K) & (off + tl.arange(0, BLOCK) < GROUP)
                v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
            scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_C, MIN_SCALE)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)
        for off in range(0, GROUP, BLOCK):
            cols = start + off + tl.arange(0, BLOCK)
            mask = (cols < K) & (off + tl.arange(0, BLOCK) < GROUP)
            v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(v / scale, -FP8_MAX_C), FP8_MAX_C)
            tl.store(q_ptr + row * stride_qm + cols, y.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_fp8_groups_kernel(x_ptr, q_ptr, s_ptr, M, K, G, stride_xm, stride_qm, stride_sm, stride_sg,
                                FP8_MAX_C: tl.constexpr, MIN_SCALE: tl.constexpr, GROUP: tl.constexpr,
                                GROUPS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)  # rows past M (padding) read as zeros
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # this program's groups
    c = tl.arange(0, GROUP)
    cols = g[:, None] * GROUP + c[None, :]
    mask = (g[:, None] < G) & (cols < K)
    k_row = (row < M).to(tl.int32) * K  # a padding row reads no column
    v = tl.load(x_ptr + row * stride_xm + cols, mask=(g[:, None] < G) & (cols < k_row), other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), axis=1) / FP8_MAX_C, MIN_SCALE)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g < G)
    y = tl.minimum(tl.maximum(v / scale[:, None], -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + row * stride_qm + cols, y.to(q_ptr.dtype.element_ty), mask=mask)


# Largest group read in one tile; wider rows (none in today's models) loop over tiles.
MAX_TILE = 16384
# Values one program of the grouped kernel reads (power-of-2 groups up to this size take it).
GROUP_TILE = 4096


def fp8_outputs(m: int, k: int, group_size: int | None, mn_major_scales: bool, pad_rows_to: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The outputs every FP8 activation quantizer writes (this one, and the norm / SiLU-mul
    kernels that quantize for the linear after them: rms_norm_fp8.py, silu_and_mul_fp8.py), so
    all lay them out alike: (q [M', K], scales [M', G], emulate) with M' = M rounded up to
    `pad_rows_to` and the scales row-major or token-major (quantize_fp8's doc). `emulate`: under
    the interpreter q is fp32, for fp8_result to round (Triton's interpreter rounds fp32 -> e4m3
    wrongly: 4.0 becomes 8.0; torch rounds to nearest even, as the GPU's cvt.rn.satfinite does)."""
    m = -(-m // pad_rows_to) * pad_rows_to
    groups = max(1, -(-k // (k if group_size is None else group_size))) if k else 1
    emulate = interpreting()
    q = torch.empty((m, k), dtype=torch.float32 if emulate else torch.float8_e4m3fn, device=device)
    if mn_major_scales:
        scales = torch.empty((groups, m), dtype=torch.float32, device=device).t()
    else:
        scales = torch.empty((m, groups), dtype=torch.float32, device=device)
    return q, scales, emulate


def fp8_result(q: torch.Tensor, emulate: bool) -> torch.Tensor:
    """q as e4m3 (the interpreter's fp32 values rounded by torch: fp8_outputs)."""
    return q.to(torch.float8_e4m3fn) if emulate else q


def quantize_fp8(x: torch.Tensor, group_size: int | None = None,
                 static_scale: torch.Tensor | None = None,
                 mn_major_scales: bool = False, pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, G]); G = ceil(K / group_size), or 1 per row
    (group_size None), or the static per-tensor scale [1] repeated per row.

    `mn_major_scales`: the scales [M, G] are laid out token-major, strides (1, M) (each group's
    column of M scales contiguous), the layout cuBLASLt's 1x128 block scaling reads
    (torch's scaled_mm with BlockWise1x128: kernels/fp8_scaled_mm.py); default row-major (1 per
    row's groups contiguous), the layout of the Triton block GEMM. `pad_rows_to`: both outputs get
    M rounded up to a multiple of it, the extra rows zeros with the minimum scale (cuBLASLt's
    token-major scales want an aligned column stride); power-of-2 groups only."""
    fn = "quantize_fp8"
    check_tensor(fn, "x", x, (None, None), FLOAT_DTYPES)
    if static_scale is not None:
        check_tensor(fn, "static_scale", static_scale, (1,), (torch.float32,))
        check_devices(fn, x=x, static_scale=static_scale)
        group_size = None
    else:
        check_devices(fn, x=x)
    if x.stride(-1) != 1:
        raise ValueError(f"{fn}: x must be contiguous in its last dimension, got strides {x.stride()}")
    m_real, k = x.shape
    group = k if group_size is None else group_size
    grouped = group_size is not None and group == triton.next_power_of_2(group) and group <= GROUP_TILE
    q, scales, emulate = fp8_outputs(m_real, k, group_size, mn_major_scales, pad_rows_to, x.device)
    m, groups = scales.shape
    if m != m_real and not grouped:
        raise ValueError(f"{fn}: pad_rows_to needs a power-of-2 group_size up to {GROUP_TILE}, got {group_size}")
    if m and k and grouped:
        per = min(triton.next_power_of_2(groups), GROUP_TILE // group)
        _quantize_fp8_groups_kernel[(m, triton.cdiv(groups, per))](
            x, q, scales, m_real, k, groups, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
            FP8_MAX_C=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, GROUP=group, GROUPS=per,
            num_warps=max(1, min(8, per * group // 512)), **pdl_args(x.device))
    elif m and k:
        # A decode step quantizes one row per linear: that row is one program's, so its whole
        # group is read in one wide tile (16 warps for 16k columns) rather than in a serial loop.
        block = min(triton.next_power_of_2(group), MAX_TILE)
        _quantize_fp8_kernel[(m, groups)](
            x, q, scales, static_scale if static_scale is not None else scales, k, group,
            x.stride(0), q.stride(0), scales.stride(0), scales.stride(1), FP8_MAX_C=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
            STATIC=static_scale is not None, BLOCK=block, SINGLE=block >= group,
            num_warps=max(1, min(16, block // 1024)), **pdl_args(x.device))
    return fp8_result(q, emulate), scales
